//! `standby hold`: the PID 1 of a container that the Docker provider keeps
//! between turns.
//!
//! Under the Docker provider the agent is not the container's first
//! process: each agent start (the first launch, a Tier 2 follow-up, a Tier 1
//! resume) is an Engine API exec of `standby` with a fresh credential on its
//! standard input, and an exec cannot be the container's PID 1. Something
//! must keep the container alive between two agents and reap what their
//! children leave behind; that is this subcommand, so the image keeps one
//! program as its entrypoint (ARCHITECTURE.md, "The container's PID 1").
//!
//! It does three things, decided by [`respond`] from the signal it got:
//! - `SIGCHLD`: reaps every exited child. As PID 1 it inherits every orphan
//!   of the namespace, and it has no child of its own whose status anyone
//!   else wants, so `waitpid(-1)` steals nothing;
//! - `SIGUSR1`: kills every other process of the container (`kill(-1)`
//!   from PID 1 spares only itself): the provider's way to clear what a
//!   finished turn left running while the container, its filesystem and
//!   page cache stay warm for the next turn (Tier 2);
//! - `SIGTERM` / `SIGINT` (`docker stop`): passes `SIGTERM` on to every
//!   other process, waits until they are gone, and exits 0; the engine's
//!   stop timeout bounds the wait with SIGKILL.
//!
//! It touches no credential, opens no socket and starts no process.
//!
//! A platform with no signal call of its own (Kubernetes has exec, not
//! kill) asks from inside the container, with two more words run as an
//! exec beside it:
//! - `standby clear`: sends `SIGUSR1` to PID 1 and waits to be killed by
//!   the clearing it asked for. Its end by `SIGKILL` is the proof that PID
//!   1 cleared the container; it exits 1 when that did not come within
//!   [`CLEAR_WAIT`] (PID 1 is not `standby hold`);
//! - `standby busy`: exits 0 when a process other than PID 1 and itself
//!   runs in the container (an agent, or what a turn left), 1 when none
//!   does: whether a container adopted after a server restart has an agent.

use std::process::ExitCode;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use standby_protocol::ExitCode as Exit;

/// The signals `hold` answers; every other one keeps its default action
/// (which, for PID 1, the kernel ignores unless it has a handler).
const SIGNALS: [Signal; 4] = [Signal::SIGCHLD, Signal::SIGUSR1, Signal::SIGTERM, Signal::SIGINT];

/// How often the stopping `hold` looks whether the others are gone.
const STOP_POLL: Duration = Duration::from_millis(50);

/// How long `standby clear` waits for the clearing to reach it.
const CLEAR_WAIT: Duration = Duration::from_secs(10);

/// What `hold` does on a signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Response {
    /// Reap the exited children.
    Reap,
    /// Kill every other process of the container, then reap.
    Clear,
    /// Pass SIGTERM on, wait for the others, exit.
    Stop,
}

/// The decision, without IO.
fn respond(signal: Signal) -> Response {
    match signal {
        Signal::SIGUSR1 => Response::Clear,
        Signal::SIGTERM | Signal::SIGINT => Response::Stop,
        _ => Response::Reap,
    }
}

/// Reaps every child that has exited; whether any child is left.
fn reap() -> bool {
    loop {
        match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => return true,
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => return false,
        }
    }
}

/// Whether a process other than this one is in the PID namespace
/// (`/proc` of the container shows only its own).
fn others_alive() -> bool {
    let me = std::process::id();
    std::fs::read_dir("/proc").is_ok_and(|entries| {
        entries
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .any(|pid| pid != me && !zombie(pid))
    })
}

/// The pids of the PID namespace other than PID 1 and this process.
fn others_than_pid_one() -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc").map_or_else(
        |_| Vec::new(),
        |entries| {
            entries
                .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter(|&pid| pid != me && pid != 1 && !zombie(pid))
                .collect()
        },
    )
}

/// `standby clear`: PID 1 is asked to kill every other process, this one
/// included; returning at all means it did not.
pub fn clear() -> ExitCode {
    if let Err(error) = kill(Pid::from_raw(1), Signal::SIGUSR1) {
        eprintln!("standby clear: cannot signal PID 1: {error}");
        return ExitCode::from(1);
    }
    std::thread::sleep(CLEAR_WAIT);
    eprintln!("standby clear: PID 1 did not clear the container within {CLEAR_WAIT:?} (is it `standby hold`?)");
    ExitCode::from(1)
}

/// `standby busy`: 0 when another process than PID 1 runs, else 1.
pub fn busy() -> ExitCode {
    let others = others_than_pid_one();
    if others.is_empty() { ExitCode::from(1) } else { ExitCode::SUCCESS }
}

fn zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_or(true, |stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z')))
}

/// Runs until stopped; the process's exit code.
pub fn run() -> ExitCode {
    let mut set = SigSet::empty();
    for signal in SIGNALS {
        set.add(signal);
    }
    // Blocked, then taken synchronously with sigwait: no handler, no
    // async-signal-safety to think about.
    if let Err(error) = set.thread_block() {
        eprintln!("standby hold: cannot block signals: {error}");
        return Exit::Internal.into();
    }
    loop {
        reap();
        let signal = match set.wait() {
            Ok(signal) => signal,
            Err(error) => {
                eprintln!("standby hold: waiting for a signal failed: {error}");
                return Exit::Internal.into();
            }
        };
        match respond(signal) {
            Response::Reap => {}
            Response::Clear => {
                let _ = kill(Pid::from_raw(-1), Signal::SIGKILL);
            }
            Response::Stop => {
                let _ = kill(Pid::from_raw(-1), Signal::SIGTERM);
                while others_alive() {
                    reap();
                    std::thread::sleep(STOP_POLL);
                }
                return ExitCode::SUCCESS;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_signal_has_its_response() {
        assert_eq!(respond(Signal::SIGCHLD), Response::Reap);
        assert_eq!(respond(Signal::SIGUSR1), Response::Clear, "a finished turn's leftovers are cleared");
        assert_eq!(respond(Signal::SIGTERM), Response::Stop, "docker stop");
        assert_eq!(respond(Signal::SIGINT), Response::Stop);
    }

    #[test]
    fn a_process_that_is_not_there_counts_as_gone() {
        assert!(zombie(u32::MAX), "no such process");
        assert!(!zombie(std::process::id()), "this one runs");
    }
}
