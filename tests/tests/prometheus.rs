//! The monitoring that ships in `deploy/`: the Prometheus rules pass
//! `promtool check rules` and their unit tests (`promtool test rules`), and
//! a real Prometheus scraping a real `standby-server` doing warm and cold
//! runs gets data from every recording rule and every query of the Grafana
//! dashboard (read from the files, so the test follows them).
//!
//! Needs Debian's `prometheus` package (`prometheus`, `promtool`): under
//! `CI=true` a missing binary fails the tests, elsewhere they are skipped,
//! loudly. Needs both binaries of the workspace built (`cargo build --bins`).

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use serde_json::{Value, json};
use standby_e2e::harness::write_json;
use standby_e2e::prometheus::{Prometheus, Target, dashboard_queries, finite, recorded, repo_root, rules_file, tool};
use standby_e2e::server_process::{API_KEY, ServerBuilder};

/// How long the test waits for Prometheus to see a change: a few scrape
/// and evaluation intervals (one second each), with room for a busy
/// machine.
const WAIT: Duration = Duration::from_secs(90);

/// The scrape job's name: the dashboard's `$job` is given it.
const JOB: &str = "standby";

fn read_yaml(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|error| panic!("{} is not YAML: {error}", path.display()))
}

fn dashboard() -> Value {
    let path = repo_root().join("deploy/grafana/standby.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("read {}: {error}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{} is not JSON: {error}", path.display()))
}

fn promtool(promtool: &Path, args: &[&str]) {
    let output = Command::new(promtool)
        .args(args)
        .current_dir(repo_root())
        .output()
        .unwrap_or_else(|error| panic!("run promtool {args:?}: {error}"));
    assert!(
        output.status.success(),
        "promtool {args:?}: {}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_rules_pass_promtool_and_every_alert_is_unit_tested_firing() {
    let Some(promtool_bin) = tool("promtool", "the_rules_pass_promtool") else { return };
    promtool(&promtool_bin, &["check", "rules", "deploy/prometheus/standby.rules.yml"]);
    let tests_dir = repo_root().join("deploy/prometheus/tests");
    let mut tests: Vec<String> = std::fs::read_dir(&tests_dir)
        .unwrap_or_else(|error| panic!("read {}: {error}", tests_dir.display()))
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "yml"))
        .map(|path| path.strip_prefix(repo_root()).expect("under the root").display().to_string())
        .collect();
    tests.sort();
    assert!(!tests.is_empty(), "no unit test in {}", tests_dir.display());
    let mut args = vec!["test", "rules"];
    args.extend(tests.iter().map(String::as_str));
    promtool(&promtool_bin, &args);

    // What promtool does not hold the rules to: every alert waits (`for`),
    // says how bad (`severity`) and what to do, and is seen firing by a
    // unit test.
    let mut fired = BTreeSet::new();
    for test in &tests {
        for case in read_yaml(&repo_root().join(test))["tests"].as_array().into_iter().flatten() {
            for check in case["alert_rule_test"].as_array().into_iter().flatten() {
                if check["exp_alerts"].as_array().is_some_and(|alerts| !alerts.is_empty()) {
                    fired.insert(check["alertname"].as_str().unwrap_or_default().to_owned());
                }
            }
        }
    }
    let rules = read_yaml(&rules_file());
    let alerts: Vec<&Value> = rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|group| group["rules"].as_array().into_iter().flatten())
        .filter(|rule| rule["alert"].is_string())
        .collect();
    assert_eq!(alerts.len(), 6, "the six alerts of #31");
    for alert in alerts {
        let name = alert["alert"].as_str().unwrap_or_default();
        assert!(alert["for"].is_string(), "{name}: no `for`");
        assert!(matches!(alert["labels"]["severity"].as_str(), Some("warning" | "critical")), "{name}: severity");
        assert!(alert["annotations"]["summary"].is_string(), "{name}: no summary");
        assert!(alert["annotations"]["description"].is_string(), "{name}: no description of what to do");
        assert!(fired.contains(name), "{name}: no unit test sees it fire");
    }
}

#[tokio::test]
async fn a_real_prometheus_gets_data_from_every_recording_rule_and_dashboard_query() {
    let test = "a_real_prometheus_gets_data";
    let Some(prometheus_bin) = tool("prometheus", test) else { return };
    let dir = tempfile::Builder::new().prefix("standby-prometheus-e2e-").tempdir().expect("a temp dir");
    // A setup step that takes a second: the pool's replacement for the
    // standby the first run takes is not ready when the second run comes,
    // which goes cold.
    let spec = json!({
        "workspace": {"repos": [], "setup": [{"name": "build", "command": ["sleep", "1"], "timeout_s": 60}]},
        "shell": ["/bin/sh"]
    });
    let spec_path = dir.path().join("spec.json");
    write_json(&spec_path, &spec);
    let mark = format!("{:016x}", RandomState::new().hash_one((std::process::id(), dir.path())));
    let server = ServerBuilder::new(&dir.path().join("data"), &dir.path().join("server.log"), &mark)
        .args(&["--spec", &spec_path.display().to_string(), "--pool-size", "1"])
        .args(&["--heartbeat-interval", "200ms", "--linger", "3s", "--stop-grace", "3s"])
        .start()
        .await;
    let address = server.addr().to_string();
    let prometheus =
        Prometheus::start(&prometheus_bin, dir.path(), &Target { job: JOB, address: &address, token: API_KEY }).await;
    let up = format!("up{{job=\"{JOB}\"}} == 1");
    prometheus
        .until("a first scrape of the server", WAIT, async || (!prometheus.query(&up).await.is_empty()).then_some(()))
        .await;

    // Runs after the first scrape, so that every rate sees them arrive.
    server
        .until("a ready standby", WAIT, async || {
            server.sandboxes().await.into_iter().any(|sandbox| sandbox["candidate"] == true).then_some(())
        })
        .await;
    let run = json!({"command": ["sh", "-c", "echo hello"]});
    let ids = [server.submit(&run).await, server.submit(&run).await];
    let mut paths = Vec::new();
    for id in &ids {
        let run = server.finished(id, WAIT).await;
        assert_eq!(run["state"], "exited", "{run}\n{}", server.logs());
        paths.push(run["path"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(paths, ["warm", "cold"], "one run took the standby, the other went cold");

    // Prometheus has scraped both starts once the counters it holds say so.
    let started = format!("min(standby_runs_started_total{{job=\"{JOB}\",path=~\"warm|cold\"}}) >= 1");
    prometheus
        .until("both starts scraped", WAIT, async || (!prometheus.query(&started).await.is_empty()).then_some(()))
        .await;

    let dashboard = dashboard();
    let mut queries: Vec<String> = recorded(&read_yaml(&rules_file()));
    let recorded_count = queries.len();
    for expr in dashboard_queries(&dashboard) {
        let expr = expr.replace("$job", JOB);
        assert!(!expr.contains('$'), "a dashboard query with a variable the test does not give: {expr}");
        queries.push(expr);
    }
    assert!(recorded_count >= 8 && queries.len() > recorded_count, "{queries:?}");
    // Every one answers a finite number once the rules evaluated over the
    // runs' scrapes; the ones still empty (or only NaN) are named.
    let mut missing: Vec<String> = queries.clone();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !missing.is_empty() && tokio::time::Instant::now() < deadline {
        let mut still = Vec::new();
        for expr in missing {
            if !prometheus.query(&expr).await.iter().any(finite) {
                still.push(expr);
            }
        }
        missing = still;
        if !missing.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert!(missing.is_empty(), "no data for: {missing:#?}\n{}", prometheus.logs());

    // The figures the runs make, once the rules evaluated over the scrape
    // that saw the second start: half of the new runs went cold, and the
    // latency by path has both paths.
    let share = format!("job:standby_cold_share:ratio_rate5m{{job=\"{JOB}\"}} > 0.49 < 0.51");
    prometheus
        .until("a cold share of one half", WAIT, async || (!prometheus.query(&share).await.is_empty()).then_some(()))
        .await;
    let by_path = format!("job_path:standby_submit_to_start_seconds:quantile_rate5m{{job=\"{JOB}\",quantile=\"0.5\"}}");
    prometheus
        .until("a median start time of each path", WAIT, async || {
            let samples = prometheus.query(&by_path).await;
            let paths: BTreeSet<&str> = samples
                .iter()
                .filter(|sample| finite(sample))
                .filter_map(|sample| sample["metric"]["path"].as_str())
                .collect();
            (paths == BTreeSet::from(["cold", "warm"])).then_some(())
        })
        .await;
    drop(prometheus);
    server.stop_leaving_nothing(Signal::SIGTERM).await;
}
