//! Agents this process did not start: after a restart, a provider whose
//! sandboxes outlive the server (a container keeps running) reports some
//! of them with their agent still running. Their ends come through no
//! [`crate::provider::Launched`], so without a watch a killed container
//! would leave its run `running` until the run silence bound (minutes):
//! the agent never reconnects, and nothing else says it died.
//!
//! Each such sandbox is watched by polling the provider's state until its
//! agent no longer runs. A watch is forgotten once this process launches
//! or resumes an agent in the sandbox, or retires it: a late notice of the
//! adopted agent's end must not be taken for the new agent's.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::AbortHandle;

use crate::provider::{Found, SandboxProvider};

/// How often an adopted agent's sandbox is looked at: a few provider calls
/// a second at most per adopted sandbox, and its run failed within about
/// this long of its container's death.
const POLL: Duration = Duration::from_secs(1);

/// The watches of adopted agents, by sandbox.
#[derive(Debug, Default)]
pub(super) struct Adopted {
    watches: HashMap<String, AbortHandle>,
}

impl Adopted {
    /// Watches `sandbox_id`'s adopted agent: `ended(sandbox_id)` is called
    /// once the provider no longer finds it running.
    pub fn watch<P, F>(
        &mut self,
        provider: Arc<P>,
        sandbox_id: String,
        ended: impl FnOnce(String) -> F + Send + 'static,
    ) where
        P: SandboxProvider,
        F: Future<Output = ()> + Send + 'static,
    {
        let id = sandbox_id.clone();
        let task = tokio::spawn(async move {
            let mut poll = tokio::time::interval(POLL);
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            poll.tick().await;
            loop {
                poll.tick().await;
                match provider.state(&sandbox_id).await {
                    Ok(Found::Running) => {}
                    Ok(found) => {
                        tracing::info!(sandbox_id, ?found, "an adopted agent no longer runs");
                        ended(sandbox_id).await;
                        return;
                    }
                    Err(error) => tracing::debug!(sandbox_id, %error, "looking at an adopted agent failed"),
                }
            }
        });
        if let Some(earlier) = self.watches.insert(id, task.abort_handle()) {
            earlier.abort();
        }
    }

    /// This process starts an agent of its own in the sandbox, or retires
    /// it: the adopted agent's watch ends.
    pub fn forget(&mut self, sandbox_id: &str) {
        if let Some(watch) = self.watches.remove(sandbox_id) {
            watch.abort();
        }
    }

    /// Whether a notice of `sandbox_id`'s adopted agent's end still stands
    /// (its watch was not forgotten since); the watch is done either way.
    pub fn ended(&mut self, sandbox_id: &str) -> bool {
        self.watches.remove(sandbox_id).is_some()
    }
}

impl Drop for Adopted {
    fn drop(&mut self) {
        for watch in self.watches.values() {
            watch.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use tokio::sync::mpsc;

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
        async fn stop(&self, _: &str, _: Duration) {}
        async fn wait_exit(&self, _: &str, _: Duration) -> bool {
            true
        }
        async fn delete(&self, _: &str) -> Result<(), ProviderError> {
            Ok(())
        }
        async fn state(&self, _: &str) -> Result<Found, ProviderError> {
            Ok(*self.0.lock().expect("the state"))
        }
        async fn stop_all(&self, _: Duration) {}
        fn details(&self, _: &str) -> Details {
            Details::default()
        }
    }

    fn watched(adopted: &mut Adopted, provider: &Arc<Answering>) -> mpsc::UnboundedReceiver<String> {
        let (tx, rx) = mpsc::unbounded_channel();
        adopted.watch(Arc::clone(provider), "sbx_a".to_owned(), move |id| async move {
            let _ = tx.send(id);
        });
        rx
    }

    #[tokio::test(start_paused = true)]
    async fn an_adopted_agent_that_stops_running_is_reported_once() {
        let provider = Arc::new(Answering(Mutex::new(Found::Running)));
        let mut adopted = Adopted::default();
        let mut ended = watched(&mut adopted, &provider);
        tokio::time::sleep(POLL * 3).await;
        assert!(ended.try_recv().is_err(), "still running: nothing reported");
        *provider.0.lock().expect("the state") = Found::Missing;
        assert_eq!(ended.recv().await.as_deref(), Some("sbx_a"));
        assert!(adopted.ended("sbx_a"), "the notice stands");
        assert!(!adopted.ended("sbx_a"), "and only once");
    }

    #[tokio::test(start_paused = true)]
    async fn a_forgotten_watch_reports_nothing_and_its_late_notice_is_dropped() {
        let provider = Arc::new(Answering(Mutex::new(Found::Running)));
        let mut adopted = Adopted::default();
        let mut ended = watched(&mut adopted, &provider);
        // A new agent of this process's own: the adopted one's watch ends.
        adopted.forget("sbx_a");
        *provider.0.lock().expect("the state") = Found::NoAgent;
        assert_eq!(ended.recv().await, None, "the watch ended without a notice");
        assert!(!adopted.ended("sbx_a"), "a notice after the forget is not taken");
    }
}
