//! Reaping the orphans nobody else waits for, and clearing out every child
//! at exit.
//!
//! The agent is often PID 1 of its container, and otherwise makes itself a
//! child subreaper: either way every process whose parent dies is
//! reparented to it, and a zombie nobody waits for stays in the process
//! table for good. The agent's own children already have owners that wait
//! for them (tokio, the terminal's waiter thread); `crate::process` keeps
//! the list. The reaper waits only for the others, each by pid: a
//! `waitpid(-1)` would steal exit statuses from their owners.
//!
//! An owner registers its child just after spawning it, so a child that
//! exits at once can be an unregistered zombie for a moment (longer if the
//! owner's thread is preempted there). The reaper therefore leaves an
//! unowned zombie alone until it has stayed one for a second.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::prctl::set_child_subreaper;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Pid, getpgrp};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tracing::{debug, warn};

use crate::process::{is_managed, off_runtime};

/// How often the reaper looks again while an unowned zombie is too young
/// to take, or when SIGCHLD cannot be watched.
const SCAN_INTERVAL: Duration = Duration::from_secs(1);
/// How often the reaper looks when nothing is pending. SIGCHLD already
/// wakes it for every exit (signals that coalesce still wake it once, and
/// it scans every child); this only bounds the cost of a lost wake-up. It
/// is long because a waiting agent must cost next to nothing.
const SAFETY_SCAN: Duration = Duration::from_secs(60);
/// How often [`kill_remaining_children`] looks again while children are
/// going.
const EXIT_POLL: Duration = Duration::from_millis(20);
/// How long [`kill_remaining_children`] waits for SIGKILL to take effect
/// before it gives up (a process in uninterruptible sleep).
const KILL_WAIT: Duration = Duration::from_secs(2);
/// How long a zombie must have been seen without an owner before the
/// reaper takes it: the time an owner has between spawning a child and
/// registering it.
const ORPHAN_AGE: Duration = Duration::from_secs(1);

/// Makes orphaned descendants children of the agent even when it is not
/// PID 1, so the agent can reap them and kill them at exit.
pub fn become_subreaper() -> Result<(), nix::Error> {
    set_child_subreaper(true)
}

/// Looks for orphaned zombies on every SIGCHLD (and every second while one
/// is too young to take), and reaps those that have been unowned for a
/// second, until `shutdown` holds `true` or its sender is dropped.
pub fn spawn_reaper(mut shutdown: watch::Receiver<bool>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut sigchld = match signal(SignalKind::child()) {
            Ok(stream) => Some(stream),
            Err(error) => {
                warn!(%error, "cannot watch SIGCHLD; orphans are reaped once a second");
                None
            }
        };
        let mut orphans = Orphans::default();
        loop {
            // A scan first, then on each wake-up: a SIGCHLD that came before
            // the stream above was registered is not delivered to it.
            // `/proc` reads and `waitpid`s block: off the runtime's thread,
            // which also keeps the control socket's heartbeats going.
            orphans = off_runtime(move || {
                orphans.reap(ORPHAN_AGE);
                orphans
            })
            .await
            .unwrap_or_default();
            if *shutdown.borrow_and_update() {
                break;
            }
            let next_scan = if orphans.pending() || sigchld.is_none() { SCAN_INTERVAL } else { SAFETY_SCAN };
            tokio::select! {
                changed = shutdown.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    continue;
                }
                received = async {
                    match sigchld.as_mut() {
                        Some(stream) => stream.recv().await,
                        None => std::future::pending().await,
                    }
                } => {
                    if received.is_none() {
                        sigchld = None;
                    }
                }
                () = sleep(next_scan) => {}
            }
        }
        debug!("orphan reaper stopped");
    })
}

/// Unowned zombie children of this process, by when they were first seen.
#[derive(Debug, Default)]
pub(crate) struct Orphans {
    /// Keyed by pid and start time: a pid can be reused once reaped.
    first_seen: HashMap<(i32, u64), Instant>,
}

impl Orphans {
    /// Whether an unowned zombie was seen that is not yet old enough to take.
    fn pending(&self) -> bool {
        !self.first_seen.is_empty()
    }

    /// Waits for every zombie child of this process that has no owner and
    /// has been one for at least `min_age`; returns how many were reaped.
    pub(crate) fn reap(&mut self, min_age: Duration) -> usize {
        let now = Instant::now();
        let mut zombies = HashSet::new();
        let mut reaped = 0;
        for process in own_children() {
            if process.state != 'Z' || is_managed(process.pid) {
                continue;
            }
            let key = (process.pid, process.start);
            zombies.insert(key);
            let first_seen = *self.first_seen.entry(key).or_insert(now);
            if now.duration_since(first_seen) < min_age {
                continue;
            }
            match waitpid(Pid::from_raw(process.pid), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => {}
                Ok(status) => {
                    debug!(pid = process.pid, ?status, "reaped an orphan");
                    reaped += 1;
                }
                Err(error) => warn!(pid = process.pid, %error, "cannot reap an orphan"),
            }
        }
        self.first_seen.retain(|key, _| zombies.contains(key));
        reaped
    }
}

/// Ends every child still running at exit: SIGTERM to each child's process
/// group and to the child, up to `grace` for them to go, then SIGKILL, and
/// the zombies reaped. Children reparented to the agent meanwhile (the
/// orphans of the ones that went) are treated the same way, so nothing the
/// agent started outlives it.
pub async fn kill_remaining_children(grace: Duration) {
    let deadline = crate::time::after(Instant::now(), grace);
    let mut terminated = HashSet::new();
    loop {
        let alive = off_runtime(live_children).await.unwrap_or_default();
        if alive.is_empty() {
            return;
        }
        for child in &alive {
            if terminated.insert(child.pid) {
                debug!(pid = child.pid, "terminating a remaining child");
                signal_child(child, Signal::SIGTERM);
            }
        }
        if Instant::now() >= deadline {
            break;
        }
        sleep(EXIT_POLL).await;
    }
    let deadline = Instant::now() + KILL_WAIT;
    loop {
        let alive = off_runtime(live_children).await.unwrap_or_default();
        if alive.is_empty() {
            return;
        }
        if Instant::now() >= deadline {
            let pids: Vec<i32> = alive.iter().map(|child| child.pid).collect();
            warn!(?pids, "children still alive after SIGKILL");
            return;
        }
        for child in &alive {
            signal_child(child, Signal::SIGKILL);
        }
        sleep(EXIT_POLL).await;
    }
}

/// The children of this process that have not exited, after reaping the
/// unowned ones that have (at exit, without waiting for owners that are
/// about to register).
fn live_children() -> Vec<ProcessInfo> {
    Orphans::default().reap(Duration::ZERO);
    own_children().into_iter().filter(|process| process.state != 'Z').collect()
}

/// The children of this process (zombies included), from each thread's
/// `/proc/self/task/<tid>/children`: reading only them keeps a scan's cost
/// to the agent's few children instead of every process of the machine,
/// which matters for a scan on every SIGCHLD. Without that file (a kernel
/// built without `CONFIG_PROC_CHILDREN`) every process is read.
fn own_children() -> Vec<ProcessInfo> {
    #[cfg(test)]
    tests::SCAN_THREADS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(std::thread::current().id());
    let me = own_pid();
    let Some(pids) = children_pids() else {
        return processes().into_iter().filter(|process| process.ppid == me).collect();
    };
    pids.into_iter().filter_map(process_info).filter(|process| process.ppid == me).collect()
}

fn children_pids() -> Option<HashSet<i32>> {
    children_in("/proc/self")
}

/// The children of the process whose `/proc` directory is `dir`, from each
/// of its threads; empty once it is gone, `None` where the kernel has no
/// `children` file.
fn children_in(dir: &str) -> Option<HashSet<i32>> {
    let mut pids = HashSet::new();
    let Ok(tasks) = std::fs::read_dir(format!("{dir}/task")) else {
        // The agent's own directory is always there: a kernel without it
        // is one to read all of `/proc` on.
        return (dir != "/proc/self").then_some(pids);
    };
    for task in tasks.flatten() {
        match std::fs::read_to_string(task.path().join("children")) {
            Ok(text) => pids.extend(text.split_whitespace().filter_map(|pid| pid.parse::<i32>().ok())),
            // No such file in a thread that still exists: the kernel has none.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound && task.path().exists() => return None,
            // The thread ended while the list was read.
            Err(_) => {}
        }
    }
    Some(pids)
}

/// Signals a child and its process group, unless that group is the
/// agent's own (a child spawned without a group of its own).
fn signal_child(child: &ProcessInfo, signal: Signal) {
    if child.pgrp > 1 && child.pgrp != getpgrp().as_raw() {
        signal_group(child.pgrp, signal);
    }
    match kill(Pid::from_raw(child.pid), signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(error) => warn!(pid = child.pid, %signal, %error, "cannot signal a child"),
    }
}

/// `killpg`, where a group that is already gone is no error.
pub(crate) fn signal_group(pgid: i32, signal: Signal) {
    match killpg(Pid::from_raw(pgid), signal) {
        Ok(()) | Err(Errno::ESRCH) => {}
        Err(error) => warn!(pgid, %signal, %error, "cannot signal a process group"),
    }
}

/// The process groups of the session led by `leader`, its own included.
///
/// Where the agent adopts orphans (PID 1 or a subreaper), every process of
/// a session it started descends from it, so only its descendants are read
/// (a handful, against every process of the machine: this runs on the run's
/// critical path when the idle shell is replaced); elsewhere all of `/proc`.
pub(crate) fn session_groups(leader: i32) -> HashSet<i32> {
    let candidates = adopts_orphans().then(descendants).flatten().unwrap_or_else(processes);
    let mut groups: HashSet<i32> =
        candidates.into_iter().filter(|process| process.session == leader).map(|process| process.pgrp).collect();
    groups.insert(leader);
    groups
}

/// Whether an orphaned descendant of the agent becomes its child.
fn adopts_orphans() -> bool {
    own_pid() == 1 || nix::sys::prctl::get_child_subreaper().unwrap_or(false)
}

/// Every descendant of the agent, through each process's
/// `/proc/<pid>/task/*/children`; `None` where the kernel has no such file.
fn descendants() -> Option<Vec<ProcessInfo>> {
    let mut found = Vec::new();
    let mut frontier = vec![own_pid()];
    while let Some(parent) = frontier.pop() {
        let dir = if parent == own_pid() { "/proc/self".to_owned() } else { format!("/proc/{parent}") };
        for pid in children_in(&dir)? {
            if let Some(info) = process_info(pid).filter(|info| info.ppid == parent) {
                frontier.push(pid);
                found.push(info);
            }
        }
    }
    Some(found)
}

fn own_pid() -> i32 {
    nix::unistd::getpid().as_raw()
}

/// What `/proc/<pid>/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcessInfo {
    pub pid: i32,
    /// `R`, `S`, `D`, `Z`, ...
    pub state: char,
    pub ppid: i32,
    pub pgrp: i32,
    pub session: i32,
    /// Clock ticks after boot when it started.
    pub start: u64,
}

/// Every process visible in `/proc`; processes that exit while it is read
/// are skipped.
pub(crate) fn processes() -> Vec<ProcessInfo> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(process_info)
        .collect()
}

/// One process's entry, if it still exists.
pub(crate) fn process_info(pid: i32) -> Option<ProcessInfo> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// Parses `pid (comm) state ppid pgrp session ... starttime ...`; `comm` may itself hold
/// spaces and parentheses, so the fields are read after its last `)`.
fn parse_stat(text: &str) -> Option<ProcessInfo> {
    let (head, rest) = text.rsplit_once(')')?;
    let pid = head.split_once('(')?.0.trim().parse().ok()?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    let session = fields.next()?.parse().ok()?;
    // Field 22 of the line; `session` was field 6.
    let start = fields.nth(15)?.parse().ok()?;
    Some(ProcessInfo { pid, state, ppid, pgrp, session, start })
}

/// Set in a test process started by [`run_in_own_process`].
#[cfg(test)]
pub(crate) const OWN_PROCESS: &str = "STANDBY_TEST_OWN_PROCESS";

/// Runs the test named `test` (its full path, `reaper::tests::...`) alone in
/// a new process of this test binary, with `env` added, and fails unless it
/// passed there.
///
/// For tests that act on the whole process (reaping, subreaping, killing
/// every child) or need its environment changed: tests share one process,
/// and reaping there would steal the exit statuses of other tests' children.
#[cfg(test)]
pub(crate) fn run_in_own_process(test: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let child = std::process::Command::new(exe)
        .args([test, "--exact", "--include-ignored", "--test-threads=1"])
        .env(OWN_PROCESS, "1")
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the test binary starts");
    let pid = child.id();
    crate::process::register(pid);
    let output = child.wait_with_output().expect("the test process can be waited for");
    crate::process::unregister(pid);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.contains("1 passed"),
        "{test} failed in its own process ({}):\n{stdout}\n{stderr}",
        output.status
    );
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    use super::*;
    use crate::process::{register, unregister};

    /// The threads [`own_children`] ran on, to show it runs off the runtime.
    pub(super) static SCAN_THREADS: std::sync::Mutex<Vec<std::thread::ThreadId>> = std::sync::Mutex::new(Vec::new());

    /// Polls `condition` every 10 ms, for at most 10 s.
    async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            sleep(Duration::from_millis(10)).await;
        }
    }

    fn children() -> Vec<ProcessInfo> {
        let me = own_pid();
        processes().into_iter().filter(|process| process.ppid == me).collect()
    }

    #[test]
    fn parses_stat_lines_whose_command_has_parentheses() {
        let line = "4242 (a) (b c)) S 1 4242 4200 34816 4242 4194560 98 0 0 0 \
                    1 2 0 0 20 0 1 0 123456 2277376 167 18446744073709551615";
        assert_eq!(
            parse_stat(line),
            Some(ProcessInfo { pid: 4242, state: 'S', ppid: 1, pgrp: 4242, session: 4200, start: 123456 })
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn sees_this_process() {
        let me = process_info(own_pid()).expect("this process is in /proc");
        assert_eq!(me.pgrp, getpgrp().as_raw());
        assert_ne!(me.state, 'Z');
    }

    /// The per-thread children lists give the same children as a scan of
    /// every process, including one spawned from another thread.
    #[test]
    fn own_children_match_a_full_scan() {
        let mut here = Command::new("sleep").arg("30").spawn().expect("sleep starts");
        let mut there = std::thread::spawn(|| Command::new("sleep").arg("30").spawn().expect("sleep starts"))
            .join()
            .expect("the spawning thread");
        let pids: HashSet<i32> = own_children().iter().map(|child| child.pid).collect();
        let scanned: HashSet<i32> = children().iter().map(|child| child.pid).collect();
        for child in [&here, &there] {
            let pid = i32::try_from(child.id()).expect("a pid fits i32");
            assert!(pids.contains(&pid), "child {pid} missing from {pids:?}");
        }
        assert!(pids.is_subset(&scanned), "{pids:?} ⊄ {scanned:?}");
        for child in [&mut here, &mut there] {
            child.kill().expect("kill sleep");
            child.wait().expect("reap sleep");
        }
    }

    #[test]
    fn orphans_are_reaped() {
        run_in_own_process("reaper::tests::orphans_are_reaped_in_own_process", &[]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "run by `orphans_are_reaped` in a process of its own"]
    async fn orphans_are_reaped_in_own_process() {
        if std::env::var_os(OWN_PROCESS).is_none() {
            return;
        }
        become_subreaper().expect("prctl(PR_SET_CHILD_SUBREAPER)");

        // A zombie with an owner is left to the owner.
        let mut owned = Command::new("true").spawn().expect("`true` starts");
        let owned_pid = i32::try_from(owned.id()).expect("a pid fits in i32");
        register(owned.id());
        wait_until("the owned child is a zombie", || {
            process_info(owned_pid).is_some_and(|process| process.state == 'Z')
        })
        .await;
        assert_eq!(Orphans::default().reap(Duration::ZERO), 0);
        assert!(owned.wait().expect("its owner can still wait").success());
        unregister(owned.id());

        // An unowned zombie is left alone while young (its owner may be
        // about to register it), then reaped.
        let unowned = Command::new("true").spawn().expect("`true` starts");
        let unowned_pid = i32::try_from(unowned.id()).expect("a pid fits in i32");
        wait_until("the unowned child is a zombie", || {
            process_info(unowned_pid).is_some_and(|process| process.state == 'Z')
        })
        .await;
        let mut orphans = Orphans::default();
        assert_eq!(orphans.reap(Duration::from_secs(3600)), 0);
        assert!(process_info(unowned_pid).is_some(), "a young zombie is left alone");
        assert_eq!(orphans.reap(Duration::ZERO), 1);
        assert!(process_info(unowned_pid).is_none(), "reaped");
        let mut unowned = unowned;
        assert!(unowned.wait().is_err(), "the reaper took its status");

        let (shutdown, shutdown_rx) = watch::channel(false);
        let reaper = spawn_reaper(shutdown_rx);

        // `sh` starts a sleep in the background and exits: the sleep is
        // reparented to this process, which has no handle on it.
        let parent = Command::new("sh")
            .args(["-c", "sleep 300 >/dev/null 2>&1 & echo $!"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("sh starts");
        let parent_pid = parent.id();
        register(parent_pid);
        let output = parent.wait_with_output().expect("sh can be waited for");
        unregister(parent_pid);
        let orphan: i32 = String::from_utf8_lossy(&output.stdout).trim().parse().expect("sh prints the orphan's pid");
        let info = process_info(orphan).expect("the orphan is running");
        assert_eq!(info.ppid, own_pid(), "the orphan is reparented to the subreaper");

        kill(Pid::from_raw(orphan), Signal::SIGKILL).expect("the orphan can be killed");
        wait_until("the orphan is reaped", || process_info(orphan).is_none()).await;
        assert!(children().is_empty(), "left: {:?}", children());

        shutdown.send(true).expect("the reaper listens");
        reaper.await.expect("the reaper stops cleanly");
    }

    #[test]
    fn scans_run_off_the_runtime_thread() {
        run_in_own_process("reaper::tests::scans_run_off_the_runtime_thread_in_own_process", &[]);
    }

    /// On a current-thread runtime (the agent's) the runtime's only thread
    /// is this test's: the reaper's and the exit sweep's scans must run on
    /// others.
    #[tokio::test(flavor = "current_thread")]
    #[ignore = "run by `scans_run_off_the_runtime_thread` in a process of its own"]
    async fn scans_run_off_the_runtime_thread_in_own_process() {
        if std::env::var_os(OWN_PROCESS).is_none() {
            return;
        }
        let runtime_thread = std::thread::current().id();
        become_subreaper().expect("prctl(PR_SET_CHILD_SUBREAPER)");
        let (shutdown, shutdown_rx) = watch::channel(false);
        let reaper = spawn_reaper(shutdown_rx);
        let output = Command::new("sh").args(["-c", "sleep 300 >/dev/null 2>&1 & echo $!"]).output().expect("sh runs");
        let orphan: i32 = String::from_utf8_lossy(&output.stdout).trim().parse().expect("sh prints the orphan's pid");
        kill(Pid::from_raw(orphan), Signal::SIGKILL).expect("the orphan can be killed");
        wait_until("the orphan is reaped", || process_info(orphan).is_none()).await;
        shutdown.send(true).expect("the reaper listens");
        reaper.await.expect("the reaper stops cleanly");
        let mut sleeper = Command::new("sleep").arg("300").spawn().expect("sleep starts");
        kill_remaining_children(Duration::from_millis(300)).await;
        assert!(sleeper.wait().is_err(), "killed and reaped by the exit sweep");
        let threads = SCAN_THREADS.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        assert!(threads.len() >= 2, "the reaper and the exit sweep scanned: {threads:?}");
        assert!(!threads.contains(&runtime_thread), "a scan ran on the runtime's thread");
    }

    #[test]
    fn remaining_children_are_killed() {
        run_in_own_process("reaper::tests::remaining_children_are_killed_in_own_process", &[]);
    }

    #[tokio::test]
    #[ignore = "run by `remaining_children_are_killed` in a process of its own"]
    async fn remaining_children_are_killed_in_own_process() {
        if std::env::var_os(OWN_PROCESS).is_none() {
            return;
        }
        become_subreaper().expect("prctl(PR_SET_CHILD_SUBREAPER)");

        // A child in a process group of its own, with a grandchild in it.
        let grouped = Command::new("sh").args(["-c", "sleep 300 & wait"]).process_group(0).spawn().expect("sh starts");
        // A child in this process's group that ignores SIGTERM (and so do
        // its children): only SIGKILL ends it.
        let mut stubborn = Command::new("sh")
            .args(["-c", "trap '' TERM; echo ready; while :; do sleep 1; done"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("sh starts");
        let mut ready = String::new();
        BufReader::new(stubborn.stdout.take().expect("piped stdout"))
            .read_line(&mut ready)
            .expect("the stubborn child reports it ignores SIGTERM");
        assert_eq!(ready.trim(), "ready");
        // An orphan already reparented to this process.
        let output = Command::new("sh").args(["-c", "sleep 300 >/dev/null 2>&1 & echo $!"]).output().expect("sh runs");
        let orphan: i32 = String::from_utf8_lossy(&output.stdout).trim().parse().expect("sh prints the orphan's pid");
        assert!(children().len() >= 3, "children: {:?}", children());

        kill_remaining_children(Duration::from_millis(300)).await;

        assert!(children().is_empty(), "left: {:?}", children());
        assert!(process_info(orphan).is_none());
        assert!(stubborn.wait().is_err(), "already reaped");
        let mut grouped = grouped;
        assert!(grouped.wait().is_err(), "already reaped");
        let grouped_pid = i32::try_from(grouped.id()).expect("a pid fits in i32");
        assert!(!processes().iter().any(|process| process.pgrp == grouped_pid), "the child's process group is gone");
    }
}
