//! The run's output survives a failing log endpoint (amendment 6): the real
//! `standby` binary against the test server while the log endpoint answers
//! `503`, overflows its spool, or answers `409` after losing part of the
//! log. The run is never held up by the log, and its final event is sent
//! only after the last chunk was acknowledged.
//!
//! Needs the binary: `cargo build --bins` first (or set `STANDBY_BIN`).

use std::path::Path;
use std::time::Duration;

use standby_e2e::harness::{assert_exit, ready_agent};
use standby_e2e::server::{Endpoint, ExecutionSetup, Failure};
use standby_e2e::{AgentProcess, TestServer};
use standby_protocol::{EventKind, ExitCode, Spec};
use tempfile::TempDir;
use tokio::time::Instant;

/// Bound on every wait for the agent; generous because the machine is
/// shared with compilers.
const EXIT: Duration = Duration::from_secs(60);

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-log-").expect("create a scratch directory")
}

fn setup(script: &str) -> ExecutionSetup {
    ExecutionSetup::new(&["/bin/sh", "-c", script])
}

/// Blocks until `gate` exists.
fn wait_gate(gate: &Path) -> String {
    format!("while [ ! -e '{}' ]; do sleep 0.02; done", gate.display())
}

/// What `seq from to` prints on a terminal.
fn seq(from: u32, to: u32) -> Vec<u8> {
    (from..=to).flat_map(|n| format!("{n}\r\n").into_bytes()).collect()
}

/// Polls for a file the run writes (no event announces it), for at most `EXIT`.
async fn wait_for_file(agent: &mut AgentProcess, path: &Path) {
    let deadline = Instant::now() + EXIT;
    while !path.exists() {
        assert!(Instant::now() < deadline, "{} never appeared\n{}", path.display(), agent.output_tail());
        assert!(agent.try_exit().is_none(), "the agent exited early\n{}", agent.output_tail());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn assert_exits_0(agent: &mut AgentProcess) {
    let code = agent.wait_exit(EXIT).await;
    assert_exit(agent, code, ExitCode::Success, "the run finished");
}

/// The event that ended the run was posted only after the last log chunk
/// was acknowledged.
fn assert_final_event_after_the_log(server: &TestServer, execution_id: &str) {
    let event = server
        .events(execution_id)
        .into_iter()
        .find(|event| event.kind.is_terminal())
        .unwrap_or_else(|| panic!("no event ended {execution_id}"));
    let final_type = event.kind.name();
    let calls = server.http_calls();
    let last_log = calls
        .iter()
        .filter(|call| call.endpoint == Endpoint::Log && call.status == 200)
        .map(|call| call.ended)
        .max()
        .expect("log chunks were acknowledged");
    let first_post = calls
        .iter()
        .filter(|call| call.event_id.as_deref() == Some(event.event_id.as_str()))
        .map(|call| call.started)
        .min()
        .expect("the event was posted");
    assert!(last_log <= first_post, "{final_type} was posted before the last log chunk was acknowledged");
}

#[tokio::test]
async fn a_log_outage_neither_slows_the_run_nor_loses_a_line() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    let printed = dir.path().join("printed");
    server.fail(Endpoint::Log, Failure::always(503));
    let outage_began = Instant::now();
    let execution_id = server.assign(&token, setup(&format!("seq 1 200000; touch '{}'", printed.display())));
    wait_for_file(&mut agent, &printed).await;
    // The run printed everything while the endpoint refused every chunk:
    // nothing of its output had to reach the server first.
    let record = server.execution(&execution_id).expect("the execution is recorded");
    assert_eq!(record.log_received, 0, "a log chunk was accepted during the outage");
    assert!(
        server.http_calls().iter().any(|call| call.endpoint == Endpoint::Log && call.status == 503),
        "the agent tried to ship during the outage"
    );
    let exited = record.events.iter().any(|event| matches!(event.kind, EventKind::Exited { .. }));
    assert!(!exited, "exited was reported before the log was shipped");
    // The outage lasts at least 4 s, as in the scenario.
    tokio::time::sleep_until(outage_began + Duration::from_secs(4)).await;
    server.clear_failures();
    assert_exits_0(&mut agent).await;

    let log = server.log(&execution_id);
    let expected = seq(1, 200_000);
    assert!(log == expected, "the log is not the run's output: {} bytes, expected {}", log.len(), expected.len());
    assert_final_event_after_the_log(&server, &execution_id);
    server.assert_no_violations();
}

#[tokio::test]
async fn an_overflowing_spool_reports_the_dropped_bytes_and_keeps_their_offsets() {
    // Four chunks' worth: once the server holds the whole first part, at
    // most one chunk is unacknowledged at the agent, so the tail finds room.
    const BOUND: u64 = 256 * 1024;
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| {
        agent.env("STANDBY_LOG_SPOOL_MAX", &BOUND.to_string())
    })
    .await;
    let printed = dir.path().join("printed");
    let gate = dir.path().join("gate");
    server.fail(Endpoint::Log, Failure::always(503));
    let script = format!("seq 1 100000; touch '{}'; {}; echo after-the-gap", printed.display(), wait_gate(&gate));
    let execution_id = server.assign(&token, setup(&script));
    wait_for_file(&mut agent, &printed).await;
    server.clear_failures();
    let first = seq(1, 100_000);
    server
        .wait_until("the first part to be received or reported dropped", |records| {
            (records.executions.get(&execution_id)?.log_received >= first.len() as u64).then_some(())
        })
        .await;
    std::fs::write(&gate, "").expect("open the gate");
    assert_exits_0(&mut agent).await;

    let record = server.execution(&execution_id).expect("the execution is recorded");
    // The spool kept the oldest output up to its bound. Output still on its
    // way from the terminal when the outage ended may meet a full spool
    // again, so there may be more gaps after the first.
    assert_eq!(record.log_gaps.first().map(|gap| gap.0), Some(BOUND), "gaps: {:?}", record.log_gaps);
    let mut expected: Vec<u8> = Vec::new();
    let mut from = 0;
    for &(at, dropped) in &record.log_gaps {
        let at = usize::try_from(at).expect("fits");
        assert!(dropped > 0 && at >= from, "gaps: {:?}", record.log_gaps);
        expected.extend(&first[from..at.min(first.len())]);
        from = at + usize::try_from(dropped).expect("fits");
    }
    expected.extend(&first[from.min(first.len())..]);
    expected.extend(b"after-the-gap\r\n");
    assert!(
        record.log == expected,
        "the log is not the output with exactly the reported gaps {:?} left out: {} bytes, expected {}, first difference at {:?}",
        record.log_gaps,
        record.log.len(),
        expected.len(),
        record.log.iter().zip(&expected).position(|(a, b)| a != b)
    );
    assert_eq!(record.log_received, first.len() as u64 + 15, "offsets after the gap are the true ones");
    assert_final_event_after_the_log(&server, &execution_id);
    server.assert_no_violations();
}

#[tokio::test]
async fn a_409_after_the_server_lost_part_of_the_log_resends_it_from_the_spool() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent).await;
    let gate = dir.path().join("gate");
    let execution_id = server.assign(&token, setup(&format!("seq 1 5000; {}; seq 5001 10000", wait_gate(&gate))));
    server.wait_for_log(&execution_id, b"\r\n5000\r\n").await;
    server.forget_log(&execution_id, 1000).expect("the execution exists");
    std::fs::write(&gate, "").expect("open the gate");
    assert_exits_0(&mut agent).await;

    let record = server.execution(&execution_id).expect("the execution is recorded");
    assert!(
        server.http_calls().iter().any(|call| call.endpoint == Endpoint::Log && call.status == 409),
        "the server answered 409"
    );
    assert!(record.log_gaps.is_empty(), "the lost bytes were still spooled: {:?}", record.log_gaps);
    let expected = seq(1, 10_000);
    assert!(record.log == expected, "the log is not the run's output: {} bytes", record.log.len());
    assert_final_event_after_the_log(&server, &execution_id);
    server.assert_no_violations();
}
