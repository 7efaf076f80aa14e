//! How the local provider keeps every process of a sandbox killable, even
//! one that left the agent's process group and dropped the sandbox's mark
//! from its environment (`setsid env -i …`).
//!
//! Chosen by probing when the provider is built, best first:
//! - **cgroup**: a cgroup v2 group per sandbox, under a group of this
//!   server's own (`<own cgroup>/standby-<pid>-<n>/<sandbox id>`). The agent
//!   enters it before it is executed (a `/bin/sh` wrapper writes its own
//!   pid to `cgroup.procs`, then `exec`s the agent: no `unsafe` pre-exec
//!   hook), so every descendant is in it whatever it does; stopping the
//!   sandbox writes `1` to `cgroup.kill`. Needs a writable cgroup2
//!   hierarchy with `cgroup.kill` (Linux 5.14), which a container is often
//!   not delegated.
//! - **pid-namespace**: as root, the agent is started through util-linux
//!   `unshare --pid --fork --kill-child`: it is the init of a PID namespace
//!   of its own, and when it dies the kernel kills everything in the
//!   namespace.
//! - **process-group**: neither is available (a warning says so at start):
//!   the agent's process group and the processes carrying the sandbox's
//!   environment mark are killed, and nothing else.
//!
//! None of them isolates sandboxes from each other: they run as the
//! server's user, on its filesystem and network.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How a local sandbox's processes are contained (`--sandbox-containment`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ContainmentChoice {
    /// The best the host allows: cgroup, else pid-namespace, else
    /// process-group.
    #[default]
    Auto,
    Cgroup,
    PidNamespace,
    ProcessGroup,
}

#[derive(Debug, thiserror::Error)]
pub enum ContainmentError {
    #[error("no writable cgroup2 hierarchy with cgroup.kill: {0}")]
    NoCgroup(String),
    #[error("cannot run `unshare --pid` (util-linux, as root): {0}")]
    NoPidNamespace(String),
}

/// The containment in use.
#[derive(Debug)]
pub enum Containment {
    Cgroup(CgroupTree),
    PidNamespace { unshare: PathBuf },
    ProcessGroup,
}

impl Containment {
    /// Probes for `choice` (`Auto`: the best available, with a warning when
    /// it is only the process group).
    pub fn probe(choice: ContainmentChoice) -> Result<Self, ContainmentError> {
        let containment = match choice {
            ContainmentChoice::Cgroup => Self::Cgroup(CgroupTree::create()?),
            ContainmentChoice::PidNamespace => Self::PidNamespace { unshare: probe_unshare()? },
            ContainmentChoice::ProcessGroup => Self::ProcessGroup,
            ContainmentChoice::Auto => match CgroupTree::create() {
                Ok(tree) => Self::Cgroup(tree),
                Err(cgroup) => match probe_unshare() {
                    Ok(unshare) => {
                        tracing::info!(%cgroup, "no cgroup for sandboxes: using a PID namespace per sandbox");
                        Self::PidNamespace { unshare }
                    }
                    Err(namespace) => {
                        tracing::warn!(
                            %cgroup,
                            %namespace,
                            "local sandboxes are contained by their process group only: a process that leaves it \
                             and drops the sandbox's environment mark survives its sandbox"
                        );
                        Self::ProcessGroup
                    }
                },
            },
        };
        tracing::info!(containment = containment.name(), "local sandbox containment");
        Ok(containment)
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Cgroup(_) => "cgroup",
            Self::PidNamespace { .. } => "pid-namespace",
            Self::ProcessGroup => "process-group",
        }
    }

    /// The command line that starts `program` contained as sandbox
    /// `sandbox_id` (preparing its cgroup, killing what a previous launch
    /// left in it).
    pub fn wrap(&self, sandbox_id: &str, program: &Path) -> std::io::Result<Vec<OsString>> {
        Ok(match self {
            Self::Cgroup(tree) => {
                let procs = tree.prepare(sandbox_id)?;
                vec![
                    "/bin/sh".into(),
                    "-c".into(),
                    // Enter the group, then become the agent: nothing runs
                    // outside it in between.
                    r#"echo $$ > "$0" && exec "$@""#.into(),
                    procs.into(),
                    program.into(),
                ]
            }
            Self::PidNamespace { unshare } => vec![
                unshare.into(),
                "--pid".into(),
                "--fork".into(),
                "--kill-child".into(),
                "--".into(),
                program.into(),
            ],
            Self::ProcessGroup => vec![program.into()],
        })
    }

    /// The signal the kernel sends the launched process when the server
    /// dies (`setpriv --pdeathsig`). `unshare` blocks SIGTERM while it
    /// waits, so in a PID namespace it is SIGKILL, which ends the namespace.
    pub fn death_signal(&self) -> &'static str {
        match self {
            Self::PidNamespace { .. } => "KILL",
            Self::Cgroup(_) | Self::ProcessGroup => "TERM",
        }
    }

    /// The agent's pid, given the launched process's: in a PID namespace
    /// the agent is `unshare`'s only child.
    pub fn agent_pid(&self, launched: u32) -> u32 {
        match self {
            Self::PidNamespace { .. } => std::fs::read_to_string(format!("/proc/{launched}/task/{launched}/children"))
                .ok()
                .and_then(|children| children.split_whitespace().next()?.parse().ok())
                .unwrap_or(launched),
            Self::Cgroup(_) | Self::ProcessGroup => launched,
        }
    }

    /// Kills every process left in the sandbox, and waits (boundedly) for
    /// them to be gone. In a PID namespace the kernel does it when the
    /// agent ends; with a process group the caller's sweep does.
    pub async fn kill(&self, sandbox_id: &str) {
        if let Self::Cgroup(tree) = self {
            tree.kill(sandbox_id).await;
        }
    }

    /// Kills every sandbox's leftovers (server shutdown).
    pub async fn kill_all(&self) {
        if let Self::Cgroup(tree) = self {
            for sandbox_id in tree.groups() {
                tree.kill(&sandbox_id).await;
            }
        }
    }
}

fn probe_unshare() -> Result<PathBuf, ContainmentError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(ContainmentError::NoPidNamespace("not running as root".into()));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let unshare = std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .map(|dir| dir.join("unshare"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| ContainmentError::NoPidNamespace("`unshare` not found".into()))?;
    let status = std::process::Command::new(&unshare)
        .args(["--pid", "--fork", "--kill-child", "--", "true"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|error| ContainmentError::NoPidNamespace(error.to_string()))?;
    if !status.success() {
        return Err(ContainmentError::NoPidNamespace(format!("`unshare --pid true` failed: {status}")));
    }
    Ok(unshare)
}

/// Tells this process's trees apart (a test process may build several
/// providers).
static TREES: AtomicU64 = AtomicU64::new(0);
/// Prefix of a server's own group.
const TREE_PREFIX: &str = "standby-";

/// This server's cgroup: one child group per sandbox. Dropping it kills
/// everything left in it and removes it.
#[derive(Debug)]
pub struct CgroupTree {
    dir: PathBuf,
}

impl CgroupTree {
    /// Creates `<own cgroup>/standby-<pid>-<n>`, after killing and removing
    /// the trees of servers that died (SIGKILL) without cleaning up, and
    /// checks that a process can be moved into a group of it.
    fn create() -> Result<Self, ContainmentError> {
        let fail = |what: String| ContainmentError::NoCgroup(what);
        let parent = own_cgroup_dir().map_err(fail)?;
        remove_stale_trees(&parent);
        let n = TREES.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!("{TREE_PREFIX}{}-{n}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|error| fail(format!("cannot create {}: {error}", dir.display())))?;
        let tree = Self { dir };
        if !tree.dir.join("cgroup.kill").is_file() {
            return Err(fail(format!("{} has no cgroup.kill (Linux 5.14 or later)", tree.dir.display())));
        }
        let procs = tree.prepare(".probe").map_err(|error| fail(format!("cannot create a group: {error}")))?;
        let moved = std::process::Command::new("/bin/sh")
            .args(["-c", r#"echo $$ > "$0""#])
            .arg(&procs)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|error| fail(format!("cannot run /bin/sh: {error}")))?;
        let _ = std::fs::remove_dir(tree.group(".probe"));
        if !moved.success() {
            return Err(fail(format!("cannot move a process into {}", procs.display())));
        }
        Ok(tree)
    }

    fn group(&self, sandbox_id: &str) -> PathBuf {
        self.dir.join(sandbox_id)
    }

    /// Empties (kills what is left) or creates the sandbox's group; its
    /// `cgroup.procs`.
    fn prepare(&self, sandbox_id: &str) -> std::io::Result<PathBuf> {
        let group = self.group(sandbox_id);
        if group.is_dir() {
            let _ = std::fs::write(group.join("cgroup.kill"), "1");
        } else {
            std::fs::create_dir(&group)?;
        }
        Ok(group.join("cgroup.procs"))
    }

    async fn kill(&self, sandbox_id: &str) {
        let group = self.group(sandbox_id);
        if std::fs::write(group.join("cgroup.kill"), "1").is_err() {
            return;
        }
        // The kernel delivers SIGKILL at once; the processes are gone (and
        // the group removable) once each has exited.
        for _ in 0..500 {
            if !populated(&group) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if let Err(error) = std::fs::remove_dir(&group) {
            tracing::warn!(sandbox_id, %error, group = %group.display(), "cannot remove the sandbox's cgroup");
        }
    }

    fn groups(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .map(|entries| {
                entries
                    .filter_map(|entry| entry.ok())
                    .filter(|entry| entry.path().is_dir())
                    .filter_map(|entry| entry.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for CgroupTree {
    fn drop(&mut self) {
        kill_tree(&self.dir);
    }
}

fn populated(group: &Path) -> bool {
    std::fs::read_to_string(group.join("cgroup.events"))
        .map(|events| events.lines().any(|line| line == "populated 1"))
        .unwrap_or(false)
}

/// Kills everything in a tree and removes it (a short bounded wait for the
/// processes to exit).
fn kill_tree(dir: &Path) {
    let groups: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries.filter_map(|entry| entry.ok()).map(|entry| entry.path()).filter(|p| p.is_dir()).collect()
        })
        .unwrap_or_default();
    let _ = std::fs::write(dir.join("cgroup.kill"), "1");
    for _ in 0..200 {
        if !populated(dir) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for group in groups {
        let _ = std::fs::remove_dir(group);
    }
    let _ = std::fs::remove_dir(dir);
}

/// Trees of servers whose process is gone: their sandboxes' leftovers.
fn remove_stale_trees(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for entry in entries.filter_map(|entry| entry.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix(TREE_PREFIX).and_then(|rest| rest.split('-').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::warn!(tree = %entry.path().display(), "killing the sandboxes' leftovers of a server that died");
            kill_tree(&entry.path());
        }
    }
}

/// The directory of this process's cgroup in the cgroup2 hierarchy.
fn own_cgroup_dir() -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("cannot read /proc/self/mountinfo: {e}"))?;
    let (mount_root, mount_point) = cgroup2_mount(&mountinfo).ok_or("no cgroup2 file system is mounted")?;
    let cgroup =
        std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
    let own = cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))
        .ok_or("this process is in no cgroup2 group (/proc/self/cgroup has no `0::` line)")?;
    let relative = own.strip_prefix(mount_root.as_str()).unwrap_or(own).trim_start_matches('/');
    let dir = Path::new(&mount_point).join(relative);
    if !dir.is_dir() {
        return Err(format!("this process's cgroup {} is not visible", dir.display()));
    }
    Ok(dir)
}

/// The root and mount point of the first cgroup2 mount in a
/// `/proc/self/mountinfo`.
fn cgroup2_mount(mountinfo: &str) -> Option<(String, String)> {
    mountinfo.lines().find_map(|line| {
        let (fields, rest) = line.split_once(" - ")?;
        if rest.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut fields = fields.split_whitespace().skip(3);
        let root = fields.next()?.to_owned();
        let point = fields.next()?.to_owned();
        Some((root, point))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::local::{LocalOptions, LocalProvider};
    use crate::provider::{AgentLaunch, SandboxProvider};

    /// Live processes whose command line is exactly `argv`.
    fn with_argv(argv: &[&str]) -> Vec<u32> {
        let wanted: Vec<u8> = argv.iter().flat_map(|arg| arg.bytes().chain([0])).collect();
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| cmdline == wanted))
            .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z")))
            .collect()
    }

    async fn until(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !check() {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// An agent that starts two processes escaping its group and its
    /// environment mark (one through a double fork), each found by its
    /// argv (`sleep 1000.<token>`), then `tail` (`exit 0`, or waiting).
    fn escaping_agent(dir: &Path, tokens: [&str; 2], tail: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join("escaping-agent");
        let (a, b) = (tokens[0], tokens[1]);
        let body = format!(
            "#!/bin/sh\ncd \"$STANDBY_WORKSPACE\"\n\
             setsid env -i sh -c \"echo > '$PWD/a'; exec sleep 1000.{a}\" &\n\
             (setsid env -i sh -c \"echo > '$PWD/b'; exec sleep 1000.{b}\" &)\n\
             while [ ! -e a ] || [ ! -e b ]; do sleep 0.05; done\n\
             echo up > up\n{tail}\n"
        );
        std::fs::write(&path, body).expect("write the agent");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    /// Runs `check` for each containment this host allows (cgroup, PID
    /// namespace); says which it skipped.
    async fn for_each_containment(check: impl AsyncFn(ContainmentChoice, &Path)) {
        for choice in [ContainmentChoice::Cgroup, ContainmentChoice::PidNamespace] {
            if let Err(error) = Containment::probe(choice) {
                eprintln!("skipping {choice:?}: {error}");
                continue;
            }
            let dir = tempfile::tempdir().expect("a temp dir");
            check(choice, dir.path()).await;
        }
    }

    fn tokens(choice: ContainmentChoice, case: u32) -> [String; 2] {
        let base = std::process::id() * 10 + case * 4 + choice as u32;
        [format!("{base}1"), format!("{base}2")]
    }

    #[tokio::test]
    async fn processes_that_left_the_group_and_the_mark_die_when_the_sandbox_is_stopped() {
        for_each_containment(async |choice, dir| {
            let [a, b] = tokens(choice, 0);
            let agent = escaping_agent(dir, [&a, &b], "while :; do sleep 1; done");
            let stop_grace = Duration::from_millis(300);
            let options = LocalOptions { containment: choice, stop_grace, ..LocalOptions::default() };
            let provider = LocalProvider::try_with_options(dir.join("sandboxes"), agent, options).expect("probed");
            assert_eq!(provider.containment(), Containment::probe(choice).expect("probed").name());
            provider.create("sbx_e").await.expect("create");
            let launched = provider.launch("sbx_e", AgentLaunch::unreachable()).await.expect("launch");
            let escaped = [format!("1000.{a}"), format!("1000.{b}")];
            let argvs = escaped.each_ref().map(|arg| ["sleep", arg.as_str()]);
            until("the escaped processes", || argvs.iter().all(|argv| !with_argv(argv).is_empty())).await;
            provider.stop("sbx_e").await;
            assert!(launched.exited.await.is_ok());
            until(&format!("{choice:?}: the escaped processes gone"), || {
                argvs.iter().all(|argv| with_argv(argv).is_empty())
            })
            .await;
        })
        .await;
    }

    #[tokio::test]
    async fn processes_that_left_the_group_and_the_mark_die_when_the_agent_exits() {
        for_each_containment(async |choice, dir| {
            let [a, b] = tokens(choice, 1);
            let agent = escaping_agent(dir, [&a, &b], "exit 0");
            let options = LocalOptions { containment: choice, ..LocalOptions::default() };
            let provider = LocalProvider::try_with_options(dir.join("sandboxes"), agent, options).expect("probed");
            provider.create("sbx_x").await.expect("create");
            let launched = provider.launch("sbx_x", AgentLaunch::unreachable()).await.expect("launch");
            assert_eq!(launched.exited.await.expect("an exit"), Some(0));
            assert!(dir.join("sandboxes/sbx_x/workspace/up").is_file(), "the agent started its processes");
            let escaped = [format!("1000.{a}"), format!("1000.{b}")];
            let argvs = escaped.each_ref().map(|arg| ["sleep", arg.as_str()]);
            until(&format!("{choice:?}: the escaped processes gone"), || {
                argvs.iter().all(|argv| with_argv(argv).is_empty())
            })
            .await;
        })
        .await;
    }

    #[test]
    fn the_cgroup2_mount_is_found_in_a_hybrid_mountinfo() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
40 30 0:35 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        assert_eq!(cgroup2_mount(mountinfo), Some(("/".into(), "/sys/fs/cgroup/unified".into())));
        assert_eq!(cgroup2_mount("31 30 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"), None);
    }
}
