//! Side by side: a baseline build's binaries (`--baseline-bin-dir`, e.g. a
//! build of `main`) against this run's (`--bin-dir`), on the paths a change
//! to the warm start or the follow-ups moves: warm parallel and cold at
//! each latency, and the Tier 2 and Tier 1 follow-ups. Both builds' servers
//! run at once and take turns run by run, so a busy machine slows both
//! alike; what is reported is each median and their ratio.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use crate::fixture::Fixture;
use crate::followups::{FollowUpSample, TurnPath, sample_turns};
use crate::latency::{Build, LatencyOptions, Path3, Sample, critical_parts, sample_paths};
use crate::stats::{Summary, summarize};

const BASELINE: &str = "baseline";
const CANDIDATE: &str = "candidate";

#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub what: String,
    pub latency_ms: u64,
    pub baseline: Option<Summary>,
    pub candidate: Option<Summary>,
    /// `median(candidate) / median(baseline)`: under 1 is faster.
    pub ratio: Option<f64>,
}

/// One build's warm parallel runs at one latency, step by step (medians
/// of the agents' timing lines).
#[derive(Debug, Clone, Serialize)]
pub struct StepRow {
    pub build: &'static str,
    pub latency_ms: u64,
    /// By part: each install step, `confirm`, `spawn`, `git_chain`, and
    /// `critical_path`, `model` (the plan's critical path from the steps)
    /// and `rest` (critical path − model − spawn: what no step accounts for).
    pub medians: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompareResults {
    pub baseline_bin_dir: String,
    pub runs: usize,
    pub rows: Vec<Row>,
    pub steps: Vec<StepRow>,
    pub samples: Vec<Sample>,
    pub follow_up_samples: Vec<FollowUpSample>,
}

/// The binaries of both builds.
pub struct Builds<'a> {
    pub fixture: &'a Fixture,
    pub server_bin: &'a Path,
    pub baseline_fixture: &'a Fixture,
    pub baseline_server_bin: &'a Path,
    pub baseline_bin_dir: &'a Path,
}

fn step_medians(samples: &[&Sample]) -> BTreeMap<String, f64> {
    let mut by_part: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for sample in samples {
        let mut parts = critical_parts(sample);
        parts.insert("critical_path".into(), sample.assignment_to_start_ms);
        if let Some(model) = sample.model_ms {
            parts.insert("model".into(), model);
            let rest = sample.assignment_to_start_ms - model - sample.spawn_ms.unwrap_or(0.0);
            parts.insert("rest".into(), rest);
        }
        for (part, value) in parts {
            by_part.entry(part).or_default().push(value);
        }
    }
    by_part.into_iter().filter_map(|(part, values)| Some((part, summarize(&values)?.median))).collect()
}

fn row(what: String, latency_ms: u64, baseline: &[f64], candidate: &[f64]) -> Row {
    let (baseline, candidate) = (summarize(baseline), summarize(candidate));
    let ratio = baseline.zip(candidate).map(|(b, c)| c.median / b.median.max(0.01));
    Row { what, latency_ms, baseline, candidate, ratio }
}

/// `follow_up_latency_ms`: `None` compares the warm parallel path alone
/// (no cold runs, no follow-up turns).
pub async fn run(
    options: &LatencyOptions,
    builds: &Builds<'_>,
    work: &Path,
    follow_up_latency_ms: Option<u64>,
) -> Result<CompareResults> {
    let both = [
        Build { label: BASELINE, fixture: builds.baseline_fixture, server_bin: builds.baseline_server_bin },
        Build { label: CANDIDATE, fixture: builds.fixture, server_bin: builds.server_bin },
    ];
    let paths: &[Path3] =
        if follow_up_latency_ms.is_some() { &[Path3::WarmParallel, Path3::Cold] } else { &[Path3::WarmParallel] };
    let samples = sample_paths(options, &both, paths, work).await?;
    let tiers: &[TurnPath] =
        if follow_up_latency_ms.is_some() { &[TurnPath::Tier2, TurnPath::Tier1Resume] } else { &[] };
    let follow_ups = match follow_up_latency_ms {
        Some(latency_ms) => sample_turns(&both, tiers, work, options.runs, latency_ms, options.heartbeat).await?,
        None => Vec::new(),
    };

    let mut rows = Vec::new();
    let mut steps = Vec::new();
    for &latency_ms in &options.latencies_ms {
        for build in [BASELINE, CANDIDATE] {
            let these: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.build == build && s.path == Path3::WarmParallel && s.latency_ms == latency_ms)
                .collect();
            steps.push(StepRow { build, latency_ms, medians: step_medians(&these) });
        }
        for &path in paths {
            let of = |build: &str, f: fn(&Sample) -> f64| -> Vec<f64> {
                samples
                    .iter()
                    .filter(|s| s.build == build && s.path == path && s.latency_ms == latency_ms)
                    .map(f)
                    .collect()
            };
            for (what, f) in [
                ("assignment → start", (|s: &Sample| s.assignment_to_start_ms) as fn(&Sample) -> f64),
                ("submit → start", |s: &Sample| s.submit_to_start_ms),
            ] {
                rows.push(row(format!("{}, {what}", path.label()), latency_ms, &of(BASELINE, f), &of(CANDIDATE, f)));
            }
        }
    }
    for &tier in tiers {
        let of = |build: &str| -> Vec<f64> {
            follow_ups.iter().filter(|s| s.build == build && s.tier == tier).map(|s| s.submit_to_start_ms).collect()
        };
        rows.push(row(
            format!("follow-up {}, submit → start", tier.label()),
            follow_up_latency_ms.unwrap_or_default(),
            &of(BASELINE),
            &of(CANDIDATE),
        ));
    }
    Ok(CompareResults {
        baseline_bin_dir: builds.baseline_bin_dir.display().to_string(),
        runs: options.runs,
        rows,
        steps,
        samples,
        follow_up_samples: follow_ups,
    })
}
