//! The Docker provider's end-to-end tests' side of the engine: whether one
//! answers, the sandbox image (built by `scripts/build-image` with the
//! `standby` under test), and a guard that removes a test's containers and
//! network however the test ends, and the tests' server on the Docker
//! provider ([`Server`]). The tests look at containers through the
//! `docker` CLI, as an operator would; the server itself never uses it.
//!
//! Under `CI=true` a missing engine or an image that cannot be built fails
//! the test; elsewhere the test is skipped, loudly.

use std::hash::{BuildHasher, RandomState};
use std::ops::Deref;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::Signal;

use crate::harness::{standby_bin, write_json};
use crate::provider_runs::{QUICK, counting_spec};
pub use crate::provider_runs::{WAIT, sandbox_of};
use crate::server_process::{ServerBuilder, ServerProcess, free_fixed_port};

/// The image the tests build and run, unless `STANDBY_E2E_IMAGE` names
/// another ([`image`]).
pub const IMAGE: &str = "standby-sandbox:e2e";

/// The image the tests build and run: `STANDBY_E2E_IMAGE`, else [`IMAGE`].
/// Worktrees sharing one engine each set their own, so that one's build
/// never replaces the agent in the image another's test is running.
pub fn image() -> String {
    std::env::var("STANDBY_E2E_IMAGE").ok().filter(|tag| !tag.is_empty()).unwrap_or_else(|| IMAGE.to_owned())
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|value| value == "true")
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_owned()
}

/// `docker ARGS`: its stdout when it succeeded.
pub fn docker(args: &[&str]) -> Option<String> {
    let output = Command::new("docker").args(args).output().ok()?;
    output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Whether the engine answers and the image (re)built with the `standby`
/// under test; `false` (with a loud line) when the test is to be skipped.
/// Panics under `CI=true` instead of skipping.
pub fn available(test: &str) -> bool {
    let skip = |why: String| {
        assert!(!in_ci(), "{test}: {why} (CI=true: the Docker tests must run)");
        eprintln!("*** {test}: SKIPPED: {why} ***");
        false
    };
    if docker(&["version", "--format", "{{.Server.Version}}"]).is_none() {
        return skip("no Docker Engine answers (`docker version`)".into());
    }
    // One build at a time (tests run in parallel); docker's cache makes a
    // build of an unchanged binary quick.
    let root = repo_root();
    std::fs::create_dir_all(root.join("target/image")).ok();
    let output = Command::new("flock")
        .arg(root.join("target/image/.lock"))
        .arg(root.join("scripts/build-image"))
        .arg(image())
        .env("IMAGE_AGENT_BIN", standby_bin())
        .output();
    match output {
        Ok(output) if output.status.success() => true,
        Ok(output) => skip(format!(
            "scripts/build-image failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )),
        Err(error) => skip(format!("cannot run scripts/build-image: {error}")),
    }
}

/// gVisor's runtime as the Engine knows it (`.ci/run` registers it).
pub const GVISOR: &str = "runsc";

/// [`available`], and the Engine has gVisor's runtime ([`GVISOR`]):
/// `false` (with a loud line) when the test is to be skipped; under
/// `CI=true` a missing runtime fails the test.
pub fn gvisor_available(test: &str) -> bool {
    if !available(test) {
        return false;
    }
    let runtimes = docker(&["info", "--format", "{{json .Runtimes}}"]).unwrap_or_default();
    if runtimes.contains(&format!("\"{GVISOR}\"")) {
        return true;
    }
    let why = format!("the Docker Engine has no runtime `{GVISOR}` (its runtimes: {runtimes})");
    assert!(!in_ci(), "{test}: {why} (CI=true: .ci/run installs gVisor and registers it)");
    eprintln!("*** {test}: SKIPPED: {why} ***");
    false
}

/// Removes the containers and archive images of a server instance and a
/// network when dropped,
/// whether the test passed or panicked.
#[derive(Debug)]
pub struct Cleanup {
    pub data: PathBuf,
    pub network: String,
}

impl Cleanup {
    /// The instance id the server wrote in its data directory.
    pub fn instance(&self) -> String {
        std::fs::read_to_string(self.data.join("instance-id")).unwrap_or_default().trim().to_owned()
    }

    /// Ids of the containers labelled with the server's instance.
    pub fn containers(&self) -> Vec<String> {
        let filter = format!("label=standby.instance={}", self.instance());
        docker(&["ps", "-aq", "--filter", &filter]).unwrap_or_default().lines().map(str::to_owned).collect()
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.instance().is_empty() {
            for id in self.containers() {
                let _ = docker(&["rm", "-f", &id]);
            }
            // Archived sandboxes' images.
            let filter = format!("label=standby.instance={}", self.instance());
            for id in docker(&["images", "-q", "--filter", &filter]).unwrap_or_default().lines() {
                let _ = docker(&["rmi", "-f", id]);
            }
        }
        // Containers a test made itself (labelled with its network's name).
        let filter = format!("label=standby.e2e={}", self.network);
        for id in docker(&["ps", "-aq", "--filter", &filter]).unwrap_or_default().lines() {
            let _ = docker(&["rm", "-f", id]);
        }
        // The firewall a killed server left on the network (a clean stop
        // removes it), then the network.
        let bridge = bridge(&self.network);
        let _ = docker(&["network", "rm", &self.network]);
        if let Some(bridge) = bridge {
            remove_firewall(&bridge);
        }
    }
}

/// The host's interface of a network's bridge: `br-` and the first 12
/// characters of its id.
pub fn bridge(network: &str) -> Option<String> {
    let id = docker(&["network", "inspect", "--format", "{{.Id}}", network])?;
    Some(format!("br-{}", id.get(..12)?))
}

/// The `iptables -S` (or `ip6tables -S`) lines that name `bridge`.
pub fn firewall_rules(program: &str, bridge: &str) -> Vec<String> {
    let output = Command::new(program).args(["-w", "-S"]).output().map(|output| output.stdout).unwrap_or_default();
    String::from_utf8_lossy(&output).lines().filter(|line| line.contains(bridge)).map(str::to_owned).collect()
}

/// Removes the server's chains of `bridge` and the jumps to them, as a
/// clean stop does (docs/deploy.md, "Isolation").
pub fn remove_firewall(bridge: &str) {
    for program in ["iptables", "ip6tables"] {
        let rules = firewall_rules(program, bridge);
        for jump in rules.iter().filter(|line| line.starts_with("-A ") && line.contains(" -j STANDBY-")) {
            let words: Vec<&str> = jump.split_whitespace().skip(1).collect();
            let _ = Command::new(program).args(["-w", "-D"]).args(&words).output();
        }
        for chain in rules.iter().filter_map(|line| line.strip_prefix("-N ")) {
            let _ = Command::new(program).args(["-w", "-F", chain]).output();
            let _ = Command::new(program).args(["-w", "-X", chain]).output();
        }
    }
}

/// `docker inspect --format FORMAT standby-<sandbox id>`.
pub fn inspect(sandbox_id: &str, format: &str) -> Option<String> {
    docker(&["inspect", "--format", format, &format!("standby-{sandbox_id}")])
}

/// A test image that keeps what each agent start was given on its standard
/// input (the standby credential) in `/tmp/spy/<nanoseconds>`, so that a
/// test can present an earlier start's credential. Built on [`IMAGE`]; its
/// `standby` is a wrapper that copies stdin to a file and runs the real
/// agent on that file (`hold`, the container's PID 1, is passed through).
/// Never for anything but a test: it writes credentials to disk.
pub const SPY_IMAGE: &str = "standby-sandbox:e2e-spy";

const SPY_WRAPPER: &str = r#"#!/bin/sh
if [ "$1" = hold ]; then exec /usr/local/bin/standby.real "$@"; fi
mkdir -p /tmp/spy
copy=/tmp/spy/$(date +%s%N)
cat > "$copy"
exec /usr/local/bin/standby.real "$@" < "$copy"
"#;

const SPY_DOCKERFILE: &str = "ARG BASE
FROM $BASE
USER 0
RUN mv /usr/local/bin/standby /usr/local/bin/standby.real
COPY standby-spy /usr/local/bin/standby
USER 10001:10001
";

/// [`available`], then [`SPY_IMAGE`] built on the fresh [`image`].
pub fn spy_available(test: &str) -> bool {
    if !available(test) {
        return false;
    }
    let context = tempfile::Builder::new().prefix("standby-spy-image-").tempdir().expect("a temp dir");
    let wrapper = context.path().join("standby-spy");
    std::fs::write(&wrapper, SPY_WRAPPER).expect("write the wrapper");
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("make the wrapper executable");
    std::fs::write(context.path().join("Dockerfile"), SPY_DOCKERFILE).expect("write the Dockerfile");
    // Under the lock: the build, then the removal of the image the tag
    // named before (left untagged by the build; every test run makes one).
    // One a running container still uses stays, for a later build to take.
    let script = r#"previous=$(docker image inspect --format '{{.Id}}' "$2" 2>/dev/null || true)
docker build -q --build-arg "BASE=$1" -t "$2" "$3" || exit 1
current=$(docker image inspect --format '{{.Id}}' "$2")
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then docker rmi "$previous" >/dev/null 2>&1 || true; fi"#;
    let lock = repo_root().join("target/image/.lock");
    let output = Command::new("flock")
        .arg(lock)
        .args(["sh", "-c", script, "spy-build", &image(), SPY_IMAGE])
        .arg(context.path())
        .output()
        .expect("run docker build");
    assert!(
        output.status.success(),
        "{test}: cannot build {SPY_IMAGE}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    true
}

/// What each agent start in the sandbox's container was given on its
/// standard input, oldest first (see [`SPY_IMAGE`]).
pub fn spied_credentials(sandbox_id: &str) -> Vec<String> {
    let container = format!("standby-{sandbox_id}");
    let script = "for f in $(ls /tmp/spy | sort -n); do cat /tmp/spy/$f; echo; done";
    docker(&["exec", &container, "sh", "-c", script])
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A server on the Docker provider, with what removes its containers: the
/// tests' server (its data directory and network in `dir`, its own).
#[derive(Debug)]
pub struct Server {
    pub process: Option<ServerProcess>,
    pub builder: ServerBuilder,
    pub cleanup: Cleanup,
    pub dir: tempfile::TempDir,
}

impl Deref for Server {
    type Target = ServerProcess;

    fn deref(&self) -> &ServerProcess {
        self.process.as_ref().expect("the server runs")
    }
}

impl Server {
    /// `None` when the test is skipped (no engine, outside CI).
    pub async fn start(test: &str, args: &[&str]) -> Option<Self> {
        if !available(test) {
            return None;
        }
        Some(Self::start_on(&image(), args).await)
    }

    /// A server whose sandboxes are containers of `image`, built already.
    pub async fn start_on(image: &str, args: &[&str]) -> Self {
        Self::start_with_spec(image, &counting_spec(), args).await
    }

    /// A server whose sandboxes are containers of `image` preparing `spec`.
    /// Prepared snapshots are off unless `args` set `--snapshot-keep`: the
    /// suites' servers share one image and one spec, and a snapshot of one
    /// would be another's.
    pub async fn start_with_spec(image: &str, spec: &serde_json::Value, args: &[&str]) -> Self {
        let dir = tempfile::Builder::new().prefix("standby-docker-e2e-").tempdir().expect("a temp dir");
        let spec_path = dir.path().join("spec.json");
        write_json(&spec_path, spec);
        let tag = format!("{:012x}", RandomState::new().hash_one((std::process::id(), dir.path())) >> 16);
        let network = format!("standby-e2e-{tag}");
        let data = dir.path().join("data");
        let cleanup = Cleanup { data: data.clone(), network: network.clone() };
        // Containers reach the server at the network's gateway: it listens
        // on every address, on a port kept across a restart.
        let listen = std::net::SocketAddr::from(([0, 0, 0, 0], free_fixed_port()));
        let builder = ServerBuilder::new(&data, &dir.path().join("server.log"), &tag).listen(listen).args(&[
            "--provider",
            "docker",
            "--image",
            image,
            "--docker-network",
            &network,
            "--log",
            "debug,bollard=info",
            "--agent-log",
            "debug",
            "--spec",
            &spec_path.display().to_string(),
        ]);
        let defaults: Vec<(&str, &str)> = QUICK.iter().copied().chain([("--snapshot-keep", "0")]).collect();
        let builder = builder.args_over_defaults(&defaults, args);
        let process = builder.start().await;
        Self { process: Some(process), builder, cleanup, dir }
    }

    pub async fn until<T>(&self, what: &str, check: impl AsyncFnMut() -> Option<T>) -> T {
        self.process.as_ref().expect("the server runs").until(what, WAIT, check).await
    }

    pub async fn stop(mut self) {
        if let Some(process) = self.process.take() {
            let status = process.stop(Signal::SIGTERM).await;
            assert!(status.success(), "standby-server exited {status}");
        }
    }
}
