//! Order statistics over a handful of samples: what every table shows.

use serde::Serialize;

/// Median, tail and spread of one figure. Percentiles are nearest-rank:
/// with 20 samples the p95 is the 19th smallest, an observed value.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub n: usize,
    pub min: f64,
    pub median: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

/// The value at rank `ceil(q * n)` of `sorted` (1-based).
fn rank(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    let index = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
    sorted[index]
}

/// `None` for no samples.
pub fn summarize(values: &[f64]) -> Option<Summary> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 { sorted[n / 2] } else { (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0 };
    Some(Summary {
        n,
        min: sorted[0],
        median,
        p95: rank(&sorted, 0.95),
        p99: rank(&sorted, 0.99),
        max: sorted[n - 1],
        mean: sorted.iter().sum::<f64>() / n as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles_and_median() {
        let values: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        let summary = summarize(&values).expect("samples");
        assert_eq!(summary.n, 20);
        assert_eq!(summary.min, 1.0);
        assert_eq!(summary.median, 10.5);
        assert_eq!(summary.p95, 19.0);
        assert_eq!(summary.p99, 20.0);
        assert_eq!(summary.max, 20.0);
        assert_eq!(summarize(&[7.0]).expect("one sample").p95, 7.0);
        assert!(summarize(&[]).is_none());
    }
}
