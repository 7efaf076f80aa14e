//! The summary: Markdown tables of every figure and of the targets, printed
//! at the end of a run and written to `summary.md` next to `results.json`.

use std::fmt::Write as _;

use serde::Serialize;

use crate::burst::BurstResults;
use crate::capacity::CapacityResults;
use crate::compare::CompareResults;
use crate::followups::FollowUpResults;
use crate::idle::IdleResults;
use crate::latency::{LatencyResults, Path3};
use crate::spread_capacity::SpreadResults;
use crate::stats::Summary;

/// Everything one run of `standby-bench` measured.
#[derive(Debug, Serialize)]
pub struct Results {
    pub meta: Meta,
    pub latency: Option<LatencyResults>,
    pub follow_ups: Option<FollowUpResults>,
    pub idle: Option<IdleResults>,
    pub capacity: Option<CapacityResults>,
    pub spread: Option<SpreadResults>,
    pub burst: Option<BurstResults>,
    pub compare: Option<CompareResults>,
}

#[derive(Debug, Serialize)]
pub struct Meta {
    pub command: String,
    pub quick: bool,
    pub started_at: String,
    pub duration_s: f64,
    pub cpus: usize,
    pub load_average_before: [f64; 3],
    pub load_average_after: [f64; 3],
    pub git_commit: Option<String>,
    /// The setup step's kind (`Full`, or `Light` in quick mode).
    pub setup: Option<String>,
}

fn ms(value: f64) -> String {
    if value >= 100.0 { format!("{value:.0}") } else { format!("{value:.1}") }
}

fn spread(summary: &Summary) -> String {
    format!("{}–{}", ms(summary.min), ms(summary.max))
}

fn or_dash(value: Option<String>) -> String {
    value.unwrap_or_else(|| "–".into())
}

fn mib(kib: f64) -> String {
    format!("{:.1}", kib / 1024.0)
}

/// Issue 18's targets: the warm start at 0 ms injected, and a Tier 1
/// follow-up's submit → start.
const WARM_TARGET_MS: f64 = 10.0;
const TIER1_TARGET_MS: f64 = 150.0;

/// A target and whether the measurement met it.
struct Target {
    what: String,
    measured: String,
    met: Option<bool>,
}

pub fn markdown(results: &Results) -> String {
    let mut out = String::new();
    let meta = &results.meta;
    let _ = writeln!(out, "# standby benchmarks{}\n", if meta.quick { " (quick mode)" } else { "" });
    let _ = writeln!(
        out,
        "`{}` on {} CPUs, {}; load average {:.2} {:.2} {:.2} before, {:.2} {:.2} {:.2} after; {:.0} s{}.\n",
        meta.command,
        meta.cpus,
        meta.started_at,
        meta.load_average_before[0],
        meta.load_average_before[1],
        meta.load_average_before[2],
        meta.load_average_after[0],
        meta.load_average_after[1],
        meta.load_average_after[2],
        meta.duration_s,
        meta.git_commit.as_deref().map(|c| format!(", commit {}", &c[..c.len().min(12)])).unwrap_or_default(),
    );
    let mut targets = Vec::new();
    if let Some(latency) = &results.latency {
        latency_tables(&mut out, latency, meta.setup.as_deref(), &mut targets);
    }
    if let Some(follow_ups) = &results.follow_ups {
        follow_up_table(&mut out, follow_ups, &mut targets);
    }
    if let Some(idle) = &results.idle {
        idle_table(&mut out, idle, &mut targets);
    }
    if let Some(capacity) = &results.capacity {
        capacity_table(&mut out, capacity, &mut targets);
    }
    if let Some(spread) = &results.spread {
        spread_tables(&mut out, spread);
    }
    if let Some(compare) = &results.compare {
        compare_table(&mut out, compare);
    }
    if let Some(burst) = &results.burst {
        burst_table(&mut out, burst, &mut targets);
    }
    if !targets.is_empty() {
        let _ = writeln!(out, "## Targets\n\n| target | measured | met |\n|---|---|---|");
        for target in targets {
            let met = match target.met {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "–",
            };
            let _ = writeln!(out, "| {} | {} | {met} |", target.what, target.measured);
        }
        out.push('\n');
    }
    out
}

fn latency_tables(out: &mut String, latency: &LatencyResults, setup: Option<&str>, targets: &mut Vec<Target>) {
    let setup = match setup {
        Some("Light") => {
            "`python3 -m venv --without-pip` and the interpreter's `pip install` of a local package \
                          into it (quick mode's light setup)"
        }
        _ => "`python3 -m venv` and `pip install` of a local package",
    };
    let _ = writeln!(
        out,
        "## Assignment to run start\n\nWorkspace: a git repository of {} files, {:.1} MB; setup: {setup} (offline); \
         one MCP server. {} runs per path and latency{}, in rotating order. Milliseconds.\n",
        latency.repo_files,
        latency.repo_bytes as f64 / 1e6,
        latency.runs_per_path,
        if latency.warmup_iterations > 0 {
            format!(" after {} warm-up round(s)", latency.warmup_iterations)
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        out,
        "| path | injected | assignment → start p50 | p95 | spread | submit → start p50 | p95 | spread |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|"
    );
    for cell in &latency.cells {
        let (Some(a), Some(s)) = (&cell.assignment_to_start, &cell.submit_to_start) else { continue };
        let _ = writeln!(
            out,
            "| {} | {} ms | {} | {} | {} | {} | {} | {} |",
            cell.path.label(),
            cell.latency_ms,
            ms(a.median),
            ms(a.p95),
            spread(a),
            ms(s.median),
            ms(s.p95),
            spread(s)
        );
    }
    let _ = writeln!(
        out,
        "\n### Warm parallel against its bound\n\nBound = slowest network step + delivery confirmation + terminal \
         check, from the same run's own timing line. Model = the plan's critical path from the same steps \
         (longest of confirmation, check + slowest branch + terminal, MCP restart).\n\n\
         | injected | measured p50 | bound p50 | measured / bound | model p50 | slowest step p50 | confirm p50 | mcp p50 |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for cell in latency.cells.iter().filter(|c| c.path == Path3::WarmParallel) {
        let (Some(a), Some(b)) = (&cell.assignment_to_start, &cell.bound) else { continue };
        let slowest = ["secrets", "attachments", "metadata", "cloud_credentials", "git_credentials", "refresh"]
            .iter()
            .filter_map(|name| cell.step_medians.get(*name).map(|v| (*name, *v)))
            .fold(("", 0.0), |best, this| if this.1 > best.1 { this } else { best });
        let confirm = latency
            .samples
            .iter()
            .filter(|s| s.path == Path3::WarmParallel && s.latency_ms == cell.latency_ms)
            .filter_map(|s| s.confirm_ms)
            .collect::<Vec<_>>();
        let ratio = cell.p50_over_bound.unwrap_or(f64::NAN);
        let _ = writeln!(
            out,
            "| {} ms | {} | {} | {ratio:.2} | {} | {} ({}) | {} | {} |",
            cell.latency_ms,
            ms(a.median),
            ms(b.median),
            or_dash(cell.model.map(|m| ms(m.median))),
            ms(slowest.1),
            slowest.0,
            or_dash(crate::stats::summarize(&confirm).map(|c| ms(c.median))),
            or_dash(cell.step_medians.get("mcp").map(|v| ms(*v))),
        );
        targets.push(Target {
            what: format!("warm parallel p50 ≤ 1.25 × bound at {} ms", cell.latency_ms),
            measured: format!("{} / {} ms = {ratio:.2}×", ms(a.median), ms(b.median)),
            met: Some(ratio <= 1.25),
        });
        if cell.latency_ms == 0 {
            targets.push(Target {
                what: format!("warm parallel p50 ≤ {WARM_TARGET_MS} ms at 0 ms"),
                measured: format!("{} ms", ms(a.median)),
                met: Some(a.median <= WARM_TARGET_MS),
            });
        } else if cell.latency_ms == 200 && slowest.1 > 0.0 {
            // One round trip at distance: the slowest single network step
            // (each is one call now that attachments come inline).
            let per_call = a.median / slowest.1;
            targets.push(Target {
                what: format!("warm parallel p50 ≤ 1.1 × one call at {} ms", cell.latency_ms),
                measured: format!("{} / {} ms ({}) = {per_call:.2}×", ms(a.median), ms(slowest.1), slowest.0),
                met: Some(per_call <= 1.1),
            });
        }
    }
    let _ = writeln!(
        out,
        "\n### `critical_path_ms` by step (medians)\n\nEach step as the agent's timing line gives it: the delivery \
         confirmation runs beside the install (check, then the network steps in parallel or one after another, then \
         the terminal check), the MCP restart beside both; git = credentials then refresh; spawn = the run started on \
         the prepared terminal, after the install.\n\n\
         | path | injected | critical path | confirm | check | secrets | attachments | metadata | cloud | git creds | refresh | git | terminal | mcp | spawn |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for cell in latency.cells.iter().filter(|c| c.path != Path3::Cold) {
        let step = |name: &str| or_dash(cell.step_medians.get(name).map(|v| ms(*v)));
        let _ = writeln!(
            out,
            "| {} | {} ms | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            cell.path.label(),
            cell.latency_ms,
            or_dash(cell.assignment_to_start.map(|a| ms(a.median))),
            step("confirm"),
            step("check"),
            step("secrets"),
            step("attachments"),
            step("metadata"),
            step("cloud_credentials"),
            step("git_credentials"),
            step("refresh"),
            step("git_chain"),
            step("terminal"),
            step("mcp"),
            step("spawn"),
        );
    }
    let _ = writeln!(
        out,
        "\n### Ratios (paired per iteration)\n\n| injected | ratio | measure | median | spread | ratio of medians |\n|---:|---|---|---:|---:|---:|"
    );
    for ratio in &latency.ratios {
        let Some(per) = &ratio.per_iteration else { continue };
        let _ = writeln!(
            out,
            "| {} ms | {} | {} | {:.1}× | {:.1}–{:.1}× | {} |",
            ratio.latency_ms,
            ratio.name,
            ratio.what,
            per.median,
            per.min,
            per.max,
            or_dash(ratio.of_medians.map(|r| format!("{r:.1}×")))
        );
    }
    out.push('\n');
    for ratio in &latency.ratios {
        let Some(per) = &ratio.per_iteration else { continue };
        if ratio.name.starts_with("sequential") && ratio.latency_ms == 200 {
            targets.push(Target {
                what: "sequential / parallel ≥ 3× at 200 ms".into(),
                measured: format!("{:.2}× (median of pairs; {:.1}–{:.1}×)", per.median, per.min, per.max),
                met: Some(per.median >= 3.0),
            });
        }
        if ratio.name.starts_with("cold") && ratio.what.starts_with("submit") {
            targets.push(Target {
                what: format!("cold / warm ≥ 20× (submit → start) at {} ms", ratio.latency_ms),
                measured: format!("{:.0}× (median of pairs; {:.0}–{:.0}×)", per.median, per.min, per.max),
                met: Some(per.median >= 20.0),
            });
        }
    }
}

fn follow_up_table(out: &mut String, follow_ups: &FollowUpResults, targets: &mut Vec<Target>) {
    let _ = writeln!(
        out,
        "## Follow-up turns\n\nThe next turn of a thread, {} turns per tier after a first (cold) turn, {} ms injected, \
         heartbeat every {} ms. Resume = the server's span from claiming the kept sandbox to its agent ready. \
         Milliseconds.\n\n\
         | tier | submit → start p50 | p95 | spread | assignment → start p50 | resume p50 |\n\
         |---|---:|---:|---:|---:|---:|",
        follow_ups.turns_per_tier, follow_ups.latency_ms, follow_ups.heartbeat_ms
    );
    for cell in &follow_ups.cells {
        let Some(s) = &cell.submit_to_start else { continue };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            cell.tier.label(),
            ms(s.median),
            ms(s.p95),
            spread(s),
            or_dash(cell.assignment_to_start.map(|a| ms(a.median))),
            or_dash(cell.resume.map(|r| ms(r.median))),
        );
        if cell.tier == crate::followups::TurnPath::Tier1Resume {
            targets.push(Target {
                what: format!("Tier 1 follow-up submit → start p50 ≤ {TIER1_TARGET_MS} ms"),
                measured: format!("{} ms ({} ms injected)", ms(s.median), follow_ups.latency_ms),
                met: Some(s.median <= TIER1_TARGET_MS),
            });
        }
    }
    for (name, ratio) in [("Tier 2", &follow_ups.cold_over_tier2), ("Tier 1", &follow_ups.cold_over_tier1)] {
        if let Some(ratio) = ratio {
            let _ = write!(
                out,
                "{}cold / {name}: {:.1}× (median of pairs, {:.1}–{:.1}×)",
                if name == "Tier 2" { "\n" } else { "; " },
                ratio.median,
                ratio.min,
                ratio.max
            );
        }
    }
    out.push_str(".\n\n");
}

fn idle_table(out: &mut String, idle: &IdleResults, targets: &mut Vec<Target>) {
    let rss = idle.rss_kib.map_or(0.0, |s| s.max);
    let _ = writeln!(
        out,
        "## Idle footprint of a waiting agent\n\nOne prepared standby, heartbeat every {} ms, sampled once a second for {:.0} s \
         ({} samples). The agent process only (its shell and MCP server are separate processes).\n\n\
         | RSS median | RSS max | anonymous | file-backed | threads | CPU (schedstat) | CPU (ticks) | share of one core | wake-ups/s |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n\
         | {} MiB | {} MiB | {} MiB | {} MiB | {} | {:.1} ms | {:.0} ms | {:.4} % | {:.2} |\n",
        idle.heartbeat_ms,
        idle.window_s,
        idle.samples,
        mib(idle.rss_kib.map_or(0.0, |s| s.median)),
        mib(rss),
        mib(idle.rss_anon_kib.map_or(0.0, |s| s.median)),
        mib(idle.rss_file_kib.map_or(0.0, |s| s.median)),
        idle.threads,
        idle.cpu_ms_schedstat,
        idle.cpu_ms_ticks,
        idle.cpu_percent_of_core,
        idle.wakeups_per_s,
    );
    targets.push(Target {
        what: "waiting agent < 10 MiB RSS".into(),
        measured: format!("{} MiB (max)", mib(rss)),
        met: Some(rss < 10.0 * 1024.0),
    });
    targets.push(Target {
        what: "waiting agent < 0.1 % of one core".into(),
        measured: format!("{:.4} %", idle.cpu_percent_of_core),
        met: Some(idle.cpu_percent_of_core < 0.1),
    });
}

fn spread_tables(out: &mut String, spread: &SpreadResults) {
    let _ = writeln!(
        out,
        "## Server capacity over replicas\n\nStandbys spread round-robin over the replicas and over load-generator \
         processes (open-files limit {} each), heartbeat every {:.0} s. Rules: runs one at a time through the \
         replicas in turn, `POST /v1/runs` sent → assignment frame read. Burst: runs at once through every \
         replica, runs over first request → last frame.\n\n\
         | connections | replicas | store | workers | connect time | dispatch p50 | p99 | dispatches | burst runs/s | burst p50 | burst p99 | load average |\n\
         |---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        spread.open_files_limit, spread.heartbeat_s,
    );
    for level in &spread.levels {
        let (dispatch, burst) = (level.dispatch_ms, level.burst_submit_to_frame_ms);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.1} s | {} ms | {} ms | {} | {} | {} ms | {} ms | {:.2} {:.2} {:.2} |",
            level.connections,
            level.replicas,
            level.store,
            level.workers,
            level.connect_s,
            or_dash(dispatch.map(|d| ms(d.median))),
            or_dash(dispatch.map(|d| ms(d.p99))),
            level.dispatches,
            or_dash(level.burst_runs_per_s.map(|r| format!("{r:.0} ({} runs)", level.burst_assigned))),
            or_dash(burst.map(|d| ms(d.median))),
            or_dash(burst.map(|d| ms(d.p99))),
            level.load_average[0],
            level.load_average[1],
            level.load_average[2],
        );
    }
    let _ = writeln!(
        out,
        "\nPer replica (KiB / connection = (RSS connected − RSS minted) / standbys dialled there; per socket: over \
         the descriptors added: each replica holds only the sockets dialled to it, plus one link per replica on the leader; \
         the leader's memory also holds every standby's record and connection):\n\n\
         | connections | replica | role | standbys dialled | RSS minted | RSS connected | KiB / connection | open fds | KiB / socket | threads | idle CPU (one core) |\n\
         |---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for level in &spread.levels {
        for server in &level.servers {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} MiB | {} MiB | {:.1} | {} → {} | {:.1} | {} | {:.2} % |",
                level.connections,
                server.id,
                server.role,
                server.standbys,
                mib(server.rss_minted_kib as f64),
                mib(server.rss_connected_kib.map_or(0.0, |s| s.median)),
                server.kib_per_connection,
                server.fds_minted,
                server.fds_connected,
                server.kib_per_socket,
                server.threads,
                server.idle_cpu_percent_of_core,
            );
        }
    }
    out.push('\n');
    for level in &spread.levels {
        if let Some(error) = &level.error {
            let _ = writeln!(out, "- {} connections: {}", level.connections, error.replace('\n', " "));
        }
    }
    if spread.levels.iter().any(|level| level.error.is_some()) {
        out.push('\n');
    }
}

fn capacity_table(out: &mut String, capacity: &CapacityResults, targets: &mut Vec<Target>) {
    let _ = writeln!(
        out,
        "## Server capacity\n\nStandby connections held by the load generator (`standby-bench`), heartbeat every {:.0} s, \
         against `standby-server serve --provider spool`. An empty server: {} MiB RSS. Memory per connection = \
         (RSS connected − RSS with the credentials minted) / connections; per standby also counts the sandbox and \
         credential records (against the empty server). Rules = `POST /v1/runs` sent → assignment frame read by \
         the chosen connection.\n\n\
         | connections | connect time | RSS minted | RSS connected | KiB / connection | KiB / standby | idle CPU (one core) | dispatch p50 | p99 | max | dispatches |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        capacity.heartbeat_s,
        mib(capacity.rss_empty_kib as f64),
    );
    for level in &capacity.levels {
        let dispatch = level.dispatch_ms;
        let _ = writeln!(
            out,
            "| {} | {:.1} s | {} MiB | {} MiB | {:.1} | {:.1} | {:.2} % | {} ms | {} ms | {} ms | {} |",
            level.connections,
            level.connect_s,
            mib(level.rss_minted_kib as f64),
            mib(level.rss_connected_kib.map_or(0.0, |s| s.median)),
            level.kib_per_connection,
            level.kib_per_standby,
            level.idle_cpu_percent_of_core,
            or_dash(dispatch.map(|d| ms(d.median))),
            or_dash(dispatch.map(|d| ms(d.p99))),
            or_dash(dispatch.map(|d| ms(d.max))),
            level.dispatches,
        );
    }
    out.push('\n');
    for level in &capacity.levels {
        if let Some(error) = &level.error {
            let _ = writeln!(out, "- {} connections: {}", level.connections, error.replace('\n', " "));
        }
    }
    if capacity.levels.iter().any(|level| level.error.is_some()) {
        out.push('\n');
    }
    if let Some(top) = capacity.levels.iter().max_by_key(|level| level.connections) {
        let held = top.rss_connected_kib.is_some();
        targets.push(Target {
            what: format!("< 20 KiB server memory per idle connection ({} connections)", top.connections),
            measured: if held {
                format!("{:.1} KiB ({:.1} KiB with its records)", top.kib_per_connection, top.kib_per_standby)
            } else {
                "not measured (see above)".into()
            },
            met: held.then_some(top.kib_per_connection < 20.0),
        });
        targets.push(Target {
            what: format!("dispatch p99 < 25 ms ({} connections)", top.connections),
            measured: top.dispatch_ms.map_or_else(
                || "not measured (see above)".into(),
                |d| format!("{} ms (p50 {} ms, {} runs)", ms(d.p99), ms(d.median), top.dispatches),
            ),
            met: top.dispatch_ms.map(|d| d.p99 < 25.0 && top.error.is_none()),
        });
    }
}

fn burst_table(out: &mut String, burst: &BurstResults, targets: &mut Vec<Target>) {
    let _ = writeln!(
        out,
        "## Server burst\n\n{} runs submitted at once ({} requests in flight on kept-alive connections) onto {} ready \
         standbys of the load generator, against `standby-server serve --provider spool`. Agent side: `POST /v1/runs` \
         sent → the assignment frame read; server side: the run's `queued` + `commit_to_assignment_sent`. \
         Throughput: runs / (first request sent → last frame read).\n\n\
         | figure | p50 | p99 | max |\n|---|---:|---:|---:|",
        burst.runs, burst.concurrency, burst.runs,
    );
    for (what, summary) in [
        ("submit → assignment frame read (agent)", burst.submit_to_frame_ms),
        ("submit → assignment written (server)", burst.server_submit_to_sent_ms),
        ("`POST /v1/runs` answered", burst.submit_ms),
    ] {
        let cells = summary.map_or_else(
            || "– | – | –".to_owned(),
            |s| format!("{} ms | {} ms | {} ms", ms(s.median), ms(s.p99), ms(s.max)),
        );
        let _ = writeln!(out, "| {what} | {cells} |");
    }
    let _ = writeln!(
        out,
        "\n{} assignments in {:.2} s: **{:.0} assignments/s**; every submit answered after {:.2} s; standbys connected in {:.1} s.\n",
        burst.assignments, burst.assign_span_s, burst.assignments_per_s, burst.submit_span_s, burst.connect_s,
    );
    if let Some(error) = &burst.error {
        let _ = writeln!(out, "- not measured to the end: {}\n", error.replace('\n', " "));
    }
    let p99 = burst.submit_to_frame_ms.map(|s| s.p99);
    targets.push(Target {
        what: format!("≥ 1,000 assignments/s with submit → assignment p99 ≤ 50 ms ({} runs at once)", burst.runs),
        measured: p99.map_or_else(
            || "not measured (see above)".into(),
            |p99| format!("{:.0} /s, p99 {} ms", burst.assignments_per_s, ms(p99)),
        ),
        met: p99.map(|p99| burst.assignments_per_s >= 1000.0 && p99 <= 50.0 && burst.error.is_none()),
    });
}

fn compare_table(out: &mut String, compare: &CompareResults) {
    let _ = writeln!(
        out,
        "## Side by side with a baseline build\n\nBaseline: the binaries in `{}`; candidate: this run's. Both builds' \
         servers run at once and take turns run by run ({} runs each per row). Paired: the same iteration's two \
         runs, candidate − baseline (median), the pairs each build won, and the sign test's p of that split (under \
         0.05: the change, not the machine's noise, is the likely cause).\n\n\
         | what | injected | baseline p50 | candidate p50 | candidate / baseline | paired Δ p50 | won (candidate : baseline) | sign test p |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|",
        compare.baseline_bin_dir, compare.runs,
    );
    for row in &compare.rows {
        let _ = writeln!(
            out,
            "| {} | {} ms | {} | {} | {} | {} | {} | {} |",
            row.what,
            row.latency_ms,
            or_dash(row.baseline.map(|s| format!("{} ms", ms(s.median)))),
            or_dash(row.candidate.map(|s| format!("{} ms", ms(s.median)))),
            or_dash(row.ratio.map(|r| format!("{r:.2}×"))),
            or_dash(row.paired.map(|p| format!("{:+.2} ms", p.median_difference_ms))),
            or_dash(row.paired.map(|p| format!("{} : {}", p.candidate_faster, p.baseline_faster))),
            or_dash(row.paired.map(|p| format!("{:.3}", p.sign_test_p))),
        );
    }
    let _ = writeln!(
        out,
        "\n### Warm parallel by step (medians)\n\nThe agents' timing lines: model = the plan's critical path \
         from the steps; rest = critical path − model − spawn, what no step accounts for.\n\n\
         | build | injected | critical path | model | rest | confirm | check | secrets | attachments | metadata | cloud | git creds | refresh | terminal | mcp | spawn |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in &compare.steps {
        let step = |name: &str| or_dash(row.medians.get(name).map(|v| ms(*v)));
        let _ = writeln!(
            out,
            "| {} | {} ms | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            row.build,
            row.latency_ms,
            step("critical_path"),
            step("model"),
            step("rest"),
            step("confirm"),
            step("check"),
            step("secrets"),
            step("attachments"),
            step("metadata"),
            step("cloud_credentials"),
            step("git_credentials"),
            step("refresh"),
            step("terminal"),
            step("mcp"),
            step("spawn"),
        );
    }
    out.push('\n');
}
