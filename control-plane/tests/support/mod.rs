//! The server these suites talk to over real HTTP on 127.0.0.1: the
//! `spool` provider (sandboxes are credential files, nothing launches) and
//! an in-memory SQLite store.

use std::sync::Arc;

use standby_control_plane::provider::spool::SpoolProvider;
use standby_control_plane::server::{RunningServer, ServerConfig, start};
use standby_control_plane::store::SqliteStore;
use standby_protocol::{Secret, Spec};

/// A started server with API key `key` and a pool of `pool_size`, and the
/// spool directory it lives on (removed when dropped).
pub async fn spool_server(key: &str, pool_size: usize) -> (RunningServer<SpoolProvider>, tempfile::TempDir) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let spool = tempfile::tempdir().expect("a spool dir");
    let mut config = ServerConfig::new(Secret::new(key), Spec::default());
    config.pool_size = pool_size;
    let store = Arc::new(SqliteStore::in_memory().expect("a store"));
    let provider = Arc::new(SpoolProvider::new(spool.path().to_owned()));
    let server = start(config, store, provider).await.expect("the server starts");
    (server, spool)
}
