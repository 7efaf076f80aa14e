//! What `/proc` says about a process: memory, CPU time and wake-ups,
//! summed over its threads where the kernel counts per thread.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context as _, Result};
use serde::Serialize;

/// One reading of a process.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcSample {
    /// `VmRSS`: resident memory, anonymous and file-backed (the binary's
    /// pages it touched, shared libraries).
    pub rss_kib: u64,
    /// `RssAnon`: the heap and stacks, what the process itself allocated.
    pub rss_anon_kib: u64,
    /// `RssFile`: mapped files (mostly the executable's code).
    pub rss_file_kib: u64,
    pub threads: u64,
    /// `utime + stime` from `/proc/<pid>/stat`, in clock ticks: every
    /// thread's CPU time, including threads that have exited.
    pub cpu_ticks: u64,
    /// Sum over live threads of `/proc/<pid>/task/*/schedstat` (nanoseconds
    /// on a CPU): finer than ticks, but misses threads that exited.
    pub cpu_ns: u64,
    /// Sum over live threads of `voluntary_ctxt_switches`: each is a sleep
    /// the thread chose, so each later wake-up is one of these.
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

fn status_kib(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Reads `/proc/<pid>`; fails if the process is gone.
pub fn sample(pid: u32) -> Result<ProcSample> {
    let dir = format!("/proc/{pid}");
    let status = std::fs::read_to_string(format!("{dir}/status")).with_context(|| format!("reading {dir}/status"))?;
    let stat = std::fs::read_to_string(format!("{dir}/stat")).with_context(|| format!("reading {dir}/stat"))?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let fields: Vec<&str> = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or("").split_whitespace().collect();
    let field = |index: usize| fields.get(index).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    let mut sample = ProcSample {
        rss_kib: status_kib(&status, "VmRSS"),
        rss_anon_kib: status_kib(&status, "RssAnon"),
        rss_file_kib: status_kib(&status, "RssFile"),
        threads: status_kib(&status, "Threads"),
        // utime and stime are fields 14 and 15 of stat; `fields` starts at 3.
        cpu_ticks: field(11) + field(12),
        ..ProcSample::default()
    };
    for task in std::fs::read_dir(format!("{dir}/task")).with_context(|| format!("listing {dir}/task"))?.flatten() {
        let task = task.path();
        if let Ok(schedstat) = std::fs::read_to_string(task.join("schedstat")) {
            sample.cpu_ns += schedstat.split_whitespace().next().and_then(|ns| ns.parse::<u64>().ok()).unwrap_or(0);
        }
        if let Ok(status) = std::fs::read_to_string(task.join("status")) {
            sample.voluntary_switches += status_kib(&status, "voluntary_ctxt_switches");
            sample.involuntary_switches += status_kib(&status, "nonvoluntary_ctxt_switches");
        }
    }
    Ok(sample)
}

/// One thread's counters (`/proc/<pid>/task/<tid>`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ThreadCounters {
    pub cpu_ns: u64,
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

/// Every live thread's counters, by thread id.
pub fn threads(pid: u32) -> Result<BTreeMap<u32, ThreadCounters>> {
    let dir = format!("/proc/{pid}/task");
    let mut threads = BTreeMap::new();
    for task in std::fs::read_dir(&dir).with_context(|| format!("listing {dir}"))?.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        let path = task.path();
        let (Ok(schedstat), Ok(status)) =
            (std::fs::read_to_string(path.join("schedstat")), std::fs::read_to_string(path.join("status")))
        else {
            continue;
        };
        threads.insert(
            tid,
            ThreadCounters {
                cpu_ns: schedstat.split_whitespace().next().and_then(|ns| ns.parse().ok()).unwrap_or(0),
                voluntary_switches: status_kib(&status, "voluntary_ctxt_switches"),
                involuntary_switches: status_kib(&status, "nonvoluntary_ctxt_switches"),
            },
        );
    }
    Ok(threads)
}

/// What the threads did between two readings: each thread alive at the end
/// counts from its first reading (or from its birth); a thread that exited
/// in between is left out, so counters that only grow never go backwards.
pub fn thread_delta(first: &BTreeMap<u32, ThreadCounters>, last: &BTreeMap<u32, ThreadCounters>) -> ThreadCounters {
    let mut delta = ThreadCounters::default();
    for (tid, end) in last {
        let start = first.get(tid).copied().unwrap_or_default();
        delta.cpu_ns += end.cpu_ns.saturating_sub(start.cpu_ns);
        delta.voluntary_switches += end.voluntary_switches.saturating_sub(start.voluntary_switches);
        delta.involuntary_switches += end.involuntary_switches.saturating_sub(start.involuntary_switches);
    }
    delta
}

/// The process's command name (`/proc/<pid>/comm`).
pub fn comm(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).ok().map(|comm| comm.trim().to_owned())
}

/// Clock ticks per second (`getconf CLK_TCK`), 100 where it cannot be asked.
pub fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8_lossy(&out.stdout).trim().parse().ok())
        .unwrap_or(100)
}

/// The 1, 5 and 15 minute load averages.
pub fn load_average() -> [f64; 3] {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut values = text.split_whitespace().map(|v| v.parse::<f64>().unwrap_or(f64::NAN));
    [values.next().unwrap_or(f64::NAN), values.next().unwrap_or(f64::NAN), values.next().unwrap_or(f64::NAN)]
}

/// Number of entries of a directory (0 when it does not exist).
pub fn count_entries(dir: &Path, suffix: &str) -> usize {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(suffix)).count())
        .unwrap_or(0)
}

/// Open file descriptors of a process (`/proc/<pid>/fd`): its sockets,
/// what the open-files limit counts.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|entries| entries.count()).unwrap_or(0)
}

/// Now on `CLOCK_MONOTONIC` in nanoseconds: one clock for every process of
/// the machine, so instants taken in two processes subtract.
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map_or(0, |now| now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64)
}

/// Raises this process's soft open-files limit to its hard limit (a load
/// generator holds thousands of sockets); returns the soft limit now.
pub fn raise_open_files_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_or(soft, |()| hard),
        Ok((soft, _)) => soft,
        Err(_) => 1024,
    }
}

/// Whether the process runs: it exists and is not a zombie awaiting its
/// parent.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .is_ok_and(|status| status.lines().any(|line| line.starts_with("State:") && !line.contains("zombie")))
}
