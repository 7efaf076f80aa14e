//! What every child process of the agent shares: its environment and its
//! place in the registry of processes the agent owns.
//!
//! The agent may run as PID 1 (or as a child subreaper) and then reaps
//! orphans it did not start. The registry tells the reaper which zombies
//! belong to an owner that will wait for them itself, so the two never race
//! for the same exit status.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Variables that configure the agent and must not leak to children: the
/// standby credential above all (a setup step or MCP server must never be
/// able to act as the sandbox), and where it came from.
const AGENT_ONLY: &[&str] = &standby_protocol::vars::CREDENTIAL;

/// Makes the agent not dumpable (`PR_SET_DUMPABLE` 0): its `/proc/<pid>/`
/// files then belong to root, so a process of the same user (the run, an
/// MCP server) cannot read its environment (the standby credential) or
/// memory (every credential), nor attach to it; and it leaves no core
/// dump. Children are not affected: the kernel makes a process dumpable
/// again when it executes a program that is not set-uid.
pub fn make_undumpable() -> Result<(), nix::Error> {
    nix::sys::prctl::set_dumpable(false)
}

/// The agent's environment minus its own credentials: the base of every
/// child's environment.
pub(crate) fn child_env() -> BTreeMap<String, String> {
    std::env::vars().filter(|(name, _)| !AGENT_ONLY.contains(&name.as_str())).collect()
}

/// Runs blocking `work` (a `/proc` scan, a `waitpid`, a fork) on tokio's
/// blocking pool, off the runtime's thread, which also carries the control
/// socket's heartbeats. `None` if it panicked (the panic is logged).
pub(crate) async fn off_runtime<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(value) => Some(value),
        Err(error) => {
            tracing::warn!(%error, "a blocking task failed");
            None
        }
    }
}

/// Spawns `command` off the runtime's thread: `fork` copies the agent's
/// page tables and `exec` reads the program before `spawn` returns.
pub(crate) async fn spawn(mut command: tokio::process::Command) -> std::io::Result<tokio::process::Child> {
    off_runtime(move || command.spawn())
        .await
        .unwrap_or_else(|| Err(std::io::Error::other("the task spawning the process failed")))
}

static MANAGED: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

fn managed() -> MutexGuard<'static, Option<HashSet<i32>>> {
    MANAGED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Marks `pid` as waited for by its owner, not by the orphan reaper.
pub(crate) fn register(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        managed().get_or_insert_with(HashSet::new).insert(pid);
    }
}

/// Hands `pid` back to the reaper once its owner has waited for it.
pub(crate) fn unregister(pid: u32) {
    if let (Ok(pid), Some(set)) = (i32::try_from(pid), managed().as_mut()) {
        set.remove(&pid);
    }
}

/// Whether `pid` has an owner that waits for it.
pub(crate) fn is_managed(pid: i32) -> bool {
    managed().as_ref().is_some_and(|set| set.contains(&pid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_round_trip() {
        register(4_000_001);
        assert!(is_managed(4_000_001));
        unregister(4_000_001);
        assert!(!is_managed(4_000_001));
    }
}
