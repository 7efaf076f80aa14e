//! The agent's network hardening (issue 13), the real binary against the
//! test server: credentials only to the server's origin (amendment 2), one
//! trust store for wss and https with a private CA, inline attachments
//! (amendment 5) and an assignment without a workspace (amendment 1), capped
//! JSON answers and streamed attachments, per-turn hygiene, and the spec
//! fetched before the switch to the run credential.
//!
//! Needs the binary: `cargo build --bins` first (or set `STANDBY_BIN`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;
use standby_e2e::harness::{assert_exit, event_kinds, ready_agent};
use standby_e2e::server::{AttachmentSetup, CredentialKind, Endpoint, ExecutionSetup};
use standby_e2e::{AgentBuilder, GitRepo, TestServer};
use standby_protocol::layout::StateDir;
use standby_protocol::{AgentState, EventKind, ExitCode, Spec, Stage};
use tempfile::TempDir;
use tokio::net::{TcpListener, TcpStream};

/// Bound on every wait for the agent; generous because the machine is
/// shared with compilers.
const EXIT: Duration = Duration::from_secs(60);

/// The signature of a pre-signed URL: it must never appear in the agent's
/// output or in a report.
const SIGNATURE: &str = "sekrit";

fn scratch() -> TempDir {
    TempDir::with_prefix("standby-e2e-net-").expect("create a scratch directory")
}

fn sh(script: &str) -> ExecutionSetup {
    ExecutionSetup::new(&["/bin/sh", "-c", script])
}

// ---- a second origin ---------------------------------------------------------

/// One request the object store received.
#[derive(Debug, Clone)]
struct Seen {
    path_and_query: String,
    authorization: bool,
    protocol_header: bool,
}

#[derive(Debug, Default)]
struct StoreState {
    objects: BTreeMap<String, Vec<u8>>,
    seen: Vec<Seen>,
    /// Where `/cross/…` redirects.
    cross_target: String,
}

/// An object store on a second loopback origin (`127.0.0.2`): `/o/{name}`
/// serves an object, `/same/{name}` redirects to it on this origin, and
/// `/cross/{name}` redirects to another origin. It records the headers of
/// every request.
struct ObjectStore {
    addr: SocketAddr,
    state: Arc<Mutex<StoreState>>,
}

impl ObjectStore {
    async fn start(objects: &[(&str, &[u8])]) -> Self {
        let listener = TcpListener::bind("127.0.0.2:0").await.expect("bind 127.0.0.2:0");
        let addr = listener.local_addr().expect("a bound listener has an address");
        let state = Arc::new(Mutex::new(StoreState {
            objects: objects.iter().map(|(name, bytes)| ((*name).to_owned(), bytes.to_vec())).collect(),
            ..StoreState::default()
        }));
        let router = Router::new()
            .route("/o/{name}", get(object))
            .route("/same/{name}", get(same_origin_redirect))
            .route("/cross/{name}", get(cross_origin_redirect))
            .with_state(Arc::clone(&state));
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self { addr, state }
    }

    /// A pre-signed URL of `route/name` on this origin.
    fn url(&self, route: &str, name: &str) -> String {
        format!("http://{}/{route}/{name}?X-Amz-Signature={SIGNATURE}&X-Amz-Expires=300", self.addr)
    }

    fn set_cross_target(&self, target: &str) {
        self.state.lock().expect("the store's lock").cross_target = target.to_owned();
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().expect("the store's lock").seen.clone()
    }
}

fn record(state: &Mutex<StoreState>, uri: &Uri, headers: &HeaderMap) {
    state.lock().expect("the store's lock").seen.push(Seen {
        path_and_query: uri.path_and_query().map(ToString::to_string).unwrap_or_default(),
        authorization: headers.contains_key(header::AUTHORIZATION),
        protocol_header: headers.contains_key("standby-protocol"),
    });
}

async fn object(
    State(state): State<Arc<Mutex<StoreState>>>,
    UrlPath(name): UrlPath<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&state, &uri, &headers);
    let object = state.lock().expect("the store's lock").objects.get(&name).cloned();
    match object {
        Some(bytes) => bytes.into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn same_origin_redirect(
    State(state): State<Arc<Mutex<StoreState>>>,
    UrlPath(name): UrlPath<String>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&state, &uri, &headers);
    let location = format!("/o/{name}?X-Amz-Signature={SIGNATURE}");
    (StatusCode::FOUND, [(header::LOCATION, location)]).into_response()
}

async fn cross_origin_redirect(State(state): State<Arc<Mutex<StoreState>>>, uri: Uri, headers: HeaderMap) -> Response {
    record(&state, &uri, &headers);
    let location = state.lock().expect("the store's lock").cross_target.clone();
    (StatusCode::FOUND, [(header::LOCATION, location)]).into_response()
}

#[tokio::test]
async fn attachments_on_another_origin_get_no_credential_and_no_signature_in_the_output() {
    let server = TestServer::start().await;
    let dir = scratch();
    let direct: &[u8] = b"fetched directly from the store\n";
    let moved: &[u8] = b"fetched after a same-origin redirect\n";
    let store = ObjectStore::start(&[("direct.bin", direct), ("moved.bin", moved)]).await;
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent.log_filter("trace")).await;

    let out = dir.path().join("out");
    let script = format!("mkdir -p '{out}' && cp \"$STANDBY_ATTACHMENTS_DIR\"/* '{out}'/", out = out.display());
    let execution = sh(&script)
        .attachment_setup(AttachmentSetup::new("direct.bin", direct).url(&store.url("o", "direct.bin")))
        .attachment_setup(AttachmentSetup::new("moved.bin", moved).url(&store.url("same", "moved.bin")))
        .attachment("local.md", b"served by the server, with the credential\n");
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);

    assert_eq!(std::fs::read(out.join("direct.bin")).expect("direct.bin"), direct);
    assert_eq!(std::fs::read(out.join("moved.bin")).expect("moved.bin"), moved);
    assert!(out.join("local.md").is_file());
    let seen = store.seen();
    let paths: Vec<&str> = seen.iter().map(|seen| seen.path_and_query.split('?').next().unwrap_or("")).collect();
    for expected in ["/o/direct.bin", "/same/moved.bin", "/o/moved.bin"] {
        assert!(paths.contains(&expected), "the store never saw {expected}: {paths:?}");
    }
    assert!(seen.iter().all(|seen| seen.path_and_query.contains(SIGNATURE)), "the query string is sent: {seen:?}");
    assert!(
        seen.iter().all(|seen| !seen.authorization && !seen.protocol_header),
        "another origin received a credential or the protocol header: {seen:?}"
    );
    let local = server.http_calls().into_iter().find(|call| call.endpoint == Endpoint::AttachmentFile);
    assert_eq!(
        local.map(|call| call.credential),
        Some(Some(CredentialKind::Run)),
        "the server's own file is fetched with the run credential"
    );
    let run_credential = server.run_credential(&execution_id).expect("minted");
    agent.assert_output_lacks(&[SIGNATURE, &run_credential, &token]);
    server.assert_no_violations();
}

#[tokio::test]
async fn a_redirect_to_another_origin_is_refused_and_its_query_never_shown() {
    let server = TestServer::start().await;
    let dir = scratch();
    let store = ObjectStore::start(&[]).await;
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent.log_filter("trace")).await;

    let marker = dir.path().join("marker");
    let execution = sh(&format!("touch '{}'", marker.display()))
        .execution_id("exe_cross")
        .attachment_setup(AttachmentSetup::new("x.bin", b"x").url(&store.url("cross", "x.bin")));
    // Bounced back to the server's own file: a credential would be accepted there.
    store.set_cross_target(&format!(
        "{}/v1/executions/exe_cross/attachments/x.bin?X-Amz-Signature={SIGNATURE}",
        server.url()
    ));
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the install failed");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "{:?}", server.events(&execution_id));
    let failure = &failures[0];
    assert_eq!(failure.stage, Stage::Attachments.name());
    assert!(!failure.requeueable, "a cold sandbox would meet the same redirect");
    assert!(failure.message.contains("redirect") && failure.message.contains("origin"), "{failure:?}");
    assert!(!failure.message.contains(SIGNATURE), "the report shows the query string: {:?}", failure.message);
    assert!(!marker.exists(), "the run started");
    assert_eq!(store.seen().len(), 1, "one request, not retried: {:?}", store.seen());
    assert!(
        !server.http_calls().iter().any(|call| call.endpoint == Endpoint::AttachmentFile),
        "the cross-origin redirect was followed"
    );
    agent.assert_output_lacks(&[SIGNATURE]);
    server.assert_no_violations();
}

// ---- inline attachments, no workspace ------------------------------------------

#[tokio::test]
async fn inline_attachments_skip_the_call_and_a_run_without_workspace_takes_the_prepared_one() {
    let server = TestServer::start().await;
    let dir = scratch();
    let ws = dir.path().join("workspace");
    std::fs::create_dir(&ws).expect("create the workspace");
    let origin = GitRepo::new(&[("README.md", "hello\n")]);
    let spec = json!({"workspace": {"repos": [{"url": origin.url(), "path": "app", "ref": "main"}]}});
    let token = server.add_standby();
    let mut agent =
        ready_agent(&server, &token, dir.path(), &spec, |agent| agent.log_filter("trace").workspace(&ws)).await;
    // After preparation: the run (with no `workspace`) gets the head of `ref`.
    let head = origin.commit(&[("NEW.md", "new\n")]);

    let out = dir.path().join("out");
    let script = format!(
        "mkdir -p '{out}' && cp \"$STANDBY_ATTACHMENTS_DIR\"/spec.md '{out}'/ && git rev-parse HEAD > '{out}/head'",
        out = out.display()
    );
    let execution = sh(&script).cwd("app").attachment("spec.md", b"# inline\n").inline_attachments();
    assert!(execution.run.workspace.is_none());
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert_eq!(std::fs::read(out.join("spec.md")).expect("the attachment"), b"# inline\n");
    assert_eq!(std::fs::read_to_string(out.join("head")).expect("the head").trim(), head);
    let calls = server.http_calls();
    assert!(!calls.iter().any(|call| call.endpoint == Endpoint::Attachments), "the attachments call was made");
    assert!(calls.iter().any(|call| call.endpoint == Endpoint::AttachmentFile), "the attachment was not fetched");
    server.assert_no_violations();
}

// ---- bounded memory ------------------------------------------------------------

#[tokio::test]
async fn an_oversized_secrets_answer_fails_the_install_naming_the_call_and_the_cap() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent.log_filter("trace")).await;
    let marker = dir.path().join("marker");
    let execution = sh(&format!("touch '{}'", marker.display())).secret("HUGE", &"x".repeat(2 << 20));
    let execution_id = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::InstallFailed, "the install failed");
    let failures = server.install_failures(&execution_id);
    assert_eq!(failures.len(), 1, "{:?}", server.events(&execution_id));
    let failure = &failures[0];
    assert_eq!((failure.stage.as_str(), failure.requeueable), ("secrets", false), "{failure:?}");
    assert!(failure.message.contains("/secrets") && failure.message.contains("1 MiB"), "{:?}", failure.message);
    assert!(!marker.exists(), "the run started");
    server.assert_no_violations();
}

/// `VmHWM` (peak resident set) of a process, in KiB.
fn peak_rss_kib(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[tokio::test]
async fn a_64_mib_attachment_is_streamed_to_disk_intact() {
    let server = TestServer::start().await;
    let dir = scratch();
    let token = server.add_standby();
    let mut agent = ready_agent(&server, &token, dir.path(), &Spec::default(), |agent| agent.log_filter("info")).await;
    let idle_kib = peak_rss_kib(agent.pid());
    // Random content, hashed by `sha256sum` (the test's own sha2 is
    // unoptimised in a debug build and would dominate the test's time).
    let source = dir.path().join("big.src");
    let mut content = Vec::with_capacity(64 << 20);
    std::io::Read::read_to_end(
        &mut std::io::Read::take(std::fs::File::open("/dev/urandom").expect("urandom"), 64 << 20),
        &mut content,
    )
    .expect("read /dev/urandom");
    std::fs::write(&source, &content).expect("write the source");
    let sum = std::process::Command::new("sha256sum").arg(&source).output().expect("run sha256sum");
    let expected = String::from_utf8_lossy(&sum.stdout).split_whitespace().next().expect("a checksum").to_owned();
    let mut attachment = AttachmentSetup::new("big.bin", &content);
    attachment.sha256 = Some(expected.clone());
    drop(content);
    let out = dir.path().join("out");
    let script = format!(
        "mkdir -p '{out}' && sha256sum \"$STANDBY_ATTACHMENTS_DIR/big.bin\" > '{out}/sum' \
         && ls -A \"$STANDBY_ATTACHMENTS_DIR\" > '{out}/ls' && grep VmHWM /proc/$PPID/status > '{out}/hwm'",
        out = out.display()
    );
    let execution_id = server.assign(&token, sh(&script).attachment_setup(attachment));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    let sum = std::fs::read_to_string(out.join("sum")).expect("the run's checksum");
    assert_eq!(sum.split_whitespace().next(), Some(expected.as_str()), "the attachment arrived intact");
    let listing = std::fs::read_to_string(out.join("ls")).expect("the listing");
    assert_eq!(listing.trim(), "big.bin", "no temporary file is left beside the attachment");
    // For the report, not asserted: memory is not the point of this test.
    let hwm = std::fs::read_to_string(out.join("hwm")).unwrap_or_default();
    eprintln!("agent peak RSS: ready {idle_kib:?} KiB; after a 64 MiB attachment {}", hwm.trim());
    server.assert_no_violations();
}

// ---- per-turn hygiene ----------------------------------------------------------

#[tokio::test]
async fn a_follow_up_turn_finds_none_of_the_first_turns_credentials() {
    let server = TestServer::start().await;
    let dir = scratch();
    let ws = dir.path().join("workspace");
    std::fs::create_dir(&ws).expect("create the workspace");
    let origin = GitRepo::new(&[("README.md", "hello\n")]);
    let spec = json!({"workspace": {"repos": [{"url": origin.url(), "path": "app", "ref": "main"}]}});
    let password = "turn1-git-pass-4711";
    let state = StateDir::of(&ws);

    // Turn 1 points the repo's own config at the store too, as a run may.
    let first = server.add_standby();
    let mut agent =
        ready_agent(&server, &first, dir.path(), &spec, |agent| agent.log_filter("trace").workspace(&ws)).await;
    let script = "helper=$(git config --get-all credential.helper | tail -n 1) \
                  && git config --local --add credential.helper \"$helper\" && echo turn one done";
    let execution = sh(script)
        .cwd("app")
        .git_credential("https", "git.example", "x-access-token", password)
        .metadata(json!({"turn": 1}))
        .attachment("spec.md", b"turn one's attachment")
        .cloud_env("CLOUD_TOKEN", "turn1-cloud-4712");
    let turn_one = server.assign(&first, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "turn one finished");
    assert_eq!(event_kinds(&server, &turn_one), [EventKind::Started, EventKind::Exited { code: 0 }]);
    for leftover in [state.git_credentials(), state.metadata_file(), state.attachments_dir()] {
        assert!(!leftover.exists(), "turn one left {} behind", leftover.display());
    }

    // Turn 2, on the same workspace, with no credentials of its own, looks.
    let second = server.add_standby();
    let mut agent =
        ready_agent(&server, &second, dir.path(), &spec, |agent| agent.log_filter("trace").workspace(&ws)).await;
    let script = format!(
        "ls -A '{state}'; cat '{credentials}' '{metadata}' 2>&1; \
         printf 'protocol=https\\nhost=git.example\\n\\n' | git credential fill 2>&1; \
         echo \"helpers: $(git config --local --get-all credential.helper)\"; echo turn two done",
        state = state.path().display(),
        credentials = state.git_credentials().display(),
        metadata = state.metadata_file().display(),
    );
    let execution = sh(&script).cwd("app").env("GIT_TERMINAL_PROMPT", "0");
    let turn_two = server.assign(&second, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "turn two finished");
    let log = String::from_utf8_lossy(&server.log(&turn_two)).into_owned();
    assert!(log.contains("turn two done"), "{log}");
    assert!(!log.contains(password) && !log.contains("turn1-cloud"), "turn two saw turn one's credentials: {log}");
    let listed = format!("{}\r\n", state.git_credentials().file_name().expect("a file name").to_string_lossy());
    assert!(!log.contains(&listed) && !log.contains("turn one's attachment"), "{log}");
    assert!(log.contains("helpers: \r\n") || log.contains("helpers:\r\n"), "a helper still points at a store: {log}");
    agent.assert_output_lacks(&[password]);
    server.assert_no_violations();
}

/// An agent killed before its cleanup leaves its run's files in
/// `.standby/`: the next run finds its own files there, and none of them
/// (the next agent removes them when its preparation ends, before it is
/// ready for a run).
#[tokio::test]
async fn a_run_after_one_killed_before_its_cleanup_finds_only_its_own_files() {
    let server = TestServer::start().await;
    let dir = scratch();
    let ws = dir.path().join("workspace");
    std::fs::create_dir(&ws).expect("create the workspace");
    let state = StateDir::of(&ws);
    std::fs::create_dir_all(state.attachments_dir()).expect("create the attachments directory");
    std::fs::write(state.metadata_file(), b"{\"turn\": \"stale-metadata\"}").expect("stale metadata");
    std::fs::write(state.git_credentials(), b"https://x:stale-pass@git.example\n").expect("stale credentials");
    std::fs::write(state.attachments_dir().join("stale.md"), b"stale attachment").expect("stale attachment");

    let token = server.add_standby();
    let mut agent =
        ready_agent(&server, &token, dir.path(), &json!({"workspace": {}}), |agent| agent.workspace(&ws)).await;
    let script = format!(
        "cat '{metadata}' '{credentials}'; ls -A '{attachments}'; echo run done",
        metadata = state.metadata_file().display(),
        credentials = state.git_credentials().display(),
        attachments = state.attachments_dir().display(),
    );
    let execution = sh(&script)
        .metadata(json!({"turn": "this-run"}))
        .attachment("own.md", b"this run's attachment")
        .git_credential("https", "git.example", "x-access-token", "own-pass-4713");
    let run = server.assign(&token, execution);
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    let log = String::from_utf8_lossy(&server.log(&run)).into_owned();
    assert!(log.contains("run done"), "{log}");
    assert!(log.contains("this-run") && log.contains("own.md"), "the run's own files are missing: {log}");
    // Its password is redacted from the log; its user name is not.
    assert!(log.contains("https://x-access-token:"), "the run's git credential is missing: {log}");
    assert!(!log.contains("stale"), "the run found a killed run's files: {log}");
    server.assert_no_violations();
}

// ---- the spec before the switch ---------------------------------------------

#[tokio::test]
async fn an_assignment_on_connect_waits_for_the_spec_before_the_switch() {
    let server = TestServer::start().await;
    server.set_spec(&Spec::default());
    let token = server.add_standby();
    let dir = scratch();
    let marker = dir.path().join("marker");
    // Committed before the agent connects: replayed the moment its standby
    // connection opens, while the (slow) spec fetch is still in flight.
    let execution_id = server.assign(&token, sh(&format!("touch '{}'", marker.display())));
    server.set_endpoint_latency(Endpoint::Spec, Duration::from_millis(1500));
    let mut agent = AgentBuilder::new(&server.url(), &token).heartbeat_interval("200ms").spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert!(marker.exists(), "the run did not run");
    let spec_calls: Vec<_> = server.http_calls().into_iter().filter(|call| call.endpoint == Endpoint::Spec).collect();
    assert!(
        spec_calls.iter().all(|call| call.credential == Some(CredentialKind::Standby) && call.status == 200),
        "the spec is fetched with the standby credential while it is valid: {spec_calls:?}"
    );
    let first_run_upgrade = server
        .upgrades()
        .into_iter()
        .find(|upgrade| upgrade.credential == Some(CredentialKind::Run))
        .expect("the run credential connected");
    assert!(
        spec_calls.iter().all(|call| call.ended <= first_run_upgrade.at),
        "the run credential connected (revoking the standby credential) before the spec arrived"
    );
    server.assert_no_violations();
}

// ---- one trust store -----------------------------------------------------------

/// A private CA and a TLS-terminating proxy on 127.0.0.1 in front of the
/// test server, with a certificate for `127.0.0.1` issued by that CA.
struct TlsFront {
    addr: SocketAddr,
    ca_pem: String,
}

impl TlsFront {
    async fn start(backend: SocketAddr) -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(DnType::CommonName, "standby test CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let ca_key = KeyPair::generate().expect("a CA key");
        let ca_cert = ca_params.self_signed(&ca_key).expect("the CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().expect("a server key");
        let leaf_params = CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("server parameters");
        let leaf = leaf_params.signed_by(&leaf_key, &issuer).expect("the server certificate");

        let key = rustls::pki_types::PrivateKeyDer::try_from(leaf_key.serialize_der()).expect("a private key");
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(vec![leaf.der().clone()], key)
            .expect("a server configuration");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("a bound listener has an address");
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A client that does not trust the CA fails the
                    // handshake; nothing reaches the backend then.
                    let Ok(mut tls) = acceptor.accept(stream).await else { return };
                    let Ok(mut plain) = TcpStream::connect(backend).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
            }
        });
        Self { addr, ca_pem: ca_cert.pem() }
    }

    fn url(&self) -> String {
        format!("https://{}", self.addr)
    }
}

#[tokio::test]
async fn a_private_ca_in_standby_ca_file_serves_both_wss_and_https() {
    let server = TestServer::start().await;
    server.set_spec(&Spec::default());
    let front = TlsFront::start(server.addr()).await;
    let dir = scratch();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, &front.ca_pem).expect("write the CA file");

    // Without the CA: TLS fails, as a transient error, on both paths.
    let untrusting = server.add_standby();
    let mut agent = AgentBuilder::new(&front.url(), &untrusting).deadline("3s").spawn();
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::DeadlinePassed, "no connection before the deadline");
    let output = agent.output();
    assert!(output.contains("control socket unavailable"), "{}", agent.output_tail());
    assert!(output.to_lowercase().contains("certificate"), "the TLS failure is not named\n{}", agent.output_tail());
    assert!(server.upgrades().is_empty() && server.http_calls().is_empty(), "something got through the TLS front");

    // With it: the spec over https, the socket over wss, an attachment over https.
    let token = server.add_standby();
    let out = dir.path().join("out");
    let mut agent = AgentBuilder::new(&front.url(), &token)
        .env("STANDBY_CA_FILE", &ca_file.display().to_string())
        .heartbeat_interval("200ms")
        .spawn();
    agent.watch(server.wait_for_heartbeat(|heartbeat| heartbeat.state == AgentState::Ready)).await;
    let script = format!("mkdir -p '{out}' && cp \"$STANDBY_ATTACHMENTS_DIR\"/a.txt '{out}'/", out = out.display());
    let execution_id = server.assign(&token, sh(&script).attachment("a.txt", b"over https"));
    let code = agent.wait_exit(EXIT).await;
    assert_exit(&agent, code, ExitCode::Success, "the run finished over TLS");
    assert_eq!(event_kinds(&server, &execution_id), [EventKind::Started, EventKind::Exited { code: 0 }]);
    assert_eq!(std::fs::read(out.join("a.txt")).expect("the attachment"), b"over https");
    server.assert_no_violations();
}

#[tokio::test]
async fn an_unusable_ca_file_exits_2_naming_the_path() {
    let dir = scratch();
    let bad = dir.path().join("not-a-ca.pem");
    std::fs::write(&bad, "hello\n").expect("write");
    for path in [bad.clone(), dir.path().join("missing.pem")] {
        let mut agent = AgentBuilder::new("http://127.0.0.1:9", "sby_x")
            .env("STANDBY_CA_FILE", &path.display().to_string())
            .spawn();
        let code = agent.wait_exit(EXIT).await;
        assert_exit(&agent, code, ExitCode::Usage, "an unusable CA file is bad configuration");
        let stderr = agent.stderr();
        assert!(stderr.contains("STANDBY_CA_FILE") && stderr.contains(&path.display().to_string()), "{stderr}");
    }
}
