//! One pod's container from its start to its last reaping: the runs, the
//! restarts its `restartPolicy` asks for (after a back-off), graceful
//! termination, and the status of each step.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::super::objects::finalize_claims;
use super::super::process::{self, Plan};
use super::super::status;
use super::super::store::{ObjKey, now};
use super::{Control, Kubelet, lock};

/// The longest back-off before a restart. (A real kubelet backs off from
/// 10 s to 5 minutes; the fake from 1 s to this, so tests stay short.)
const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// What the supervisor learnt from its controls, across runs.
#[derive(Debug)]
struct Orders {
    control: mpsc::UnboundedReceiver<Control>,
    shutdown: watch::Receiver<bool>,
    /// A graceful stop was asked: SIGTERM sent, SIGKILL at this instant.
    grace_deadline: Option<Instant>,
    terminating: bool,
    /// Killed on request: whoever asked writes the status.
    killed: bool,
    shut_down: bool,
    acks: Vec<oneshot::Sender<()>>,
}

impl Orders {
    /// Takes one control message while nothing runs (between runs): any
    /// stop means no restart.
    fn note(&mut self, c: Control) {
        match c {
            Control::Terminate { .. } => self.terminating = true,
            Control::Kill { ack } => {
                self.killed = true;
                self.acks.extend(ack);
            }
        }
    }

    fn stopping(&self) -> bool {
        self.terminating || self.killed || self.shut_down
    }
}

/// One run of the container: when it started, and what its status carries
/// over from earlier runs.
#[derive(Debug)]
struct RunInfo<'a> {
    started_at: &'a str,
    restart_count: u32,
    last: Option<&'a Value>,
}

/// Whether the policy restarts a container that exited with `code`.
fn restarts(policy: &str, code: i32) -> bool {
    match policy {
        "Never" => false,
        "OnFailure" => code != 0,
        _ => true,
    }
}

impl Kubelet {
    fn forget(&self, key: &ObjKey, uid: &str) {
        let mut runtimes = lock(&self.runtimes);
        if runtimes.get(&(key.namespace.clone(), key.name.clone())).is_some_and(|rt| rt.uid == uid) {
            runtimes.remove(&(key.namespace.clone(), key.name.clone()));
        }
    }

    /// Owns one pod's container from its start to its last reaping.
    pub(super) async fn supervise(
        self: Arc<Self>,
        key: ObjKey,
        uid: String,
        plan: Arc<Plan>,
        control: mpsc::UnboundedReceiver<Control>,
    ) {
        let log = self.log_path(&key, &uid);
        let policy = self
            .store
            .get(&key)
            .and_then(|p| p.pointer("/spec/restartPolicy").and_then(Value::as_str).map(str::to_owned))
            .unwrap_or_else(|| "Always".into());
        let mut orders = Orders {
            control,
            shutdown: self.shutdown.clone(),
            grace_deadline: None,
            terminating: false,
            killed: false,
            shut_down: false,
            acks: Vec::new(),
        };
        let mut restart_count = 0u32;
        let mut last: Option<Value> = None;
        let mut ended = None;
        while !orders.stopping() {
            let started_at = now();
            let info = RunInfo { started_at: &started_at, restart_count, last: last.as_ref() };
            let Some(code) = self.run_once(&key, &uid, &plan, &log, &info, &mut orders).await else {
                break;
            };
            ended = Some((code, started_at.clone()));
            let deleting = self.store.get(&key).is_some_and(|p| p.pointer("/metadata/deletionTimestamp").is_some());
            if orders.stopping() || deleting || !restarts(&policy, code) {
                break;
            }
            let backoff = Duration::from_secs(1 << restart_count.min(3)).min(MAX_BACKOFF);
            restart_count += 1;
            let crash = status::crash_loop(&plan.container, &plan.image, code, &started_at, backoff.as_secs());
            last = crash.pointer("/containerStatuses/0/lastState").cloned();
            self.set_status(&key, &uid, status::with_restarts(crash, restart_count, None), false);
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                Some(c) = orders.control.recv() => orders.note(c),
                () = super::super::stopped(&mut orders.shutdown) => orders.shut_down = true,
            }
        }
        self.forget(&key, &uid);
        if orders.shut_down {
            return;
        }
        if !orders.killed
            && let Some((code, started_at)) = ended
        {
            let done = status::terminated(&plan.container, &plan.image, &started_at, code);
            self.set_status(&key, &uid, status::with_restarts(done, restart_count, last.as_ref()), false);
        }
        if !orders.killed && self.store.get(&key).is_some_and(|p| p.pointer("/metadata/deletionTimestamp").is_some()) {
            self.store.remove_if_uid(&key, &uid);
            finalize_claims(&self.store, &self.root);
        }
        for ack in orders.acks.drain(..) {
            let _ = ack.send(());
        }
    }

    /// Runs the container once, to its reaping: its exit code, or None if
    /// it did not start or the fake shut down.
    async fn run_once(
        &self,
        key: &ObjKey,
        uid: &str,
        plan: &Plan,
        log: &Path,
        info: &RunInfo<'_>,
        orders: &mut Orders,
    ) -> Option<i32> {
        let spawned = std::fs::create_dir_all(self.root.join("logs"))
            .and_then(|()| process::container_command(plan, log))
            .and_then(|mut cmd| cmd.spawn());
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                self.set_status(key, uid, status::failed("RunContainerError", &format!("start: {e}")), true);
                orders.killed = true;
                return None;
            }
        };
        let unshare = child.id();
        self.update_runtime(key, uid, |rt| rt.unshare = unshare);
        let pid1 = match unshare {
            Some(pid) => process::child_of(pid).await,
            None => None,
        };
        self.update_runtime(key, uid, |rt| rt.pid1 = pid1);
        if pid1.is_some() {
            let running = status::running(&plan.container, &plan.image, info.started_at);
            self.set_status(key, uid, status::with_restarts(running, info.restart_count, info.last), true);
        }
        // SIGKILL to PID 1 takes the whole PID namespace down, and `unshare`
        // reaps it before exiting: once `unshare` is reaped, nothing of the
        // run is left. (Killing `unshare` first would orphan a dying PID 1.)
        let kill_now = || match pid1 {
            Some(pid) => process::signal(pid, Signal::SIGKILL),
            None => unshare.into_iter().for_each(|g| process::signal_group(g, Signal::SIGKILL)),
        };
        let term = |orders: &mut Orders, grace: u64| {
            if orders.grace_deadline.is_none() {
                match pid1 {
                    Some(pid) => process::signal(pid, Signal::SIGTERM),
                    None => kill_now(),
                }
                orders.grace_deadline = Some(Instant::now() + Duration::from_secs(grace));
            }
            orders.terminating = true;
        };
        let exit = loop {
            let deadline = orders.grace_deadline;
            let grace_over = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                exit = child.wait() => break exit,
                Some(c) = orders.control.recv() => match c {
                    Control::Terminate { grace } => term(orders, grace),
                    Control::Kill { ack } => {
                        kill_now();
                        orders.killed = true;
                        orders.acks.extend(ack);
                    }
                },
                () = grace_over => {
                    kill_now();
                    orders.grace_deadline = None;
                }
                () = super::super::stopped(&mut orders.shutdown) => {
                    kill_now();
                    let _ = child.wait().await;
                    orders.shut_down = true;
                    return None;
                }
            }
        };
        // Whatever PID 1 left behind in its process group goes with it.
        if let Some(pgid) = unshare {
            process::signal_group(pgid, Signal::SIGKILL);
        }
        if let Some(pid) = pid1 {
            process::wait_gone(pid, Duration::from_secs(5)).await;
        }
        self.update_runtime(key, uid, |rt| rt.pid1 = None);
        Some(exit.map(process::exit_code).unwrap_or(137))
    }
}
