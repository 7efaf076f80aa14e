//! Installing a run into a prepared sandbox: everything between the
//! assignment and the start, except delivery confirmation (which the
//! control socket does concurrently).
//!
//! The plan, in dependency order (`docs/protocol.md` shows it as a chart):
//!
//! 1. *MCP restart* starts at once: its only input is the assignment. It is
//!    joined last.
//! 2. *check*: the run is valid (a command, a `cwd` inside the workspace)
//!    and the assignment's workspace has the prepared fingerprint. Local and
//!    instant, so it runs before any secret is fetched: a sandbox that
//!    cannot take the run never receives the run's secrets.
//! 3. *network*, concurrently: secrets, attachments, metadata, cloud
//!    credentials, and git credentials followed by the repo refresh that
//!    needs them. The first error cancels the rest.
//! 4. *terminal*: the idle shell must be alive, idle and writable.
//! 5. join the MCP restart: a failure degrades the run, or fails the install
//!    under `strict_mcp`.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use standby_protocol::layout::StateDir;
use standby_protocol::vars;
use standby_protocol::{
    Cause, CloudCredentialsResponse, Fingerprint, GitCredential, GitCredentialsResponse, Repo, Run, Secret,
    SecretsResponse, Spec, Stage, fingerprint, paths,
};
use tokio::time::Instant;

use crate::api::{Api, call_backoff, retry};
use crate::config::InstallPlan;
use crate::git::Snapshot;
use crate::lifecycle::InstallFailure;
use crate::mcp::McpSupervisor;
use crate::paths::{resolve_inside, write_run_file};
use crate::shell::IdleShell;

mod attachments;

/// What preparation leaves for the install: the idle shell, the MCP
/// servers, and the fingerprint they were prepared under.
#[derive(Debug)]
pub struct Prepared {
    /// `None` once the run has replaced it.
    pub shell: Option<IdleShell>,
    pub mcp: McpSupervisor,
    pub fingerprint: Fingerprint,
    /// The fresh clones as preparation left them, for the first install.
    pub checkouts: BTreeMap<String, Snapshot>,
}

/// Everything the install needs besides the prepared sandbox.
#[derive(Debug, Clone)]
pub struct InstallInput {
    pub api: Api,
    pub credential: Secret,
    pub execution_id: String,
    pub run: Run,
    pub root: PathBuf,
    pub spec: Spec,
    pub plan: InstallPlan,
    /// Retries of every call stop here (`STANDBY_INSTALL_TIMEOUT`).
    pub deadline: Instant,
    /// Clones known as preparation left them (see [`Prepared::checkouts`]).
    pub checkouts: BTreeMap<String, Snapshot>,
}

/// A run ready to start.
#[derive(Debug)]
pub struct Installed {
    pub argv: Vec<String>,
    pub cwd: PathBuf,
    /// The run's complete environment (holds secret values: never log it).
    pub env: BTreeMap<String, String>,
    /// Every secret value the run received, for redaction of its output.
    pub secrets: Vec<Secret>,
    /// Each step's timing, in the order they finished: what the `run
    /// started` line logs and the install spans are made of.
    pub steps: Vec<Timed>,
    /// Why MCP servers failed to restart, one message each (the run is degraded).
    pub degraded: Vec<String>,
}

/// The results of the network group.
#[derive(Debug, Default)]
struct Fetched {
    secrets: BTreeMap<String, Secret>,
    cloud: BTreeMap<String, Secret>,
    git_env: BTreeMap<String, String>,
    git_passwords: Vec<Secret>,
}

/// One step's timing: a step is named by the stage its failure would
/// report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timed {
    pub stage: Stage,
    /// When its (first) part began.
    pub start: Instant,
    /// How long it took: a stage timed in parts (the refresh: its clean
    /// check, then git) is the sum of its parts.
    pub took: Duration,
}

/// How long each step took.
struct Steps(Mutex<Vec<Timed>>);

impl Steps {
    async fn time<T>(&self, stage: Stage, step: impl Future<Output = T>) -> T {
        let start = Instant::now();
        let value = step.await;
        let took = start.elapsed();
        let mut steps = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match steps.iter_mut().find(|timed| timed.stage == stage) {
            Some(timed) => timed.took += took,
            None => steps.push(Timed { stage, start, took }),
        }
        value
    }

    fn into_inner(self) -> Vec<Timed> {
        self.0.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Installs the run. Cancel-safe in the sense that matters: dropping the
/// future stops every call and leaves no child behind (git runs with
/// `kill_on_drop`), and nothing the run would do has happened.
pub async fn install(input: &InstallInput, prepared: &mut Prepared) -> Result<Installed, InstallFailure> {
    let steps = Steps(Mutex::new(Vec::new()));
    let Prepared { shell, mcp, fingerprint: prepared_fingerprint, .. } = prepared;
    let mcp_restart = steps.time(Stage::Mcp, restart_mcp(mcp, &input.run.mcp_env));
    let rest = async {
        let cwd = steps.time(Stage::Check, async { check(input, prepared_fingerprint) }).await?;
        let fetched = match input.plan {
            InstallPlan::Parallel => fetch_parallel(input, &steps).await?,
            InstallPlan::Sequential => fetch_sequential(input, &steps).await?,
        };
        steps
            .time(Stage::Terminal, async {
                let shell = shell.as_mut().ok_or_else(InstallFailure::shell_gone)?;
                shell
                    .check_replaceable()
                    .map_err(|e| InstallFailure::new(Stage::Terminal, Cause::RefusedShell, e.to_string()))
            })
            .await?;
        Ok::<_, InstallFailure>((cwd, fetched))
    };
    let (cwd, fetched, failed_mcp) = match input.plan {
        InstallPlan::Parallel => {
            let (rest, failed_mcp) = tokio::join!(rest, mcp_restart);
            let (cwd, fetched) = rest?;
            (cwd, fetched, failed_mcp)
        }
        InstallPlan::Sequential => {
            let (cwd, fetched) = rest.await?;
            (cwd, fetched, mcp_restart.await)
        }
    };
    if !failed_mcp.is_empty() {
        let message = failed_mcp.join("; ");
        if input.run.strict_mcp {
            return Err(InstallFailure::new(Stage::Mcp, Cause::StrictMcp, message));
        }
        tracing::warn!(execution_id = %input.execution_id, failures = message, "MCP servers failed to restart; the run is degraded");
    }
    let mcp_config =
        mcp.write_config(&input.root).map_err(|e| InstallFailure::new(Stage::Mcp, Cause::Sandbox, e.to_string()))?;
    let env = run_env(input, &fetched, mcp_config.as_deref());
    let secrets = fetched
        .secrets
        .into_values()
        .chain(fetched.cloud.into_values())
        .chain(fetched.git_passwords)
        .chain([input.credential.clone()])
        .collect();
    Ok(Installed {
        argv: input.run.command.clone(),
        cwd,
        env,
        secrets,
        steps: steps.into_inner(),
        degraded: failed_mcp,
    })
}

async fn restart_mcp(mcp: &mut McpSupervisor, mcp_env: &BTreeMap<String, String>) -> Vec<String> {
    mcp.restart(mcp_env).await.iter().map(ToString::to_string).collect()
}

/// The run is valid and this sandbox was prepared for it.
fn check(input: &InstallInput, prepared: &Fingerprint) -> Result<PathBuf, InstallFailure> {
    let run = &input.run;
    if run.command.is_empty() || run.command[0].is_empty() {
        return Err(InstallFailure::new(Stage::Check, Cause::InvalidRun, "the run has no command"));
    }
    let cwd = match run.cwd.as_deref() {
        None | Some("") => input.root.clone(),
        Some(cwd) => resolve_inside(&input.root, cwd)
            .map_err(|e| InstallFailure::new(Stage::Check, Cause::InvalidRun, format!("run cwd: {e}")))?,
    };
    if !cwd.is_dir() {
        return Err(InstallFailure::new(
            Stage::Check,
            Cause::InvalidRun,
            format!("run cwd `{}` is not a directory in the workspace", run.cwd.as_deref().unwrap_or(".")),
        ));
    }
    if let Some(workspace) = &run.workspace {
        let wanted = fingerprint(workspace);
        if wanted != *prepared {
            return Err(InstallFailure::new(
                Stage::SamePreparation,
                Cause::FingerprintMismatch,
                format!("the run's workspace has fingerprint {wanted}, this sandbox was prepared as {prepared}"),
            ));
        }
    }
    Ok(cwd)
}

async fn fetch_parallel(input: &InstallInput, steps: &Steps) -> Result<Fetched, InstallFailure> {
    let (secrets, (), (), cloud, (git_env, git_passwords)) = futures::try_join!(
        steps.time(Stage::Secrets, secrets(input)),
        steps.time(Stage::Attachments, attachments::attachments(input)),
        steps.time(Stage::Metadata, metadata(input)),
        steps.time(Stage::CloudCredentials, cloud_credentials(input)),
        git_then_refresh(input, steps),
    )?;
    Ok(Fetched { secrets, cloud, git_env, git_passwords })
}

async fn fetch_sequential(input: &InstallInput, steps: &Steps) -> Result<Fetched, InstallFailure> {
    let secrets = steps.time(Stage::Secrets, secrets(input)).await?;
    steps.time(Stage::Attachments, attachments::attachments(input)).await?;
    steps.time(Stage::Metadata, metadata(input)).await?;
    let cloud = steps.time(Stage::CloudCredentials, cloud_credentials(input)).await?;
    let (git_env, git_passwords) = git_then_refresh(input, steps).await?;
    Ok(Fetched { secrets, cloud, git_env, git_passwords })
}

/// The git credentials, and the repos brought to the run's commit. In the
/// parallel plan the refresh's clean check runs while the credentials are
/// fetched: it needs none, and on a warm run it is most of the refresh.
async fn git_then_refresh(
    input: &InstallInput,
    steps: &Steps,
) -> Result<(BTreeMap<String, String>, Vec<Secret>), InstallFailure> {
    let credentials = steps.time(Stage::GitCredentials, git_credentials(input));
    let (credentials, clean) = match input.plan {
        InstallPlan::Parallel => futures::join!(credentials, steps.time(Stage::Refresh, still_clean(input))),
        InstallPlan::Sequential => {
            let credentials = credentials.await?;
            (Ok(credentials), steps.time(Stage::Refresh, still_clean(input)).await)
        }
    };
    let (git_env, passwords) = credentials?;
    steps.time(Stage::Refresh, refresh(input, &git_env, &clean)).await?;
    Ok((git_env, passwords))
}

async fn secrets(input: &InstallInput) -> Result<BTreeMap<String, Secret>, InstallFailure> {
    let path = paths::secrets(&input.execution_id);
    let response: SecretsResponse =
        retry(&format!("GET {path}"), input.deadline, call_backoff(), || input.api.get_json(&input.credential, &path))
            .await
            .map_err(InstallFailure::call_failed(Stage::Secrets))?;
    Ok(response.secrets)
}

async fn cloud_credentials(input: &InstallInput) -> Result<BTreeMap<String, Secret>, InstallFailure> {
    let path = paths::cloud_credentials(&input.execution_id);
    let response: CloudCredentialsResponse = retry(&format!("POST {path}"), input.deadline, call_backoff(), || {
        input.api.post_json::<(), _>(&input.credential, &path, None)
    })
    .await
    .map_err(InstallFailure::call_failed(Stage::CloudCredentials))?;
    Ok(response.env)
}

async fn metadata(input: &InstallInput) -> Result<(), InstallFailure> {
    let path = paths::metadata(&input.execution_id);
    let value: serde_json::Value =
        retry(&format!("GET {path}"), input.deadline, call_backoff(), || input.api.get_json(&input.credential, &path))
            .await
            .map_err(InstallFailure::call_failed(Stage::Metadata))?;
    let file = StateDir::of(&input.root).metadata_file();
    let bytes = serde_json::to_vec_pretty(&value).unwrap_or_default();
    write_run_file(&file, &bytes, 0o600)
        .await
        .map_err(|e| InstallFailure::new(Stage::Metadata, Cause::Sandbox, format!("writing {}: {e}", file.display())))
}

/// Fetches git credentials, writes them in git's credential-store format
/// (mode 0600) and returns the `GIT_CONFIG_*` variables that point git at
/// that file, extending any such configuration already in the environment.
async fn git_credentials(input: &InstallInput) -> Result<(BTreeMap<String, String>, Vec<Secret>), InstallFailure> {
    let path = paths::git_credentials(&input.execution_id);
    let response: GitCredentialsResponse = retry(&format!("POST {path}"), input.deadline, call_backoff(), || {
        input.api.post_json::<(), _>(&input.credential, &path, None)
    })
    .await
    .map_err(InstallFailure::call_failed(Stage::GitCredentials))?;
    if response.credentials.is_empty() {
        return Ok((BTreeMap::new(), Vec::new()));
    }
    let file = StateDir::of(&input.root).git_credentials();
    let lines: String = response.credentials.iter().map(store_line).collect();
    write_run_file(&file, lines.as_bytes(), 0o600).await.map_err(|e| {
        InstallFailure::new(Stage::GitCredentials, Cause::Sandbox, format!("writing {}: {e}", file.display()))
    })?;
    let index = std::env::var("GIT_CONFIG_COUNT").ok().and_then(|n| n.parse::<usize>().ok()).unwrap_or(0);
    let env = BTreeMap::from([
        ("GIT_CONFIG_COUNT".to_owned(), (index + 1).to_string()),
        (format!("GIT_CONFIG_KEY_{index}"), "credential.helper".to_owned()),
        (format!("GIT_CONFIG_VALUE_{index}"), format!("store --file={}", file.display())),
    ]);
    let passwords = response.credentials.into_iter().map(|c| c.password).collect();
    Ok((env, passwords))
}

/// One line of git's credential store: `protocol://user:password@host`,
/// user and password percent-encoded.
fn store_line(credential: &GitCredential) -> String {
    format!(
        "{}://{}:{}@{}\n",
        credential.protocol,
        percent_encode(&credential.username),
        percent_encode(credential.password.expose()),
        credential.host
    )
}

fn percent_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Moves every repo to the commit the run needs: the assignment's workspace
/// when it has one (it carries `expected_sha`), else the spec's.
/// The repos of the run, as the run or the spec names them.
fn repos(input: &InstallInput) -> &[Repo] {
    input.run.workspace.as_ref().map_or(&input.spec.workspace.repos, |w| &w.repos)
}

/// The repos whose clone is still exactly as preparation left it, at the
/// commit the run wants: their refresh needs no git (and no credential).
async fn still_clean(input: &InstallInput) -> HashSet<String> {
    let checks = repos(input).iter().filter_map(|repo| {
        let snapshot = input.checkouts.get(&repo.path)?;
        if repo.expected_sha.as_deref() != Some(snapshot.sha()) {
            return None;
        }
        let dest = resolve_inside(&input.root, &repo.path).ok()?;
        let (snapshot, path) = (snapshot.clone(), repo.path.clone());
        Some(async move {
            // The watch armed at the end of preparation answers in constant
            // time; only when it cannot is every tracked file read.
            match snapshot.unchanged(&dest) {
                Ok(()) => {
                    tracing::debug!(path, "repo already at expected_sha and unchanged since preparation: no git");
                    return Some(path);
                }
                Err(why) => {
                    tracing::debug!(path, %why, "the watch cannot vouch for the clone: reading every tracked file")
                }
            }
            match tokio::task::spawn_blocking(move || snapshot.still_clean(&dest)).await {
                Ok(Ok(())) => {
                    tracing::debug!(path, "repo already at expected_sha and clean: no git");
                    Some(path)
                }
                Ok(Err(why)) => {
                    tracing::debug!(path, %why, "the clone changed since preparation: git checks it out");
                    None
                }
                Err(_) => None,
            }
        })
    });
    futures::future::join_all(checks).await.into_iter().flatten().collect()
}

/// Brings every repo not known `clean` to the run's commit with git.
async fn refresh(
    input: &InstallInput,
    git_env: &BTreeMap<String, String>,
    clean: &HashSet<String>,
) -> Result<(), InstallFailure> {
    let refreshes = repos(input).iter().filter(|repo| !clean.contains(&repo.path)).map(|repo| async move {
        let dest = resolve_inside(&input.root, &repo.path)
            .map_err(|e| InstallFailure::new(Stage::Refresh, Cause::InvalidRun, format!("repo path: {e}")))?;
        let sha = tokio::time::timeout_at(input.deadline, crate::git::refresh(repo, &dest, git_env))
            .await
            .map_err(|_| {
                InstallFailure::new(Stage::Refresh, Cause::Deadline, format!("refreshing `{}` timed out", repo.path))
            })?
            .map_err(|e| InstallFailure::new(Stage::Refresh, Cause::Network, e.to_string()))?;
        tracing::debug!(path = repo.path, sha, "repo refreshed");
        Ok::<_, InstallFailure>(())
    });
    futures::future::try_join_all(refreshes).await.map(drop)
}

/// The run's environment, in the contract's order: the agent's own (minus
/// its credential), the run's `env`, the secrets, the cloud credentials, then
/// the variables that locate what the install wrote.
fn run_env(input: &InstallInput, fetched: &Fetched, mcp_config: Option<&Path>) -> BTreeMap<String, String> {
    let mut env = crate::process::child_env();
    env.entry("TERM".to_owned()).or_insert_with(|| "xterm-256color".to_owned());
    env.extend(input.run.env.clone());
    env.extend(fetched.secrets.iter().map(|(k, v)| (k.clone(), v.expose().to_owned())));
    env.extend(fetched.cloud.iter().map(|(k, v)| (k.clone(), v.expose().to_owned())));
    env.extend(fetched.git_env.clone());
    env.insert(vars::EXECUTION_ID.into(), input.execution_id.clone());
    let state_dir = StateDir::of(&input.root);
    env.insert(vars::METADATA_FILE.into(), state_dir.metadata_file().display().to_string());
    env.insert(vars::ATTACHMENTS_DIR.into(), state_dir.attachments_dir().display().to_string());
    if let Some(path) = mcp_config {
        env.insert(vars::MCP_CONFIG.into(), path.display().to_string());
    }
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credential_store_line_is_percent_encoded() {
        let credential = GitCredential {
            protocol: "https".into(),
            host: "git.example".into(),
            username: "x-access-token".into(),
            password: Secret::new("p@ss:w/rd"),
        };
        assert_eq!(store_line(&credential), "https://x-access-token:p%40ss%3Aw%2Frd@git.example\n");
    }
}
