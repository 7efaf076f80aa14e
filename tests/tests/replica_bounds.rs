//! The listener's bounds on a follower replica: its connections to the
//! leader count under its cap. Real `standby-server` replicas on one
//! PostgreSQL schema, clients as raw sockets so that the test knows every
//! connection it holds.
//!
//! Needs `cargo build --bins` and `STANDBY_TEST_POSTGRES` (skipped loudly
//! without it, failing under `CI=true`).

use std::net::SocketAddr;
use std::time::Duration;

use nix::sys::signal::Signal;
use standby_e2e::postgres::TestSchema;
use standby_e2e::server_process::{API_KEY, ServerBuilder, ServerProcess, keygen};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

const WAIT: Duration = Duration::from_secs(60);

/// One request on a connection of its own that the server closes after
/// answering: the answer's head and body.
async fn once(addr: SocketAddr, request: &str) -> String {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream.write_all(request.as_bytes()).await.expect("the request");
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.expect("the answer");
        String::from_utf8_lossy(&answer).into_owned()
    };
    tokio::time::timeout(WAIT, exchange).await.expect("an answer within the wait")
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nConnection: close\r\n\r\n")
}

/// `/metrics` of one server, read on one kept-alive connection: the test's
/// only connection to it while it counts, so the count is exact.
struct Metrics {
    stream: TcpStream,
}

impl Metrics {
    async fn open(server: &ServerProcess) -> Self {
        Self { stream: TcpStream::connect(server.addr()).await.expect("connect for /metrics") }
    }

    async fn text(&mut self) -> String {
        let request = format!("GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\r\n");
        self.stream.write_all(request.as_bytes()).await.expect("ask for /metrics");
        let mut answer = Vec::new();
        let read = async {
            loop {
                let mut buffer = [0_u8; 4096];
                let n = self.stream.read(&mut buffer).await.expect("read /metrics");
                assert!(n > 0, "the server closed the /metrics connection");
                answer.extend_from_slice(&buffer[..n]);
                let text = String::from_utf8_lossy(&answer);
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let length: usize = head
                        .lines()
                        .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length: ")?.parse().ok())
                        .expect("a content length");
                    if body.len() >= length {
                        return body.to_owned();
                    }
                }
            }
        };
        tokio::time::timeout(WAIT, read).await.expect("/metrics within the wait")
    }

    async fn gauge(&mut self, name: &str) -> u64 {
        let text = self.text().await;
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    }

    /// Waits until the server holds `n` places under its cap: its
    /// connections (this one included) and its connections to the leader.
    async fn places(&mut self, server: &ServerProcess, n: u64) {
        server
            .until(&format!("{n} places in use"), WAIT, async || {
                let held = self.gauge("standby_http_connections").await
                    + self.gauge("standby_http_outgoing_connections").await;
                (held == n).then_some(())
            })
            .await;
    }
}

/// Issue 25, finding 4: a follower counted only the connections it
/// accepted, while each call it forwards holds one more to the leader (at
/// an open-files limit of 700 and a cap of 444, 440 held calls took 699
/// descriptors and others failed with "Too many open files"). Now both
/// count: with a cap of 11, the follower's link to the leader, the test's
/// `/metrics` connection and four calls held at the leader take ten places, the next connection is
/// accepted (the place the accept loop holds for it) and its call, which
/// finds no place for its connection to the leader, is answered `503` with
/// `Retry-After`; once the held calls end, calls go through again.
#[tokio::test]
async fn a_followers_connections_to_its_leader_count_under_its_cap() {
    let Some(schema) = TestSchema::create("replica_bounds::a_followers_connections_count") else { return };
    let dir = tempfile::Builder::new().prefix("standby-replica-bounds-").tempdir().expect("a temp dir");
    let key = dir.path().join("secret.key");
    keygen(&key);
    let replica = |index: usize, cap: &str| {
        ServerBuilder::new(&dir.path().join(format!("data{index}")), &dir.path().join(format!("r{index}.log")), &{
            format!("replica-bounds-{}-{index}", std::process::id())
        })
        .args(&["--provider", "spool", "--pool-size", "0", "--store", &schema.url()])
        .args(&["--replica-id", &format!("r{index}"), "--secret-key-file", &key.display().to_string()])
        .args(&["--max-connections", cap, "--header-timeout", "10s", "--body-timeout", "60s"])
        .cluster_secret(&dir.path().join("cluster.secret"))
    };
    let leader = replica(0, "1000").start().await;
    leader
        .until("r0 to lead", WAIT, async || {
            once(leader.addr(), &get("/healthz")).await.ends_with("ok leader").then_some(())
        })
        .await;
    let follower = replica(1, "11").start().await;
    follower
        .until("r1 to follow", WAIT, async || {
            once(follower.addr(), &get("/healthz")).await.ends_with("ok follower").then_some(())
        })
        .await;
    // The leader is proven once, on a call of its own.
    assert!(once(follower.addr(), &get("/v1/runs")).await.starts_with("HTTP/1.1 200"));
    let mut metrics = Metrics::open(&follower).await;
    // The metrics connection, and the follower's link to the leader.
    metrics.places(&follower, 2).await;

    let head = format!(
        "POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    );
    let mut held = Vec::new();
    for n in 1..=4 {
        let mut stream = TcpStream::connect(follower.addr()).await.expect("connect");
        stream.write_all(head.as_bytes()).await.expect("a head whose body never comes");
        held.push(stream);
        metrics.places(&follower, 2 * n + 2).await;
    }
    let answer = once(follower.addr(), &get("/v1/runs")).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "no place left for a connection to the leader: {answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"), "{answer}");
    assert!(metrics.gauge("standby_http_outgoing_refused_total").await >= 1);

    drop(held);
    metrics.places(&follower, 2).await;
    let answer = once(follower.addr(), &get("/v1/runs")).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "calls go through again: {answer}");
    follower.stop_leaving_nothing(Signal::SIGTERM).await;
    leader.stop_leaving_nothing(Signal::SIGTERM).await;
}
