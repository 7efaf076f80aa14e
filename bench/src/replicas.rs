//! The servers of the spread capacity test: one `standby-server serve`
//! on its SQLite file, or one or more replicas on one PostgreSQL schema
//! made fresh for the test (and dropped after it), all on one spool
//! directory (the leader spools the credentials; each replica holds the
//! agents' sockets it takes and speaks for them over its link to the
//! leader).

use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, Result, anyhow};
use serde_json::Value;
use standby_e2e::postgres::TestSchema;

use crate::capacity::{spool_args, wait_for};
use crate::procfs;
use crate::server::{API_KEY, ServerProc, http_client};

/// The lease of the replicas. Failover is not measured here, and on a
/// loaded machine a claim may outlast the default 10 s lease's bound (a
/// replica deposed at start ends the level), so a longer one.
const LEASE_TTL: &str = "30s";

/// The servers of one level.
pub struct Replicas {
    pub servers: Vec<ServerProc>,
    /// Made fresh for the level; dropped (with its tables) when the
    /// replicas are.
    schema: Option<TestSchema>,
}

impl Replicas {
    /// `count` servers spooling `pool` credentials into `spool`; on
    /// `store` (a `postgres://` URL) when given, else (one server only) on
    /// SQLite. Returns once exactly one leads and the others follow it.
    pub async fn start(
        count: usize,
        store: Option<&str>,
        server_bin: &Path,
        dir: &Path,
        pool: usize,
        heartbeat: Duration,
    ) -> Result<Self> {
        let spool = dir.join("spool");
        let schema = match store {
            Some(base) => {
                Some(TestSchema::on(base, &dir.display().to_string()).map_err(|problem| anyhow!("{problem}"))?)
            }
            None if count > 1 => return Err(anyhow!("{count} replicas need a PostgreSQL store (--store)")),
            None => None,
        };
        if schema.is_some() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            // Replicas on PostgreSQL share a key made beforehand.
            let keygen = std::process::Command::new(server_bin).arg("keygen").arg(dir.join("secret.key")).output();
            let keygen = keygen.context("run standby-server keygen")?;
            if !keygen.status.success() {
                return Err(anyhow!("standby-server keygen: {}", String::from_utf8_lossy(&keygen.stderr)));
            }
        }
        let mut servers = Vec::with_capacity(count);
        for index in 0..count {
            let mut args = spool_args(pool, heartbeat, &spool);
            if let Some(schema) = &schema {
                for (flag, value) in [
                    ("--store", OsString::from(schema.url())),
                    ("--replica-id", format!("r{index}").into()),
                    ("--lease-ttl", LEASE_TTL.into()),
                    // Every replica opens what any of them sealed.
                    ("--secret-key-file", dir.join("secret.key").into_os_string()),
                ] {
                    args.push(flag.into());
                    args.push(value);
                }
            }
            let name = format!("r{index}");
            // Replicas prove themselves to each other with one secret.
            let replicated = schema.is_some();
            let started = ServerProc::start_with(&name, server_bin, &dir.join(&name), &args, |server| {
                if replicated { server.cluster_secret(&dir.join("cluster.secret")) } else { server }
            })
            .await;
            match started {
                Ok(server) => servers.push(server),
                Err(error) => {
                    let replicas = Self { servers, schema };
                    let _ = replicas.stop().await;
                    return Err(error);
                }
            }
        }
        let replicas = Self { servers, schema };
        if replicas.schema.is_some() {
            let settled = wait_for("one leader and its followers", Duration::from_secs(60), async || {
                replicas.check_alive()?;
                let roles = replicas.roles().await?;
                Ok(roles.iter().filter(|role| *role == "leader").count() == 1
                    && roles.iter().all(|role| role == "leader" || role == "follower"))
            })
            .await;
            if let Err(error) = settled {
                let _ = replicas.stop().await;
                return Err(error);
            }
        }
        Ok(replicas)
    }

    /// Fails, with its log's end, if a server has exited (a deposed
    /// replica exits): the waits of a level end at once instead of timing out.
    pub fn check_alive(&self) -> Result<()> {
        match self.servers.iter().find(|server| !procfs::alive(server.pid)) {
            Some(server) => Err(anyhow!("the server {} exited:\n{}", server.name, server.log_tail(10))),
            None => Ok(()),
        }
    }

    /// Each server's role (`GET /v1/cluster`); `single` on SQLite.
    pub async fn roles(&self) -> Result<Vec<String>> {
        if self.schema.is_none() {
            return Ok(vec!["single".to_owned(); self.servers.len()]);
        }
        let http = http_client()?;
        let mut roles = Vec::with_capacity(self.servers.len());
        for server in &self.servers {
            let answer: Value = http
                .get(format!("{}/v1/cluster", server.url))
                .bearer_auth(API_KEY)
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .with_context(|| format!("GET /v1/cluster on {}", server.name))?
                .json()
                .await
                .with_context(|| format!("GET /v1/cluster on {}", server.name))?;
            roles.push(answer["role"].as_str().unwrap_or("unknown").to_owned());
        }
        Ok(roles)
    }

    /// The server the others link to (the only one on SQLite).
    pub async fn leader(&self) -> Result<usize> {
        let roles = self.roles().await?;
        roles
            .iter()
            .position(|role| role == "leader" || role == "single")
            .ok_or_else(|| anyhow!("no replica leads: {roles:?}"))
    }

    /// Stops every server, then drops the schema; the first error is
    /// returned once every server was tried.
    pub async fn stop(self) -> Result<()> {
        let mut first_error = None;
        for server in self.servers.into_iter().rev() {
            if let Err(error) = server.stop(Duration::from_secs(60)).await {
                first_error.get_or_insert(error);
            }
        }
        drop(self.schema);
        first_error.map_or(Ok(()), Err)
    }
}
