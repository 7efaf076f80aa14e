//! The footprint of one prepared agent waiting for an assignment: its
//! resident memory, CPU time and wake-ups over a window, with a 1 s
//! heartbeat, read from `/proc`.

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use serde::Serialize;

use crate::fixture::Fixture;
use crate::procfs::{self, ProcSample};
use crate::server::ServerProc;
use crate::stats::{Summary, summarize};

#[derive(Debug, Clone, Serialize)]
pub struct IdleResults {
    pub window_s: f64,
    pub heartbeat_ms: u64,
    pub samples: usize,
    pub rss_kib: Option<Summary>,
    pub rss_anon_kib: Option<Summary>,
    pub rss_file_kib: Option<Summary>,
    pub threads: u64,
    /// CPU time over the window, from `utime + stime` (clock ticks).
    pub cpu_ms_ticks: f64,
    /// CPU time over the window, from the threads' `schedstat` (ns).
    pub cpu_ms_schedstat: f64,
    /// `cpu_ms_schedstat` as a share of one core, in percent (the ticks
    /// agree to within their 10 ms resolution).
    pub cpu_percent_of_core: f64,
    pub clock_ticks_per_s: u64,
    pub wakeups_per_s: f64,
    pub involuntary_switches: u64,
    pub first: ProcSample,
    pub last: ProcSample,
}

/// Starts a server with a pool of one on the benchmark workspace, waits for
/// the standby to be ready, then samples its agent once a second.
pub async fn run(fixture: &Fixture, server_bin: &Path, work: &Path, window: Duration) -> Result<IdleResults> {
    let heartbeat = Duration::from_secs(1);
    let args: Vec<OsString> = ["--pool-size", "1", "--heartbeat-interval", "1s", "--agent-log", "info", "--spec"]
        .into_iter()
        .map(OsString::from)
        .chain([fixture.spec_path.clone().into(), "--agent-bin".into(), fixture.agent_parallel.clone().into()])
        .collect();
    let server = ServerProc::start("idle", server_bin, &work.join("idle"), &args).await?;
    let result = measure(&server, window, heartbeat).await;
    server.stop(Duration::from_secs(60)).await?;
    result
}

async fn measure(server: &ServerProc, window: Duration, heartbeat: Duration) -> Result<IdleResults> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let pid = loop {
        let sandboxes = server.sandboxes().await?;
        if let Some(ready) = sandboxes.iter().find(|s| s["candidate"].as_bool() == Some(true)) {
            break ready["pid"].as_u64().ok_or_else(|| anyhow!("no pid for the standby {ready}"))?;
        }
        if Instant::now() > deadline {
            bail!("the standby was not ready within 10 minutes:\n{}", server.log_tail(20));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let pid = u32::try_from(pid)?;
    if procfs::comm(pid).as_deref() != Some("standby") {
        bail!("pid {pid} is {:?}, not the standby agent", procfs::comm(pid));
    }
    // Past the end of preparation: the runtime's blocking threads (file
    // IO, DNS) exit after 10 s idle, and then the agent is as it will stay.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let started = Instant::now();
    let first = procfs::sample(pid)?;
    let first_threads = procfs::threads(pid)?;
    let mut readings = vec![first];
    let mut ticker =
        tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_secs(1), Duration::from_secs(1));
    while started.elapsed() < window {
        ticker.tick().await;
        readings.push(procfs::sample(pid)?);
    }
    let last_threads = procfs::threads(pid)?;
    let elapsed = started.elapsed().as_secs_f64();
    let last = *readings.last().unwrap_or(&first);
    let threads = procfs::thread_delta(&first_threads, &last_threads);
    let ticks = procfs::clock_ticks();
    let series = |f: fn(&ProcSample) -> u64| summarize(&readings.iter().map(|r| f(r) as f64).collect::<Vec<_>>());
    let cpu_ms_schedstat = threads.cpu_ns as f64 / 1e6;
    let cpu_ms_ticks = last.cpu_ticks.saturating_sub(first.cpu_ticks) as f64 * 1000.0 / ticks as f64;
    Ok(IdleResults {
        window_s: elapsed,
        heartbeat_ms: heartbeat.as_millis() as u64,
        samples: readings.len(),
        rss_kib: series(|r| r.rss_kib),
        rss_anon_kib: series(|r| r.rss_anon_kib),
        rss_file_kib: series(|r| r.rss_file_kib),
        threads: last.threads,
        cpu_ms_ticks,
        cpu_ms_schedstat,
        cpu_percent_of_core: cpu_ms_schedstat / (elapsed * 1000.0) * 100.0,
        clock_ticks_per_s: ticks,
        wakeups_per_s: threads.voluntary_switches as f64 / elapsed,
        involuntary_switches: threads.involuntary_switches,
        first,
        last,
    })
}
