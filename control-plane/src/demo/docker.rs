//! `standby-server demo --provider docker`: the demo on containers. The
//! sandbox image is built when the engine lacks it (`scripts/build-image`:
//! a debootstrap base needs root and a few minutes, once), the sample
//! repository is served to the containers over git's plain HTTP protocol
//! from the network's gateway (containers see no host path), and the demo
//! shows the warm and cold paths, then a thread's Tier 2 and Tier 1
//! follow-ups. Everything it made is removed at the end: the containers
//! of its instance, and the network when it created it.

use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bollard::Docker;
use bollard::query_parameters::{ListContainersOptions, ListNetworksOptions, RemoveContainerOptions};
use standby_control_plane::provider::docker::snapshot::Retention;
use standby_control_plane::provider::docker::{
    Allow, DockerOptions, DockerProvider, Egress, INSTANCE_LABEL, Limits, OnStop, remove_network,
};
use tokio::sync::oneshot;

use super::sample::git;
use super::threads::{DEMO_WARM_IDLE, Threads, drive_threads, park_threads};
use super::{DemoError, DemoOptions, DemoRow, Scene, Serve, drive, io, with_server};

/// The follow-ups shown on containers (cold is the first part's).
const PATHS: [&str; 2] = ["parked_running", "parked_stopped"];

pub(super) async fn run(
    options: &DemoOptions,
    image: &str,
    network: &str,
    out: &mut impl Write,
) -> Result<Vec<DemoRow>, DemoError> {
    let engine = Docker::connect_with_unix_defaults()
        .map_err(|source| DemoError::DockerApi { action: "connect at its unix socket".into(), source })?;
    ensure_image(&engine, image, &options.agent_bin, out).await?;
    let network_existed = network_exists(&engine, network).await?;
    let mut scene = Scene::new(options)?;
    let instance = format!("demo-{:016x}", rand::random::<u64>());
    let result = demo(options, &mut scene, image, network, &instance, out).await;
    clean_up(&engine, &instance, network, network_existed).await;
    result
}

async fn demo(
    options: &DemoOptions,
    scene: &mut Scene,
    image: &str,
    network: &str,
    instance: &str,
    out: &mut impl Write,
) -> Result<Vec<DemoRow>, DemoError> {
    let options_for_docker = DockerOptions {
        image: image.to_owned(),
        network: network.to_owned(),
        instance: instance.to_owned(),
        limits: Limits::default(),
        log_dir: scene.logs.clone(),
        minute: Duration::from_secs(60),
        auto_archive: 0,
        auto_delete: 0,
        stop_grace: Duration::from_secs(5),
        // The demo removes what it made itself, whatever way it ends.
        on_stop: OnStop::Keep,
        egress: Egress::Public,
        egress_allow: Vec::new(),
        runtime: None,
        // The demo leaves no image behind: every sandbox starts from the
        // image, and its cold run shows the path from nothing.
        snapshots: Retention { keep: 0, max_age: Duration::ZERO },
    };
    let gateway = IpAddr::V4(DockerProvider::connect(options_for_docker.clone()).await?.gateway());
    let repo = RepoServer::start(scene, gateway).await?;
    // The sandboxes reach the host only at the server's port and what the
    // allow list opens: the repository, served on the host.
    let mut options_for_docker = options_for_docker;
    let IpAddr::V4(gateway_v4) = gateway else { unreachable!("the gateway is IPv4") };
    options_for_docker.egress_allow.push(Allow { net: gateway_v4.into(), port: Some(repo.port) });
    let provider = Arc::new(DockerProvider::connect(options_for_docker.clone()).await?);
    let wrote = |e: std::io::Error| DemoError::Io { action: "write", path: "stdout".into(), source: e };
    writeln!(
        out,
        "standby demo on Docker: image {image}, network {network} (gateway {gateway}), repository at {}",
        repo.url
    )
    .map_err(wrote)?;
    let listen = Some(SocketAddr::new(gateway, 0));
    let serve = Serve { pool_size: options.pool_size, heartbeat: Duration::from_millis(500), listen };
    let rows = with_server(
        scene,
        Arc::clone(&provider),
        serve,
        |_| {},
        async |server, key| drive(options, server, key, &scene.logs, scene.sample, out).await,
    )
    .await?;
    writeln!(
        out,
        "\nfollow-up turns on containers: a thread's container kept running for {} (Tier 2), then stopped (Tier 1)",
        humantime::format_duration(DEMO_WARM_IDLE)
    )
    .map_err(wrote)?;
    // A provider is one server's: its clean stop closes it to new
    // containers. The second server gets its own, on the same containers.
    drop(provider);
    let provider = Arc::new(DockerProvider::connect(options_for_docker).await?);
    let serve = Serve { pool_size: 0, heartbeat: Duration::from_millis(250), listen };
    with_server(scene, provider, serve, park_threads, async |server, key| {
        let threads = Threads { title: "follow-up turns of a thread", rounds: 1, paths: &PATHS };
        drive_threads(options, threads, server, key, &scene.logs, out).await
    })
    .await?;
    repo.stop();
    Ok(rows)
}

/// Builds `image` with `scripts/build-image` when the engine lacks it.
async fn ensure_image(engine: &Docker, image: &str, agent_bin: &Path, out: &mut impl Write) -> Result<(), DemoError> {
    if engine.inspect_image(image).await.is_ok() {
        return Ok(());
    }
    let no_image = |why: String| DemoError::NoImage { image: image.to_owned(), why };
    let script = build_script().ok_or_else(|| no_image("scripts/build-image is not found near here".into()))?;
    let _ = writeln!(
        out,
        "building the sandbox image {image} with {} (a debootstrap base the first time: a few minutes)",
        script.display()
    );
    let status = tokio::process::Command::new(&script)
        .arg(image)
        .env("IMAGE_AGENT_BIN", agent_bin)
        .kill_on_drop(true)
        .status()
        .await
        .map_err(|e| no_image(format!("cannot run {}: {e}", script.display())))?;
    if !status.success() {
        return Err(no_image(format!("{} failed ({status})", script.display())));
    }
    Ok(())
}

/// `scripts/build-image` of the repository this binary was built in
/// (`target/<profile>/standby-server`) or of the current directory.
fn build_script() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok();
    let cwd = std::env::current_dir().ok();
    exe.iter()
        .flat_map(|exe| exe.ancestors().skip(1).take(4))
        .chain(cwd.iter().map(PathBuf::as_path))
        .map(|dir| dir.join("scripts/build-image"))
        .find(|script| script.is_file())
}

async fn network_exists(engine: &Docker, network: &str) -> Result<bool, DemoError> {
    let options =
        ListNetworksOptions { filters: Some(HashMap::from([("name".to_owned(), vec![format!("^{network}$")])])) };
    let networks = engine
        .list_networks(Some(options))
        .await
        .map_err(|source| DemoError::DockerApi { action: format!("list the network `{network}`"), source })?;
    Ok(!networks.is_empty())
}

/// Removes the containers of the demo's instance, and the network when the
/// demo created it. Best effort: the demo's outcome is already decided.
async fn clean_up(engine: &Docker, instance: &str, network: &str, network_existed: bool) {
    let label = format!("{INSTANCE_LABEL}={instance}");
    let options = ListContainersOptions {
        all: true,
        filters: Some(HashMap::from([("label".to_owned(), vec![label])])),
        ..Default::default()
    };
    for container in engine.list_containers(Some(options)).await.unwrap_or_default() {
        let Some(id) = container.id else { continue };
        let remove = RemoveContainerOptions { force: true, ..Default::default() };
        if let Err(error) = engine.remove_container(&id, Some(remove)).await {
            tracing::warn!(container = id, %error, "the demo could not remove its container");
        }
    }
    if !network_existed && let Err(error) = remove_network(engine, network).await {
        tracing::warn!(network, %error, "the demo could not remove its network");
    }
}

/// The sample repository served over git's "dumb" HTTP protocol (static
/// files of a bare clone) on the sandbox network's gateway.
struct RepoServer {
    url: String,
    port: u16,
    stop: oneshot::Sender<()>,
}

impl RepoServer {
    async fn start(scene: &mut Scene, gateway: IpAddr) -> Result<Self, DemoError> {
        let sample = scene.dir.path().join("sample-repo");
        let root = scene.dir.path().join("served");
        std::fs::create_dir_all(&root).map_err(io("create", &root))?;
        let bare = root.join("sample.git");
        let (sample_arg, bare_arg) = (sample.display().to_string(), bare.display().to_string());
        git(scene.dir.path(), &["clone", "--quiet", "--bare", &sample_arg, &bare_arg])?;
        git(&bare, &["update-server-info"])?;
        let listener = tokio::net::TcpListener::bind(SocketAddr::new(gateway, 0))
            .await
            .map_err(io("listen on the network's gateway for", &bare))?;
        let addr = listener.local_addr().map_err(io("read the address of the listener for", &bare))?;
        let app = axum::Router::new().fallback(serve_file).with_state(Arc::new(root));
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            if let Err(error) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
                tracing::warn!(%error, "the demo's repository server stopped");
            }
        });
        let url = format!("http://{addr}/sample.git");
        for repo in &mut scene.spec.workspace.repos {
            repo.url.clone_from(&url);
        }
        Ok(Self { url, port: addr.port(), stop })
    }

    fn stop(self) {
        let _ = self.stop.send(());
    }
}

/// A file under the served root, or 404; no path leaves the root.
async fn serve_file(State(root): State<Arc<PathBuf>>, uri: Uri) -> Response {
    let relative = Path::new(uri.path().trim_start_matches('/'));
    if !relative.components().all(|part| matches!(part, Component::Normal(_))) {
        return StatusCode::NOT_FOUND.into_response();
    }
    match tokio::fs::read(root.join(relative)).await {
        Ok(bytes) => bytes.into_response(),
        Err(_) => StatusCode::NOT_FOUND.into_response(),
    }
}
