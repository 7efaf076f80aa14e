//! Server burst: many runs submitted at once onto as many ready standbys.
//!
//! `standby-server serve --provider spool` with a pool of `runs` standbys,
//! each held by the load generator of [`crate::capacity`] (a connection
//! that heartbeats `ready`, reads its assignment and acts the run out as
//! an agent does). Once every standby is connected, all runs are submitted
//! together, `concurrency` requests in flight on connections opened (and
//! kept alive) beforehand. Per run, submit→assignment is taken at the
//! agent's side (the frame read, against the instant its `POST /v1/runs`
//! was sent: one process, one monotonic clock) and from the server's own
//! record (`queued` + `commit_to_assignment_sent`, both in milliseconds).
//! The throughput is the runs over the span from the first request sent to
//! the last assignment frame read.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Serialize;
use serde_json::{Value, json};
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;

use crate::capacity::{Shared, connect_new, progress, spool_args, wait_for};
use crate::server::{API_KEY, ServerProc};
use crate::stats::{Summary, summarize};

#[derive(Debug, Clone)]
pub struct BurstOptions {
    /// Runs submitted at once, and standbys ready for them.
    pub runs: usize,
    /// `POST /v1/runs` requests in flight (and HTTP connections).
    pub concurrency: usize,
    pub heartbeat: Duration,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct BurstResults {
    pub runs: usize,
    pub concurrency: usize,
    /// Why the burst was not measured to the end (what was is kept).
    pub error: Option<String>,
    pub connect_s: f64,
    /// First request sent → last `POST /v1/runs` answered.
    pub submit_span_s: f64,
    /// First request sent → last assignment frame read.
    pub assign_span_s: f64,
    pub assignments: usize,
    pub assignments_per_s: f64,
    /// `POST /v1/runs` sent → its answer read.
    pub submit_ms: Option<Summary>,
    /// `POST /v1/runs` sent → the assignment frame read by the standby.
    pub submit_to_frame_ms: Option<Summary>,
    /// The server's record: submitted → assignment written (ms resolution).
    pub server_submit_to_sent_ms: Option<Summary>,
}

/// What one submission saw.
struct Submitted {
    id: String,
    sent: Instant,
    answered: Instant,
}

pub async fn run(options: &BurstOptions, server_bin: &Path, work: &Path) -> Result<BurstResults> {
    let dir = work.join("burst");
    let spool = dir.join("spool");
    let server =
        ServerProc::start("burst", server_bin, &dir, &spool_args(options.runs, options.heartbeat, &spool)).await?;
    let (sender, receiver) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::new(&server, options.heartbeat, sender)?);
    let mut tasks = JoinSet::new();
    let mut results = BurstResults { runs: options.runs, concurrency: options.concurrency, ..BurstResults::default() };
    let measured = drive(options, &server, &shared, &spool, receiver, &mut tasks, &mut results).await;
    let stopped = server.stop(Duration::from_secs(60)).await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    if let Err(error) = measured {
        progress(&format!("  burst: not measured to the end: {error:#}"));
        results.error = Some(format!("{error:#}"));
    }
    stopped?;
    Ok(results)
}

async fn drive(
    options: &BurstOptions,
    server: &ServerProc,
    shared: &Arc<Shared>,
    spool: &Path,
    mut assignments: mpsc::UnboundedReceiver<(String, Instant)>,
    tasks: &mut JoinSet<()>,
    results: &mut BurstResults,
) -> Result<()> {
    let runs = options.runs;
    progress(&format!("  burst: {runs} standbys"));
    wait_for("the spooled credentials", Duration::from_secs(600), async || {
        Ok(crate::procfs::count_entries(spool, ".token") >= runs)
    })
    .await?;
    let connecting = Instant::now();
    connect_new(shared, spool, &mut HashSet::new(), tasks);
    wait_for("every standby to connect", Duration::from_secs(300), async || {
        if shared.failed() > 0 {
            bail!("{} standbys could not connect:\n{}", shared.failed(), server.log_tail(20));
        }
        Ok(shared.connected() >= runs && server.metric("standby_connected_standbys").await? as usize >= runs)
    })
    .await?;
    results.connect_s = connecting.elapsed().as_secs_f64();
    // Each sent `ready` on connecting; let the last heartbeats land.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(120))
        .pool_max_idle_per_host(options.concurrency)
        .pool_idle_timeout(Duration::from_secs(60))
        .build()
        .context("building the HTTP client")?;
    warm_up(&http, &server.url, options.concurrency).await?;

    progress(&format!("  burst: {runs} runs submitted at once ({} in flight)", options.concurrency));
    let started = Instant::now();
    let gate = Arc::new(Semaphore::new(options.concurrency));
    let mut submits = JoinSet::new();
    for _ in 0..runs {
        let (http, gate, url) = (http.clone(), Arc::clone(&gate), format!("{}/v1/runs", server.url));
        submits.spawn(async move {
            let _permit = gate.acquire_owned().await.map_err(|_| anyhow!("the submission gate closed"))?;
            let sent = Instant::now();
            let response = http.post(&url).bearer_auth(API_KEY).json(&json!({"command": ["true"]})).send().await?;
            let status = response.status();
            let body: Value = response.json().await?;
            let answered = Instant::now();
            if !status.is_success() {
                bail!("POST /v1/runs: {status}: {body}");
            }
            let id = body["id"].as_str().ok_or_else(|| anyhow!("no run id in {body}"))?.to_owned();
            Ok::<_, anyhow::Error>(Submitted { id, sent, answered })
        });
    }
    let mut submitted = Vec::with_capacity(runs);
    while let Some(joined) = submits.join_next().await {
        submitted.push(joined.context("a submission task")??);
    }
    results.submit_span_s =
        submitted.iter().map(|s| s.answered).max().unwrap_or(started).duration_since(started).as_secs_f64();
    results.submit_ms = summarize(&submitted.iter().map(|s| ms(s.answered.duration_since(s.sent))).collect::<Vec<_>>());

    let mut frames = HashMap::with_capacity(runs);
    let collected = tokio::time::timeout(Duration::from_secs(120), async {
        while frames.len() < runs {
            let Some((id, at)) = assignments.recv().await else { break };
            frames.insert(id, at);
        }
    })
    .await;
    results.assignments = frames.len();
    let last = frames.values().max().copied().unwrap_or(started);
    results.assign_span_s = last.duration_since(started).as_secs_f64();
    results.assignments_per_s = frames.len() as f64 / results.assign_span_s.max(f64::EPSILON);
    results.submit_to_frame_ms = summarize(
        &submitted
            .iter()
            .filter_map(|s| frames.get(&s.id).map(|at| ms(at.saturating_duration_since(s.sent))))
            .collect::<Vec<_>>(),
    );
    results.server_submit_to_sent_ms = summarize(&server_view(server, &submitted).await?);
    if collected.is_err() {
        bail!("{} of {runs} assignment frames read within 120 s", frames.len());
    }
    Ok(())
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

/// Opens `connections` kept-alive HTTP connections, so the burst reuses
/// them rather than paying for its handshakes.
pub async fn warm_up(http: &reqwest::Client, url: &str, connections: usize) -> Result<()> {
    let mut calls = JoinSet::new();
    for _ in 0..connections {
        let (http, url) = (http.clone(), format!("{url}/healthz"));
        calls.spawn(async move { http.get(&url).send().await?.error_for_status().map(|_| ()) });
    }
    while let Some(joined) = calls.join_next().await {
        joined.context("a warm-up call")?.context("warming up the HTTP connections")?;
    }
    Ok(())
}

/// Each run's submitted → assignment written, as the server recorded it.
async fn server_view(server: &ServerProc, submitted: &[Submitted]) -> Result<Vec<f64>> {
    let mut spans = Vec::with_capacity(submitted.len());
    for chunk in submitted.chunks(32) {
        let reads = chunk.iter().map(|s| server.run(&s.id));
        for run in futures::future::join_all(reads).await {
            let durations = &run?["durations_ms"];
            if let (Some(queued), Some(sent)) =
                (durations["queued"].as_f64(), durations["commit_to_assignment_sent"].as_f64())
            {
                spans.push(queued + sent);
            }
        }
    }
    Ok(spans)
}
