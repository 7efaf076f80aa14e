//! Agents this process did not start: after a restart, a provider whose
//! sandboxes outlive the server (a container keeps running) reports some
//! of them with their agent still running. Their ends come through no
//! [`crate::provider::Launched`], so without a watch a killed container
//! would leave its run `running` until the run silence bound (minutes):
//! the agent never reconnects, and nothing else says it died.
//!
//! Each such sandbox is watched by polling the provider's state until no
//! agent runs in it; the engine then reports the end with the adopted
//! agent's standby credential. If this process started an agent of its own
//! in the sandbox meanwhile, that one has another credential and the
//! machine drops the late notice (`Input::Exited`): nothing here needs to
//! know. Such a watch goes on until the sandbox stops or is deleted.

use std::time::Duration;

use crate::provider::{Found, SandboxProvider};

/// How often an adopted agent's sandbox is looked at: a few provider calls
/// a second at most per adopted sandbox, and its run failed within about
/// this long of its container's death.
const POLL: Duration = Duration::from_secs(1);

/// Returns once the provider no longer finds an agent running in
/// `sandbox_id` (a failed look is tried again at the next poll).
pub(super) async fn until_ended<P: SandboxProvider>(provider: &P, sandbox_id: &str) {
    let mut poll = tokio::time::interval(POLL);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    poll.tick().await;
    loop {
        poll.tick().await;
        match provider.state(sandbox_id).await {
            Ok(Found::Running) => {}
            Ok(found) => {
                tracing::info!(sandbox_id, ?found, "an adopted agent no longer runs");
                return;
            }
            Err(error) => tracing::debug!(sandbox_id, %error, "looking at an adopted agent failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::provider::{AgentLaunch, Details, Launched, ProviderError};

    /// A provider whose only answer is the state the test sets.
    struct Answering(Mutex<Found>);

    impl SandboxProvider for Answering {
        async fn create(&self, _: &str) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn start(&self, _: &str) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn launch(&self, _: &str, _: AgentLaunch) -> Result<Launched, ProviderError> {
            unreachable!("nothing is launched")
        }
        async fn stop(&self, _: &str) {}
        async fn wait_exit(&self, _: &str, _: Duration) -> bool {
            true
        }
        async fn delete(&self, _: &str) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn state(&self, _: &str) -> Result<Found, ProviderError> {
            Ok(*self.0.lock().expect("the state"))
        }
        async fn stop_all(&self) {}
        fn details(&self, _: &str) -> Details {
            Details::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_ends_once_the_adopted_agent_no_longer_runs() {
        let provider = Arc::new(Answering(Mutex::new(Found::Running)));
        let watch = tokio::spawn({
            let provider = Arc::clone(&provider);
            async move { until_ended(provider.as_ref(), "sbx_a").await }
        });
        tokio::time::sleep(POLL * 3).await;
        assert!(!watch.is_finished(), "still running: the watch goes on");
        *provider.0.lock().expect("the state") = Found::Missing;
        watch.await.expect("the watch ends");
    }
}
