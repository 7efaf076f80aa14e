//! The `spool` provider (`standby-server serve --provider spool`): a sandbox
//! is only its standby credential, written to `<dir>/<sandbox id>.token`
//! for a process outside the server to connect with. Nothing is launched.
//!
//! It exists so a load generator can hold thousands of standby connections
//! that speak the contract without thousands of agent processes: the server
//! runs its real dispatch, store and sockets, and only the sandbox side is
//! simulated. A sandbox is "running" from its launch until it is stopped or
//! deleted; the file is removed then, so the spool always lists exactly the
//! credentials the server still expects to see connect.

use std::collections::{HashMap, HashSet};
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

use super::{AgentLaunch, Details, Found, Launched, ProviderError, SandboxProvider, lock};

/// Sandboxes as credential files in one directory.
#[derive(Debug, Clone)]
pub struct SpoolProvider {
    inner: Arc<SpoolInner>,
}

#[derive(Debug)]
struct SpoolInner {
    dir: PathBuf,
    /// Whether a start adopts the credentials already spooled (see
    /// [`SpoolProvider::shared`]).
    shared: bool,
    /// The exit notice of every launched sandbox, sent when it is stopped.
    launched: Mutex<HashMap<String, oneshot::Sender<Option<i32>>>>,
}

impl SpoolProvider {
    /// Credentials are written to `dir`, created if needed.
    pub fn new(dir: PathBuf) -> Self {
        Self { inner: Arc::new(SpoolInner { dir, shared: false, launched: Mutex::new(HashMap::new()) }) }
    }

    /// A spool shared by the replicas of a replicated deployment: the
    /// leader that takes over adopts every sandbox the store knows whose
    /// credential is still spooled (an earlier leader launched it, and its
    /// holder reconnects to the new one), instead of taking it as missing.
    pub fn shared(dir: PathBuf) -> Self {
        Self { inner: Arc::new(SpoolInner { dir, shared: true, launched: Mutex::new(HashMap::new()) }) }
    }

    fn token_file(&self, sandbox_id: &str) -> PathBuf {
        self.inner.dir.join(format!("{sandbox_id}.token"))
    }

    fn launched(&self) -> MutexGuard<'_, HashMap<String, oneshot::Sender<Option<i32>>>> {
        lock(&self.inner.launched)
    }

    /// Off the runtime's threads: an unlink in a directory of tens of
    /// thousands of credentials is not free (measured: a fifth of a
    /// loaded server's time at 17,000 standbys).
    async fn remove_file(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let path = self.token_file(sandbox_id);
        match tokio::fs::remove_file(&path).await {
            Err(source) if source.kind() != std::io::ErrorKind::NotFound => {
                Err(ProviderError::Io { sandbox: sandbox_id.to_owned(), action: "delete", path, source })
            }
            _ => Ok(()),
        }
    }
}

/// Writes `contents` to `path` through a temporary file and a rename, mode
/// 0600: a reader never sees half a credential, and nobody else reads it.
fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    let partial = path.with_extension("partial");
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&partial)?;
    file.write_all(contents.as_bytes())?;
    std::fs::rename(&partial, path)
}

impl SandboxProvider for SpoolProvider {
    async fn create(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        let dir = &self.inner.dir;
        tokio::fs::create_dir_all(dir).await.map_err(|source| ProviderError::Io {
            sandbox: sandbox_id.to_owned(),
            action: "create",
            path: dir.clone(),
            source,
        })
    }

    async fn start(&self, _sandbox_id: &str) -> Result<(), ProviderError> {
        Ok(())
    }

    async fn launch(&self, sandbox_id: &str, launch: AgentLaunch) -> Result<Launched, ProviderError> {
        let path = self.token_file(sandbox_id);
        let (written, token) = (path.clone(), launch.token.clone());
        let wrote = tokio::task::spawn_blocking(move || write_private(&written, token.expose()))
            .await
            .unwrap_or_else(|join| std::panic::resume_unwind(join.into_panic()));
        wrote.map_err(|source| ProviderError::Io { sandbox: sandbox_id.to_owned(), action: "write", path, source })?;
        let (exit, exited) = oneshot::channel();
        self.launched().insert(sandbox_id.to_owned(), exit);
        Ok(Launched { pid: None, exited })
    }

    async fn stop(&self, sandbox_id: &str) {
        if let Err(error) = self.remove_file(sandbox_id).await {
            tracing::warn!(%error, "removing a spooled credential failed");
        }
        if let Some(exit) = self.launched().remove(sandbox_id) {
            let _ = exit.send(Some(0));
        }
    }

    async fn wait_exit(&self, sandbox_id: &str, _timeout: Duration) -> bool {
        // Nothing runs on its own here: whatever holds the credential is
        // outside the server. A launched sandbox ends only when stopped.
        !self.launched().contains_key(sandbox_id)
    }

    async fn delete(&self, sandbox_id: &str) -> Result<(), ProviderError> {
        if let Some(exit) = self.launched().remove(sandbox_id) {
            let _ = exit.send(Some(0));
        }
        self.remove_file(sandbox_id).await
    }

    async fn adopt(&self, known: HashSet<String>) {
        if !self.inner.shared {
            return;
        }
        let mut launched = self.launched();
        for sandbox_id in known {
            if self.token_file(&sandbox_id).is_file() {
                // Its exit is never awaited: a spooled sandbox ends only
                // when this server stops it.
                launched.entry(sandbox_id).or_insert_with(|| oneshot::channel().0);
            }
        }
    }

    async fn state(&self, sandbox_id: &str) -> Result<Found, ProviderError> {
        // After a restart the plaintext credential is gone with the old
        // process (unless the spool is shared and was adopted): a sandbox
        // this process did not launch cannot be reached.
        Ok(if self.launched().contains_key(sandbox_id) { Found::Running } else { Found::Missing })
    }

    async fn stop_all(&self) {
        let ids: Vec<String> = self.launched().keys().cloned().collect();
        for id in ids {
            self.stop(&id).await;
        }
    }

    fn details(&self, sandbox_id: &str) -> Details {
        Details { pid: None, dir: Some(self.token_file(sandbox_id)) }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt as _;

    use standby_protocol::Secret;

    use super::*;

    fn launch() -> AgentLaunch {
        AgentLaunch {
            server_url: "http://127.0.0.1:1".into(),
            token: Secret::new("sby_a_b"),
            heartbeat_interval: Duration::from_secs(10),
            log_filter: "info".into(),
            otlp_endpoint: None,
        }
    }

    #[tokio::test]
    async fn a_launch_spools_the_credential_and_a_stop_removes_it_and_reports_the_exit() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let provider = SpoolProvider::new(dir.path().join("spool"));
        provider.create("sbx_a").await.expect("create");
        let launched = provider.launch("sbx_a", launch()).await.expect("launch");
        let file = dir.path().join("spool/sbx_a.token");
        assert_eq!(std::fs::read_to_string(&file).expect("the token file"), "sby_a_b");
        assert_eq!(std::fs::metadata(&file).expect("metadata").permissions().mode() & 0o777, 0o600);
        assert_eq!(provider.state("sbx_a").await.expect("state"), Found::Running);
        assert!(!provider.wait_exit("sbx_a", Duration::ZERO).await);
        provider.stop("sbx_a").await;
        assert_eq!(launched.exited.await.expect("an exit"), Some(0));
        assert!(!file.exists());
        assert_eq!(provider.state("sbx_a").await.expect("state"), Found::Missing);
        provider.delete("sbx_a").await.expect("deleting twice is fine");
    }

    /// A new leader on a shared spool adopts the known sandboxes whose
    /// credential is still there; an unshared spool adopts nothing.
    #[tokio::test]
    async fn a_shared_spool_adopts_the_known_sandboxes_still_spooled() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let spool = dir.path().join("spool");
        let earlier = SpoolProvider::new(spool.clone());
        for id in ["sbx_a", "sbx_b"] {
            earlier.create(id).await.expect("create");
            drop(earlier.launch(id, launch()).await.expect("launch"));
        }
        earlier.stop("sbx_b").await;
        let known: HashSet<String> = ["sbx_a", "sbx_b", "sbx_c"].into_iter().map(str::to_owned).collect();

        let unshared = SpoolProvider::new(spool.clone());
        unshared.adopt(known.clone()).await;
        assert_eq!(unshared.state("sbx_a").await.expect("state"), Found::Missing);

        let shared = SpoolProvider::shared(spool);
        shared.adopt(known).await;
        assert_eq!(shared.state("sbx_a").await.expect("state"), Found::Running);
        for gone in ["sbx_b", "sbx_c"] {
            assert_eq!(shared.state(gone).await.expect("state"), Found::Missing, "{gone}");
        }
        shared.stop("sbx_a").await;
        assert!(!dir.path().join("spool/sbx_a.token").exists());
    }
}
