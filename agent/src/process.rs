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
/// able to act as the sandbox).
const AGENT_ONLY: &[&str] = &["STANDBY_TOKEN"];

/// The agent's environment minus its own credentials: the base of every
/// child's environment.
pub fn child_env() -> BTreeMap<String, String> {
    std::env::vars().filter(|(name, _)| !AGENT_ONLY.contains(&name.as_str())).collect()
}

static MANAGED: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

fn managed() -> MutexGuard<'static, Option<HashSet<i32>>> {
    MANAGED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Marks `pid` as waited for by its owner, not by the orphan reaper.
pub fn register(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        managed().get_or_insert_with(HashSet::new).insert(pid);
    }
}

/// Hands `pid` back to the reaper once its owner has waited for it.
pub fn unregister(pid: u32) {
    if let (Ok(pid), Some(set)) = (i32::try_from(pid), managed().as_mut()) {
        set.remove(&pid);
    }
}

/// Whether `pid` has an owner that waits for it.
pub fn is_managed(pid: i32) -> bool {
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
