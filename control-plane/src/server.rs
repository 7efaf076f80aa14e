//! The server: HTTP and the control socket on one listener (axum), the
//! engine task, and an orderly shutdown.
//!
//! Shutdown order: stop dispatching, stop every sandbox while HTTP still
//! serves (so a run stopped by it can still report), stop accepting, end
//! the engine (which closes every control connection).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::Response;
use axum::routing::{get, post};
use standby_protocol::{Secret, Spec, fingerprint, paths};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::app::AppState;
use crate::cluster::{Cluster, ClusterConfig, ClusterView, Leadership, Role};
use crate::credential::{RandomMint, TokenHash};
use crate::engine::{Engine, EngineConfig, EngineHandle, Mailbox};
use crate::listener::{ListenerLimits, ListenerStats};
use crate::model::Clock;
use crate::policy::PoolPolicy;
use crate::provider::SandboxProvider;
use crate::rules::{Input, Rules, RulesConfig, RunBounds};
use crate::store::{LeaseStore, Store, StoreError};
use crate::{agent_api, user_api};

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Provider(#[from] crate::provider::ProviderError),
    #[error("the server failed: {0}")]
    Failed(String),
}

/// Everything `standby-server serve` is configured with, but the store and
/// the provider.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// The base URL agents are given; `http://<bound address>` when unset
    /// (with `127.0.0.1` for an unspecified address).
    pub public_url: Option<String>,
    pub api_key: Secret,
    /// What standbys prepare (`GET /v1/standby/spec`).
    pub spec: Spec,
    pub pool_size: usize,
    pub heartbeat_interval: Duration,
    pub max_attempts: u32,
    pub launch_timeout: Duration,
    /// How long a running run's sandbox may go unheard before the run is
    /// failed and the sandbox written off (see [`RulesConfig::run_silence`]).
    pub run_silence: Duration,
    pub linger: Duration,
    pub agent_log: String,
    /// Added before answering every agent call under `/v1/executions/`:
    /// benchmarks give a loopback server the round trip of a remote one.
    /// Zero (the default) adds nothing.
    pub inject_latency: Duration,
    /// The pool policy and the thread tiers.
    pub pool_policy: PoolPolicy,
    /// What one run may cost: its log cap, its time in memory once finished.
    pub bounds: RunBounds,
    /// Header timeout, connection cap, upgrades in flight.
    pub listener: ListenerLimits,
    /// Where traces go (`--otlp-endpoint`, checked by
    /// `standby_otlp::traces_url`); `None`: nothing is traced.
    pub otlp_endpoint: Option<String>,
}

impl ServerConfig {
    /// Defaults for everything but the key and the spec.
    pub fn new(api_key: Secret, spec: Spec) -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            public_url: None,
            api_key,
            spec,
            pool_size: 2,
            heartbeat_interval: Duration::from_secs(15),
            max_attempts: 3,
            launch_timeout: Duration::from_secs(120),
            run_silence: Duration::from_secs(300),
            linger: Duration::from_secs(30),
            agent_log: "info".into(),
            inject_latency: Duration::ZERO,
            pool_policy: PoolPolicy::default(),
            bounds: RunBounds::default(),
            listener: ListenerLimits::for_open_files(crate::listener::open_files_limit()),
            otlp_endpoint: None,
        }
    }
}

/// The auto-stop a kept sandbox is given again after a restart: its
/// record's, when the provider lost its own (`kept` is `None`: the Docker
/// provider holds auto-stops in memory, and the engine has no timer of its
/// own, so an adopted container would otherwise never be stopped while
/// idle). A provider that kept one (the local provider's meta file) is
/// left as it is: it may hold a resume's raise that the record does not.
fn auto_stop_to_restore(recorded: Option<u32>, kept: Option<u32>) -> Option<u32> {
    if kept.is_some() { None } else { recorded }
}

/// Gives every kept sandbox the auto-stop [`auto_stop_to_restore`] says,
/// best effort and bounded per sandbox.
async fn restore_auto_stops<P: SandboxProvider>(provider: &P, records: &[crate::model::SandboxRecord]) {
    let kept = records.iter().filter(|record| record.state != crate::model::SandboxState::Retired);
    for record in kept {
        let bound = crate::engine::AUTO_STOP_BOUND;
        let Ok(Ok(current)) = tokio::time::timeout(bound, provider.auto_stop(&record.id)).await else { continue };
        let Some(minutes) = auto_stop_to_restore(record.auto_stop_minutes, current) else { continue };
        match tokio::time::timeout(bound, provider.set_auto_stop(&record.id, minutes)).await {
            Ok(Ok(())) => tracing::info!(sandbox_id = record.id, minutes, "auto-stop restored from the store"),
            Ok(Err(error)) => tracing::warn!(sandbox_id = record.id, %error, "restoring the auto-stop failed"),
            Err(_) => tracing::warn!(sandbox_id = record.id, "restoring the auto-stop timed out"),
        }
    }
}

fn router(state: AppState, public_url: Option<&str>) -> Router {
    let ui = crate::ui::routes(state.clone(), public_url);
    let link = state.link.clone().map(|link| {
        let route = crate::link::leader::LinkRoute { engine: state.engine.clone(), link };
        Router::new().route(crate::link::LINK_PATH, get(crate::link::leader::link)).with_state(route)
    });
    let app = Router::new()
        .route("/healthz", get(health))
        .route("/v1/cluster", get(user_api::cluster_status::cluster))
        .route(standby_protocol::SOCKET_PATH, get(agent_api::socket))
        .route(standby_protocol::SPEC_PATH, get(agent_api::spec))
        .route(paths::SECRETS_ROUTE, get(agent_api::secrets))
        .route(paths::ATTACHMENTS_ROUTE, get(agent_api::attachments))
        .route(paths::ATTACHMENT_ROUTE, get(agent_api::attachment))
        .route(paths::GIT_CREDENTIALS_ROUTE, post(agent_api::git_credentials))
        .route(paths::METADATA_ROUTE, get(agent_api::metadata))
        .route(paths::CLOUD_CREDENTIALS_ROUTE, post(agent_api::cloud_credentials))
        .route(paths::EVENTS_ROUTE, post(agent_api::events))
        .route(paths::LOG_ROUTE, post(agent_api::log))
        .route("/v1/runs", post(user_api::submit).get(user_api::reads::list))
        .route("/v1/runs/{id}", get(user_api::get))
        .route("/v1/runs/{id}/log", get(user_api::reads::log))
        .route("/v1/runs/{id}/events", get(user_api::reads::events))
        .route("/v1/runs/{id}/cancel", post(user_api::cancel))
        .route("/v1/sandboxes", get(user_api::reads::sandboxes))
        .route("/v1/threads/{id}", get(user_api::thread))
        .route("/metrics", get(user_api::metrics))
        .route("/openapi.json", get(user_api::openapi::openapi_json))
        .with_state(state)
        .merge(ui);
    match link {
        Some(link) => app.merge(link),
        None => app,
    }
}

/// `GET /healthz`: `ok`, and for a replica its role (what a load
/// balancer or a supervisor needs). Unauthenticated, so nothing more: the
/// replica's id (a host name and pid by default) and the leader's URL are
/// for `GET /v1/cluster`, with the API key.
async fn health(State(state): State<AppState>) -> String {
    match &state.cluster {
        None => "ok".to_owned(),
        Some(cluster) => format!("ok {}", cluster.view.borrow().role.as_str()),
    }
}

/// Where the other replicas reach this one: `given`, else its own
/// listening address. Never the public URL: that is the agents' way in,
/// often a load balancer, which may hand a forwarded call to a follower
/// (that answers it `503`) or speak only HTTPS. An unspecified address
/// (`0.0.0.0`, `::`) names no host the others can dial.
fn advertise_url(given: Option<&str>, addr: SocketAddr) -> Result<String, ServerError> {
    if let Some(url) = given {
        return Ok(url.trim_end_matches('/').to_owned());
    }
    if addr.ip().is_unspecified() {
        return Err(ServerError::Failed(format!(
            "this replica listens on {addr}, which the other replicas cannot dial: give its own address with \
             --advertise-url (STANDBY_SERVER_ADVERTISE_URL), e.g. http://10.0.0.5:{}",
            addr.port()
        )));
    }
    Ok(format!("http://{addr}"))
}

/// `--inject-latency`: holds each call under `/v1/executions/` (the run
/// credential's calls) before it is handled, as a distant server would.
async fn delay_execution_calls(
    State(latency): State<Duration>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if request.uri().path().starts_with("/v1/executions/") {
        sleep_precisely(latency).await;
    }
    next.run(request).await
}

/// Sleeps `latency` to within a few tens of microseconds. tokio's timer
/// fires on the first millisecond tick after its deadline (50 ms slept
/// as 50.7–51.0 ms), so the last millisecond is slept on a blocking
/// thread, whose sleep is as precise as the kernel's timers.
async fn sleep_precisely(latency: Duration) {
    const TICK: Duration = Duration::from_millis(1);
    let until = std::time::Instant::now() + latency;
    if let Some(coarse) = latency.checked_sub(TICK) {
        tokio::time::sleep(coarse).await;
    }
    let rest = until.saturating_duration_since(std::time::Instant::now());
    if !rest.is_zero() {
        let _ = tokio::task::spawn_blocking(move || std::thread::sleep(rest)).await;
    }
}

/// A started server.
#[derive(Debug)]
pub struct RunningServer<P> {
    addr: SocketAddr,
    url: String,
    engine: EngineHandle,
    provider: Arc<P>,
    stop_serving: watch::Sender<bool>,
    fatal: watch::Receiver<Option<String>>,
    serve: JoinHandle<std::io::Result<()>>,
    engine_task: JoinHandle<()>,
    cluster: Option<Cluster>,
    leadership: Leadership,
    /// The trace exporter, when `--otlp-endpoint` is set.
    exporter: Option<standby_otlp::Exporter>,
}

/// A replica of a replicated deployment: what it is called and proves
/// itself with, and the lease of the store the replicas share.
#[derive(Debug, Clone)]
pub struct Replica {
    pub cluster: ClusterConfig,
    pub lease: Arc<dyn LeaseStore>,
}

/// Binds, restores the state from the store, and serves: the only server
/// on its store, it leads from the start.
pub async fn start<P: SandboxProvider>(
    config: ServerConfig,
    store: Arc<dyn Store>,
    provider: Arc<P>,
) -> Result<RunningServer<P>, ServerError> {
    start_with(config, store, None, provider).await
}

/// Binds and serves as `replica`: it forwards to the leader until it takes
/// the lease, then restores the state from the store and runs the engine,
/// as a restart does.
pub async fn start_replica<P: SandboxProvider>(
    config: ServerConfig,
    store: Arc<dyn Store>,
    replica: Replica,
    provider: Arc<P>,
) -> Result<RunningServer<P>, ServerError> {
    start_with(config, store, Some(replica), provider).await
}

async fn start_with<P: SandboxProvider>(
    config: ServerConfig,
    store: Arc<dyn Store>,
    replica: Option<Replica>,
    provider: Arc<P>,
) -> Result<RunningServer<P>, ServerError> {
    let listener =
        crate::listener::bind(config.listen).map_err(|source| ServerError::Bind { addr: config.listen, source })?;
    let addr = listener.local_addr().map_err(|source| ServerError::Bind { addr: config.listen, source })?;
    provider.serving(addr).await?;
    let exporter = crate::telemetry::exporter(config.otlp_endpoint.as_deref())
        .map_err(|error| ServerError::Failed(error.to_string()))?;
    let tracer = exporter.as_ref().map(|exporter| exporter.tracer().clone());
    let url = config.public_url.clone().map(|url| url.trim_end_matches('/').to_owned()).unwrap_or_else(|| {
        // Agents in containers reach the server at the provider's address
        // for it (their network's gateway), on the port bound here.
        let host = match provider.agent_host() {
            Some(host) => host.to_string(),
            None if addr.ip().is_unspecified() => "127.0.0.1".to_owned(),
            None => addr.ip().to_string(),
        };
        let host = if addr.is_ipv6() && !addr.ip().is_unspecified() { format!("[{host}]") } else { host };
        format!("http://{host}:{}", addr.port())
    });
    let (handle, mailbox) = EngineHandle::mailbox();
    let (fatal_tx, fatal) = watch::channel(None);
    let (stop_serving, stopped) = watch::channel(false);
    let listener_stats = Arc::new(ListenerStats::new(config.listener));
    let cluster = match replica {
        Some(Replica { cluster, lease }) => {
            let advertised = advertise_url(cluster.advertise_url.as_deref(), addr)?;
            let listener = Arc::clone(&listener_stats);
            Some(crate::cluster::start(cluster, advertised, lease, listener, stopped.clone()))
        }
        None => None,
    };
    let leadership = cluster.as_ref().map_or_else(Leadership::sole, |cluster| cluster.leadership.clone());
    let start = EngineStart {
        config: config.clone(),
        url: url.clone(),
        store: Arc::clone(&store),
        provider: Arc::clone(&provider),
        leadership: leadership.clone(),
        tracer: tracer.clone(),
    };
    let engine_task = match &cluster {
        None => {
            let (engine, initial) = start.engine(mailbox).await?;
            tokio::spawn(engine.run(initial, fatal_tx))
        }
        Some(cluster) => {
            tokio::spawn(lead_when_elected(start, mailbox, cluster.view.clone(), fatal_tx, stopped.clone()))
        }
    };
    let idle_timeout = config.heartbeat_interval * (crate::rules::HEARTBEAT_WINDOW + 1);
    let link = cluster.as_ref().map(|cluster| {
        let hub = crate::link::follower::Hub::new(idle_timeout, config.heartbeat_interval);
        let link = Arc::new(crate::link::Link { cluster: cluster.clone(), hub, links: Default::default() });
        tokio::spawn(crate::link::follower::run(Arc::clone(&link)));
        link
    });
    let state = AppState {
        engine: handle.clone(),
        store,
        api_key: Arc::new(TokenHash::of(config.api_key.expose())),
        spec: Arc::new(config.spec.clone()),
        idle_timeout,
        listener: Arc::clone(&listener_stats),
        containment: provider.containment(),
        cluster: cluster.clone(),
        link,
        tracer,
    };
    let mut app = router(state, config.public_url.as_deref());
    if !config.inject_latency.is_zero() {
        app = app.layer(axum::middleware::from_fn_with_state(config.inject_latency, delay_execution_calls));
    }
    if let Some(cluster) = &cluster {
        app = app.layer(axum::middleware::from_fn_with_state(cluster.clone(), crate::cluster::forward::route));
    }
    let serve = tokio::spawn(crate::listener::serve(listener, app, listener_stats, stopped));
    tracing::info!(
        %addr,
        url,
        replicated = cluster.is_some(),
        pool_size = config.pool_size,
        header_timeout = ?config.listener.header_timeout,
        max_connections = config.listener.max_connections,
        max_pending_upgrades = config.listener.max_pending_upgrades,
        "standby-server listening"
    );
    Ok(RunningServer {
        addr,
        url,
        engine: handle,
        provider,
        stop_serving,
        fatal,
        serve,
        engine_task,
        cluster,
        leadership,
        exporter,
    })
}

/// How a server ended: the way out of `serve` and its exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Asked to stop (`SIGTERM`, `SIGINT`): it shuts down in order.
    Signal(&'static str),
    /// It failed on its own (a store failure): it shuts down, exit code 1.
    Failed(String),
    /// It led and may no longer: it exits at once, without telling or
    /// stopping anything (exit code 3; restarted, it comes back as a
    /// follower).
    Deposed(String),
}

impl Ending {
    /// The process's exit code.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Signal(_) => 0,
            Self::Failed(_) => 1,
            Self::Deposed(_) => crate::cluster::DEPOSED_EXIT_CODE,
        }
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Signal(signal) => write!(f, "stopped by {signal}"),
            Self::Failed(message) => write!(f, "the server failed: {message}"),
            Self::Deposed(why) => write!(f, "deposed: this replica leads no longer: {why}"),
        }
    }
}

impl std::error::Error for Ending {}

/// What starting the engine needs.
struct EngineStart<P> {
    config: ServerConfig,
    url: String,
    store: Arc<dyn Store>,
    provider: Arc<P>,
    leadership: Leadership,
    tracer: Option<standby_otlp::Tracer>,
}

impl<P: SandboxProvider> EngineStart<P> {
    /// Loads the store, adopts the sandboxes it knows and restores the
    /// machine: the engine and its first step.
    async fn engine(self, mailbox: Mailbox) -> Result<(Engine<P>, crate::rules::Step), ServerError> {
        let Self { config, url, store, provider, leadership, tracer } = self;
        let loader = Arc::clone(&store);
        let snapshot = tokio::task::spawn_blocking(move || loader.load())
            .await
            .map_err(|join| ServerError::Failed(format!("loading the store panicked: {join}")))??;
        let known = snapshot
            .sandboxes
            .iter()
            .filter(|record| record.state != crate::model::SandboxState::Retired)
            .map(|record| record.id.clone())
            .collect();
        provider.adopt(known).await;
        restore_auto_stops(provider.as_ref(), &snapshot.sandboxes).await;
        let rules_config = RulesConfig {
            heartbeat_interval: config.heartbeat_interval,
            pool_size: config.pool_size,
            max_attempts: config.max_attempts,
            launch_timeout: config.launch_timeout,
            run_silence: config.run_silence,
            linger: config.linger,
            pool_workspace: config.spec.workspace.clone(),
            pool_fingerprint: fingerprint(&config.spec.workspace),
            pool_policy: config.pool_policy.clone(),
            bounds: config.bounds,
            snapshots: provider.snapshots(),
            trace: tracer.is_some(),
        };
        let clock = Clock::system();
        let (machine, initial) = Rules::restore(rules_config, Box::new(RandomMint), snapshot, clock.now());
        let engine_config = EngineConfig {
            server_url: url,
            heartbeat_interval: config.heartbeat_interval,
            agent_log: config.agent_log.clone(),
            tick: (config.heartbeat_interval / 2).clamp(Duration::from_millis(50), Duration::from_secs(1)),
            resume_timeout: config.pool_policy.resume_timeout,
            clock,
            leadership,
            agent_otlp_endpoint: tracer.as_ref().and(config.otlp_endpoint.clone()),
            tracer,
        };
        Ok((Engine::new(mailbox, machine, store, provider, engine_config), initial))
    }
}

/// A replica's engine: started once it leads (the calls queued meanwhile
/// are then handled), never if it shuts down first.
async fn lead_when_elected<P: SandboxProvider>(
    start: EngineStart<P>,
    mailbox: Mailbox,
    mut view: watch::Receiver<ClusterView>,
    fatal: watch::Sender<Option<String>>,
    mut stopped: watch::Receiver<bool>,
) {
    tokio::select! {
        elected = view.wait_for(|view| view.role == Role::Leader) => {
            if elected.is_err() {
                return;
            }
        }
        _ = stopped.wait_for(|stop| *stop) => return,
    }
    tracing::info!("leading: loading the state from the store");
    match start.engine(mailbox).await {
        Ok((engine, initial)) => engine.run(initial, fatal).await,
        Err(error) => {
            let _ = fatal.send(Some(error.to_string()));
        }
    }
}

impl<P: SandboxProvider> RunningServer<P> {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL (agents' `STANDBY_SERVER_URL`, the API's base).
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    /// Resolves when the server ends on its own: its engine stopped (a
    /// store failure), or this replica was deposed (it led and may no
    /// longer). Never otherwise.
    pub async fn ended(&mut self) -> Ending {
        let leadership = self.leadership.clone();
        tokio::select! {
            stopped = self.fatal.wait_for(Option::is_some) => {
                let message = match stopped {
                    Ok(message) => message.clone().unwrap_or_default(),
                    Err(_) => return std::future::pending().await,
                };
                match leadership.deposition() {
                    Some(why) => Ending::Deposed(why),
                    None => Ending::Failed(message),
                }
            }
            why = leadership.deposed() => Ending::Deposed(why),
        }
    }

    /// Whether this server is a replica of a replicated deployment.
    pub fn replicated(&self) -> bool {
        self.cluster.is_some()
    }

    /// Stops dispatching, stops every sandbox (a running run is asked to
    /// stop and may still report), then stops serving.
    ///
    /// A replica stops no sandbox: they are the cluster's, and the next
    /// leader adopts them from the store.
    pub async fn shutdown(self) -> Result<(), ServerError> {
        if self.cluster.is_none() {
            tracing::info!("shutting down: stopping sandboxes");
            let _ = self.engine.ask::<()>(Input::Drain).await;
            self.provider.stop_all().await;
        } else {
            tracing::info!("shutting down a replica: its sandboxes stay for the next leader");
        }
        let _ = self.stop_serving.send(true);
        self.engine.stop().await;
        let _ = self.engine_task.await;
        if let Some(exporter) = self.exporter {
            let dropped = exporter.shutdown().await;
            tracing::info!(dropped, "trace exporter stopped (spans dropped in all)");
        }
        match tokio::time::timeout(Duration::from_secs(5), self.serve).await {
            Ok(Ok(Ok(()))) | Err(_) => {}
            Ok(Ok(Err(error))) => return Err(ServerError::Failed(format!("serving failed: {error}"))),
            Ok(Err(join)) => return Err(ServerError::Failed(format!("the HTTP task failed: {join}"))),
        }
        let failure = self.fatal.borrow().clone();
        match failure {
            Some(message) => Err(ServerError::Failed(message)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{advertise_url, auto_stop_to_restore, sleep_precisely};

    /// The injected latency is never shorter than asked, whatever part of
    /// it tokio's timer sleeps (how much longer is the benchmark's to tell).
    #[tokio::test]
    async fn an_injected_latency_is_never_cut_short() {
        for latency in [Duration::ZERO, Duration::from_micros(300), Duration::from_millis(1), Duration::from_millis(7)]
        {
            let start = Instant::now();
            sleep_precisely(latency).await;
            assert!(start.elapsed() >= latency, "{latency:?} slept as {:?}", start.elapsed());
        }
    }

    #[test]
    fn a_replica_advertises_its_own_address_unless_told_and_an_unspecified_one_is_refused() {
        let v4 = "127.0.0.1:8080".parse().expect("an address");
        assert_eq!(advertise_url(None, v4).ok().as_deref(), Some("http://127.0.0.1:8080"));
        let v6 = "[::1]:8080".parse().expect("an address");
        assert_eq!(advertise_url(None, v6).ok().as_deref(), Some("http://[::1]:8080"));
        let given = advertise_url(Some("http://10.0.0.5:8080/"), "0.0.0.0:8080".parse().expect("an address"));
        assert_eq!(given.ok().as_deref(), Some("http://10.0.0.5:8080"));
        for any in ["0.0.0.0:8080", "[::]:8080"] {
            let refused = advertise_url(None, any.parse().expect("an address")).expect_err(any).to_string();
            assert!(refused.contains("--advertise-url"), "{refused}");
        }
    }

    #[test]
    fn a_restart_gives_back_the_recorded_auto_stop_only_where_the_provider_lost_it() {
        assert_eq!(auto_stop_to_restore(Some(9), None), Some(9), "lost (kept in memory): the record's");
        assert_eq!(auto_stop_to_restore(Some(9), Some(12)), None, "kept (a resume's raise): left as it is");
        assert_eq!(auto_stop_to_restore(Some(9), Some(0)), None);
        assert_eq!(auto_stop_to_restore(None, None), None, "never recorded: nothing to give back");
    }
}
