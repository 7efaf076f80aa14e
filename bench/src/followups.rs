//! Follow-up turns of a thread, submit to run start: the sandbox of the
//! previous turn kept running with a fresh agent (Tier 2), kept stopped
//! and resumed (Tier 1), or not kept (cold: a new sandbox, cloned and set
//! up again).
//!
//! One server per tier, all with an empty pool, so the first turn of each
//! thread is cold and every later turn is a follow-up on that thread. As in
//! the latency benchmark, runs go one at a time in rotating order, only
//! when every server is quiet.

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use anyhow::{Result, anyhow, bail};
use serde::Serialize;
use serde_json::Value;

use crate::fixture::Fixture;
use crate::latency::{Build, Timed, progress, run_once, submission};
use crate::server::ServerProc;
use crate::stats::{Summary, summarize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TurnPath {
    Tier2,
    Tier1Resume,
    Cold,
}

impl TurnPath {
    const ALL: [Self; 3] = [Self::Tier2, Self::Tier1Resume, Self::Cold];

    pub fn label(self) -> &'static str {
        match self {
            Self::Tier2 => "Tier 2 (kept running)",
            Self::Tier1Resume => "Tier 1 (resumed from stopped)",
            Self::Cold => "cold (not kept)",
        }
    }

    /// The run path the server reports for a follow-up of this tier.
    fn path(self) -> &'static str {
        match self {
            Self::Tier2 => "parked_running",
            Self::Tier1Resume => "parked_stopped",
            Self::Cold => "cold",
        }
    }

    fn lifecycle(self) -> [(&'static str, &'static str); 2] {
        match self {
            Self::Tier2 => [("--warm-idle", "30m"), ("--park-stopped", "true")],
            Self::Tier1Resume => [("--warm-idle", "0s"), ("--park-stopped", "true")],
            Self::Cold => [("--warm-idle", "0s"), ("--park-stopped", "false")],
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FollowUpSample {
    /// Which build ran it, when builds are compared side by side.
    #[serde(skip_serializing_if = "str::is_empty")]
    pub build: &'static str,
    pub tier: TurnPath,
    pub turn: usize,
    pub run_id: String,
    pub sandbox_id: String,
    pub submit_to_start_ms: f64,
    pub assignment_to_start_ms: f64,
    /// The server's resume span: claimed → the kept sandbox's agent ready.
    pub resume_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TierCell {
    pub tier: TurnPath,
    pub submit_to_start: Option<Summary>,
    pub assignment_to_start: Option<Summary>,
    pub resume: Option<Summary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct FollowUpResults {
    pub latency_ms: u64,
    pub heartbeat_ms: u64,
    pub turns_per_tier: usize,
    pub cells: Vec<TierCell>,
    /// `cold / Tier 2` and `cold / Tier 1`, paired per turn (submit → start).
    pub cold_over_tier2: Option<Summary>,
    pub cold_over_tier1: Option<Summary>,
    pub samples: Vec<FollowUpSample>,
}

struct Side {
    build: &'static str,
    tier: TurnPath,
    server: ServerProc,
    thread: String,
}

/// Waits until no sandbox of any server is busy: retired ones are gone, a
/// sandbox parked running has its fresh agent ready, a sandbox parked
/// stopped has no agent.
async fn wait_quiet(sides: &[Side], timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut quiet = true;
        'sides: for side in sides {
            for sandbox in side.server.sandboxes().await? {
                let gone = sandbox["pid"].is_null();
                let settled = match (sandbox["state"].as_str(), sandbox["park"]["mode"].as_str()) {
                    (Some("retired"), _) => gone && sandbox["dir"].as_str().is_none_or(|dir| !Path::new(dir).exists()),
                    (Some("parked"), Some("running")) => {
                        sandbox["last_state"].as_str() == Some("ready") && sandbox["connected"].as_bool() == Some(true)
                    }
                    (Some("parked"), Some("stopped")) => gone,
                    _ => false,
                };
                if !settled {
                    quiet = false;
                    break 'sides;
                }
            }
        }
        if quiet {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<String> =
                sides.iter().map(|s| format!("--- {} ---\n{}", s.server.name, s.server.log_tail(15))).collect();
            bail!("the follow-up servers were not quiet within {timeout:?}\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn turn_body(fixture: &Fixture, thread: &str, turn: usize) -> Value {
    let mut body = submission(&fixture.workspace, turn);
    body["thread_id"] = Value::String(thread.to_owned());
    body
}

pub async fn run(
    fixture: &Fixture,
    server_bin: &Path,
    work: &Path,
    turns: usize,
    latency_ms: u64,
    heartbeat: Duration,
) -> Result<FollowUpResults> {
    let builds = [Build { label: "", fixture, server_bin }];
    let samples = sample_turns(&builds, &TurnPath::ALL, work, turns, latency_ms, heartbeat).await?;
    Ok(summarise(samples, turns, latency_ms, heartbeat))
}

/// Runs `turns` follow-up turns of each tier and build, one server per
/// tier and build, one turn at a time in rotating order.
pub async fn sample_turns(
    builds: &[Build<'_>],
    tiers: &[TurnPath],
    work: &Path,
    turns: usize,
    latency_ms: u64,
    heartbeat: Duration,
) -> Result<Vec<FollowUpSample>> {
    let mut sides = Vec::new();
    for (&tier, build) in tiers.iter().flat_map(|tier| builds.iter().map(move |build| (tier, build))) {
        let fixture = build.fixture;
        let mut args: Vec<OsString> = Vec::new();
        for (flag, value) in [
            ("--pool-size", "0".to_owned()),
            ("--agent-bin", fixture.agent_parallel.display().to_string()),
            ("--spec", fixture.spec_path.display().to_string()),
            ("--inject-latency", format!("{latency_ms}ms")),
            ("--heartbeat-interval", format!("{}ms", heartbeat.as_millis())),
            ("--linger", "20s".to_owned()),
            ("--stop-grace", "5s".to_owned()),
            ("--max-attempts", "1".to_owned()),
        ]
        .into_iter()
        .chain(tier.lifecycle().map(|(flag, value)| (flag, value.to_owned())))
        {
            args.push(flag.into());
            args.push(value.into());
        }
        let name = format!("{}follow-ups {}", build.prefix(), tier.label());
        let tag = format!("{}{tier:?}", build.prefix().replace(' ', "-")).to_lowercase();
        let dir = work.join(format!("followups-{tag}"));
        let server = ServerProc::start(&name, build.server_bin, &dir, &args).await?;
        sides.push(Side { build: build.label, tier, server, thread: format!("bench-thread-{tag}") });
    }
    let fixture = builds.first().map(|build| build.fixture).ok_or_else(|| anyhow!("no build to measure"))?;
    let mut samples = Vec::new();
    let result = turns_of(fixture, &sides, turns, &mut samples).await;
    for side in sides {
        side.server.stop(Duration::from_secs(60)).await?;
    }
    result?;
    Ok(samples)
}

async fn turns_of(fixture: &Fixture, sides: &[Side], turns: usize, samples: &mut Vec<FollowUpSample>) -> Result<()> {
    // The first turn of every thread: cold, not measured.
    for side in sides {
        wait_quiet(sides, Duration::from_secs(600)).await?;
        run_once(&side.server, &fixture.agent_logs, &turn_body(fixture, &side.thread, 0), "cold").await?;
    }
    for turn in 1..=turns {
        for k in 0..sides.len() {
            let side = &sides[(turn + k) % sides.len()];
            wait_quiet(sides, Duration::from_secs(600)).await?;
            let body = turn_body(fixture, &side.thread, turn);
            let timed: Timed = run_once(&side.server, &fixture.agent_logs, &body, side.tier.path()).await?;
            progress(&format!(
                "  {:>29}  turn {:>2}/{turns}: submit→start {:>8.1} ms",
                format!("{} {}", side.build, side.tier.label()).trim_start(),
                turn,
                timed.submit_to_start_ms
            ));
            samples.push(FollowUpSample {
                build: side.build,
                tier: side.tier,
                turn,
                resume_ms: timed.server["durations_ms"]["resume"].as_f64(),
                run_id: timed.run_id,
                sandbox_id: timed.sandbox_id,
                submit_to_start_ms: timed.submit_to_start_ms,
                assignment_to_start_ms: timed.assignment_to_start_ms,
            });
        }
    }
    Ok(())
}

fn summarise(samples: Vec<FollowUpSample>, turns: usize, latency_ms: u64, heartbeat: Duration) -> FollowUpResults {
    let of = |tier: TurnPath| samples.iter().filter(move |s| s.tier == tier);
    let cells = TurnPath::ALL
        .into_iter()
        .map(|tier| TierCell {
            tier,
            submit_to_start: summarize(&of(tier).map(|s| s.submit_to_start_ms).collect::<Vec<_>>()),
            assignment_to_start: summarize(&of(tier).map(|s| s.assignment_to_start_ms).collect::<Vec<_>>()),
            resume: summarize(&of(tier).filter_map(|s| s.resume_ms).collect::<Vec<_>>()),
        })
        .collect();
    let paired = |bottom: TurnPath| {
        let ratios: Vec<f64> = of(TurnPath::Cold)
            .filter_map(|cold| {
                let other = of(bottom).find(|s| s.turn == cold.turn)?;
                Some(cold.submit_to_start_ms / other.submit_to_start_ms.max(0.5))
            })
            .collect();
        summarize(&ratios)
    };
    FollowUpResults {
        latency_ms,
        heartbeat_ms: heartbeat.as_millis() as u64,
        turns_per_tier: turns,
        cells,
        cold_over_tier2: paired(TurnPath::Tier2),
        cold_over_tier1: paired(TurnPath::Tier1Resume),
        samples,
    }
}
