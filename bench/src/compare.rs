//! Side by side: a baseline build's binaries (`--baseline-bin-dir`, e.g. a
//! build of `main`) against this run's (`--bin-dir`), on the paths a change
//! to the warm start or the follow-ups moves: warm parallel and cold at
//! each latency, and the Tier 2 and Tier 1 follow-ups. Both builds' servers
//! run at once and take turns run by run, so a busy machine slows both
//! alike; what is reported is each median, their ratio, and the runs
//! compared pair by pair (the same iteration's two runs): the median
//! difference, how many pairs the candidate won, and a sign test of that
//! split, which tells a change from the machine's noise.

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
    pub paired: Option<Paired>,
}

/// The two builds' runs of the same iteration (or follow-up turn),
/// compared: a drift of the machine during the benchmark moves both.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Paired {
    pub pairs: usize,
    /// Median of candidate − baseline, in ms: under 0 is faster.
    pub median_difference_ms: f64,
    /// Pairs the candidate ran faster (a tie counts for neither).
    pub candidate_faster: usize,
    /// Pairs the baseline ran faster.
    pub baseline_faster: usize,
    /// Two-sided sign test: the chance of a split at least this uneven
    /// when neither build is faster. Under 0.05, the change is the likely
    /// cause; over it, the pairs cannot tell it from noise.
    pub sign_test_p: f64,
}

/// Pairs `baseline` and `candidate` runs by their key (iteration or turn).
fn paired(baseline: &[(usize, f64)], candidate: &[(usize, f64)]) -> Option<Paired> {
    let baseline: BTreeMap<usize, f64> = baseline.iter().copied().collect();
    let differences: Vec<f64> = candidate.iter().filter_map(|(key, c)| baseline.get(key).map(|b| c - b)).collect();
    let summary = summarize(&differences)?;
    let candidate_faster = differences.iter().filter(|d| **d < 0.0).count();
    let baseline_faster = differences.iter().filter(|d| **d > 0.0).count();
    Some(Paired {
        pairs: summary.n,
        median_difference_ms: summary.median,
        candidate_faster,
        baseline_faster,
        sign_test_p: sign_test(candidate_faster, baseline_faster),
    })
}

/// Two-sided sign test of `wins` against `losses`: twice the binomial
/// (p = ½) tail at the rarer side, at most 1.
fn sign_test(wins: usize, losses: usize) -> f64 {
    let n = wins + losses;
    let rarer = wins.min(losses);
    // C(n, i) / 2^n, summed for i = 0..=rarer, built up term by term.
    let mut term = 0.5_f64.powi(i32::try_from(n).unwrap_or(i32::MAX));
    let mut tail = term;
    for i in 0..rarer {
        term *= (n - i) as f64 / (i + 1) as f64;
        tail += term;
    }
    (2.0 * tail).min(1.0)
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

/// One row from each build's runs, keyed by iteration (or turn).
fn row(what: String, latency_ms: u64, baseline: &[(usize, f64)], candidate: &[(usize, f64)]) -> Row {
    let paired = paired(baseline, candidate);
    let values = |runs: &[(usize, f64)]| runs.iter().map(|(_, value)| *value).collect::<Vec<_>>();
    let (baseline, candidate) = (summarize(&values(baseline)), summarize(&values(candidate)));
    let ratio = baseline.zip(candidate).map(|(b, c)| c.median / b.median.max(0.01));
    Row { what, latency_ms, baseline, candidate, ratio, paired }
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
            let of = |build: &str, f: fn(&Sample) -> f64| -> Vec<(usize, f64)> {
                samples
                    .iter()
                    .filter(|s| s.build == build && s.path == path && s.latency_ms == latency_ms)
                    .map(|s| (s.iteration, f(s)))
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
        let of = |build: &str| -> Vec<(usize, f64)> {
            follow_ups
                .iter()
                .filter(|s| s.build == build && s.tier == tier)
                .map(|s| (s.turn, s.submit_to_start_ms))
                .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sign_test_is_the_binomial_tail_at_both_sides() {
        assert!((sign_test(0, 10) - 2.0 / 1024.0).abs() < 1e-12);
        assert!((sign_test(8, 16) - 0.151_586).abs() < 1e-5, "{}", sign_test(8, 16));
        assert!((sign_test(16, 8) - sign_test(8, 16)).abs() < 1e-12, "symmetric");
        assert_eq!(sign_test(5, 5), 1.0);
        assert_eq!(sign_test(0, 0), 1.0, "no pairs tell nothing");
    }

    #[test]
    fn runs_pair_by_their_key_and_ties_count_for_neither_build() {
        let baseline = [(0, 10.0), (1, 12.0), (2, 9.0), (3, 11.0), (7, 50.0)];
        let candidate = [(0, 9.0), (1, 12.0), (2, 8.0), (3, 13.0), (9, 1.0)];
        let pairs = paired(&baseline, &candidate).expect("four pairs");
        assert_eq!(pairs.pairs, 4, "keys 7 and 9 have no partner");
        assert_eq!((pairs.candidate_faster, pairs.baseline_faster), (2, 1));
        // Differences −1, 0, −1, +2: sorted −1, −1, 0, 2.
        assert_eq!(pairs.median_difference_ms, -0.5);
        assert!(paired(&baseline, &[(5, 1.0)]).is_none());
    }
}
