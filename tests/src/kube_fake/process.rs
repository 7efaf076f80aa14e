//! From a pod's container to host processes: the command (through the
//! images' entrypoints and the binaries map), the environment and working
//! directory with mount paths mapped to host paths, and the `unshare` and
//! `nsenter` command lines that put a container, and an exec, in the pod's
//! own PID namespace.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::Value;

use super::FakeOptions;
use super::objects::pvc_dir;

/// The PATH a container gets unless its env sets one (the usual image PATH).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Why a container cannot start, in the kubelet's words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The pod stays Pending with this container waiting reason.
    #[error("{reason}: {message}")]
    Waiting { reason: &'static str, message: String },
    /// The pod is not scheduled (a PVC missing or not bound).
    #[error("{0}")]
    Unschedulable(String),
    /// The pod fails.
    #[error("{0}")]
    Failed(String),
}

/// How a container runs on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub container: String,
    pub image: String,
    /// argv[0] already a host path.
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Host working directory.
    pub cwd: PathBuf,
    /// mountPath → host directory.
    pub mounts: Vec<(String, PathBuf)>,
}

/// Rewrites `value` if it is a mount path or below one (longest mount wins).
pub fn map_path(value: &str, mounts: &[(String, PathBuf)]) -> String {
    let best = mounts
        .iter()
        .filter(|(m, _)| value == m || value.starts_with(&format!("{}/", m.trim_end_matches('/'))))
        .max_by_key(|(m, _)| m.len());
    match best {
        Some((m, host)) => format!("{}{}", host.display(), &value[m.trim_end_matches('/').len()..]),
        None => value.to_owned(),
    }
}

/// argv[0] as a host path: an absolute path through the binaries map, a
/// bare name looked up in the container's PATH inside that map.
pub fn map_binary(argv0: &str, path: &str, binaries: &HashMap<String, PathBuf>) -> Option<PathBuf> {
    if argv0.starts_with('/') {
        return binaries.get(argv0).cloned();
    }
    path.split(':').find_map(|dir| binaries.get(&format!("{}/{argv0}", dir.trim_end_matches('/'))).cloned())
}

fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
}

/// Plans the one container of `pod`. The image matters only for its
/// entrypoint: a container with a `command` runs whatever its image. `claim_bound(name)` says whether a PVC
/// of the pod's namespace exists and is Bound.
pub fn plan(
    pod: &Value,
    options: &FakeOptions,
    root: &Path,
    claim_bound: &dyn Fn(&str) -> bool,
) -> Result<Plan, PlanError> {
    let namespace = pod.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("");
    let name = pod.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("");
    let uid = pod.pointer("/metadata/uid").and_then(Value::as_str).unwrap_or("");
    let mut volumes: HashMap<String, PathBuf> = HashMap::new();
    for v in pod.pointer("/spec/volumes").and_then(Value::as_array).into_iter().flatten() {
        let vname = v.get("name").and_then(Value::as_str).unwrap_or("").to_owned();
        if let Some(claim) = v.pointer("/persistentVolumeClaim/claimName").and_then(Value::as_str) {
            if !claim_bound(claim) {
                return Err(PlanError::Unschedulable(format!("persistentvolumeclaim \"{claim}\" not found")));
            }
            volumes.insert(vname, pvc_dir(root, namespace, claim));
        } else if v.get("emptyDir").is_some() {
            volumes.insert(vname.clone(), root.join("emptydirs").join(uid).join(&vname));
        } else if let Some(host) = v.pointer("/hostPath/path").and_then(Value::as_str) {
            volumes.insert(vname, PathBuf::from(host));
        }
    }
    let containers = pod.pointer("/spec/containers").and_then(Value::as_array).cloned().unwrap_or_default();
    let [container] = containers.as_slice() else {
        return Err(PlanError::Failed(format!(
            "the fake kubelet runs exactly one container per pod; pod {name} has {}",
            containers.len()
        )));
    };
    if !nix::unistd::geteuid().is_root() {
        return Err(PlanError::Failed(
            "the fake kubelet needs root to run a container in its own PID namespace (unshare --pid)".into(),
        ));
    }
    let cname = container.get("name").and_then(Value::as_str).unwrap_or("").to_owned();
    let image = container.get("image").and_then(Value::as_str).unwrap_or("").to_owned();
    let mut mounts = Vec::new();
    for m in container.get("volumeMounts").and_then(Value::as_array).into_iter().flatten() {
        let vname = m.get("name").and_then(Value::as_str).unwrap_or("");
        let path = m.get("mountPath").and_then(Value::as_str).unwrap_or("");
        if let Some(host) = volumes.get(vname) {
            let host = match m.get("subPath").and_then(Value::as_str) {
                Some(sub) if !sub.is_empty() => host.join(sub),
                _ => host.clone(),
            };
            mounts.push((path.to_owned(), host));
        }
    }
    let mut env = Vec::new();
    for e in container.get("env").and_then(Value::as_array).into_iter().flatten() {
        let key = e.get("name").and_then(Value::as_str).unwrap_or("").to_owned();
        if e.get("valueFrom").is_some() {
            return Err(PlanError::Waiting {
                reason: "CreateContainerConfigError",
                message: format!("env {key}: valueFrom is refused by the fake kubelet"),
            });
        }
        let value = e.get("value").and_then(Value::as_str).unwrap_or("");
        env.push((key, map_path(value, &mounts)));
    }
    if !env.iter().any(|(k, _)| k == "PATH") {
        env.push(("PATH".into(), DEFAULT_PATH.into()));
    }
    if !env.iter().any(|(k, _)| k == "HOSTNAME") {
        env.push(("HOSTNAME".into(), name.into()));
    }
    let mut argv = strings(container.get("command"));
    if argv.is_empty() {
        match options.images.get(&image) {
            Some(entrypoint) => argv = entrypoint.clone(),
            None => {
                return Err(PlanError::Waiting {
                    reason: "ErrImagePull",
                    message: format!("image {image:?} is not known to the fake cluster"),
                });
            }
        }
    }
    argv.extend(strings(container.get("args")));
    for arg in argv.iter_mut().skip(1) {
        *arg = map_path(arg, &mounts);
    }
    let path = env.iter().find(|(k, _)| k == "PATH").map(|(_, v)| v.clone()).unwrap_or_default();
    let argv0 = argv.first().cloned().unwrap_or_default();
    let Some(host) = map_binary(&argv0, &path, &options.binaries) else {
        return Err(PlanError::Waiting {
            reason: "CreateContainerError",
            message: format!("exec: {argv0:?}: executable file not found in the fake cluster's binaries"),
        });
    };
    argv[0] = host.display().to_string();
    let cwd = container.get("workingDir").and_then(Value::as_str).filter(|w| !w.is_empty()).unwrap_or("/");
    let cwd = PathBuf::from(map_path(cwd, &mounts));
    for (_, host) in &mounts {
        std::fs::create_dir_all(host)
            .map_err(|e| PlanError::Failed(format!("make the volume directory {}: {e}", host.display())))?;
    }
    Ok(Plan { container: cname, image, argv, env, cwd, mounts })
}

/// A util-linux tool of the host, by absolute path: the child's PATH is the
/// container's, which may not lead to it.
fn host_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    std::env::split_paths(&path)
        .chain(std::env::split_paths(DEFAULT_PATH))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

/// The container's command line: a session of its own (`setsid`: no
/// controlling terminal, one process group to signal as a whole), its own
/// PID namespace (PID 1 is the container's first process, `/proc` its own;
/// `unshare --kill-child` kills it if `unshare` dies).
pub fn container_command(plan: &Plan, log: &Path) -> std::io::Result<tokio::process::Command> {
    let out = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    let err = out.try_clone()?;
    // `setsid` execs in place (it forks only when already a group leader,
    // which a fresh child is not), so the child's pid is the session's.
    let mut cmd = tokio::process::Command::new(host_tool("setsid"));
    cmd.arg(host_tool("unshare"))
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
        .args(&plan.argv)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&plan.cwd)
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .kill_on_drop(true);
    Ok(cmd)
}

/// An exec's command line: `nsenter` into the PID and mount namespaces of
/// the pod's PID 1, with the container's environment and working directory.
pub fn exec_command(plan: &Plan, pid1: u32, argv: &[String]) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(host_tool("nsenter"));
    cmd.arg(format!("--target={pid1}"))
        .args(["--pid", "--mount"])
        .arg(format!("--wd={}", plan.cwd.display()))
        .arg("--")
        .args(argv)
        .env_clear()
        .envs(plan.env.iter().map(|(k, v)| (k, v)))
        .process_group(0)
        .kill_on_drop(true);
    cmd
}

/// The host pid of `parent`'s first child (the container's PID 1 under
/// `unshare --fork`), waiting for it to appear.
pub async fn child_of(parent: u32) -> Option<u32> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let Ok(text) = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            && let Some(pid) = text.split_whitespace().next().and_then(|p| p.parse().ok())
        {
            return Some(pid);
        }
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse::<u32>().ok()) else { continue };
                if ppid(pid) == Some(parent) {
                    return Some(pid);
                }
            }
        }
        if tokio::time::Instant::now() > deadline || !running(parent) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn ppid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: fields follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

pub fn signal(pid: u32, sig: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = kill(Pid::from_raw(pid), sig);
    }
}

pub fn signal_group(pgid: u32, sig: Signal) {
    if let Ok(pgid) = i32::try_from(pgid) {
        let _ = killpg(Pid::from_raw(pgid), sig);
    }
}

/// Reaps `pid` (our child) if it has exited, waiting up to `limit`; a pid
/// already reaped elsewhere (tokio's own wait) counts as reaped.
pub fn reap(pid: u32, limit: Duration) {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    let Ok(raw) = i32::try_from(pid) else { return };
    let deadline = std::time::Instant::now() + limit;
    loop {
        match waitpid(Pid::from_raw(raw), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            _ => return,
        }
    }
}

/// Whether `pid` runs (a zombie does not: it only waits to be reaped).
pub fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// Waits (up to `limit`) until `pid` no longer runs: a SIGKILLed PID 1 may
/// still be tearing its namespace down when its parent is gone.
pub async fn wait_gone(pid: u32, limit: Duration) {
    let deadline = tokio::time::Instant::now() + limit;
    while running(pid) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// [`wait_gone`] for `Drop`, which cannot await.
pub fn wait_gone_now(pid: u32, limit: Duration) {
    let deadline = std::time::Instant::now() + limit;
    while running(pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A process's exit as Kubernetes reports it: the code, or 128 + signal.
pub fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(9))
}
