//! A PostgreSQL schema of a test's own, on the database named by
//! `STANDBY_TEST_POSTGRES` (`scripts/postgres` starts one and prints its
//! URL; `.ci/run` exports it). Each test gets a fresh schema, dropped when it
//! ends, so tests run in parallel on one database.
//!
//! Where PostgreSQL is missing or unreachable a test fails under `CI=true`
//! (CI provides it) and is skipped elsewhere, saying so loudly.

use std::hash::{BuildHasher as _, RandomState};

use tokio_postgres::NoTls;

/// The variable holding the test database's URL.
pub const URL_VAR: &str = "STANDBY_TEST_POSTGRES";

/// A schema made for one test; dropped (with everything in it) on drop.
#[derive(Debug)]
pub struct TestSchema {
    base: String,
    schema: String,
}

impl TestSchema {
    /// A fresh schema for `test`, or `None` (after a loud message) where no
    /// PostgreSQL is reachable outside CI. Panics under `CI=true` instead.
    pub fn create(test: &str) -> Option<Self> {
        let Some(base) = std::env::var(URL_VAR).ok().filter(|url| !url.is_empty()) else {
            unavailable(test, &format!("{URL_VAR} is unset"));
            return None;
        };
        match Self::on(&base, test) {
            Ok(schema) => Some(schema),
            Err(problem) => {
                unavailable(test, &format!("the database of {URL_VAR} is unreachable: {problem}"));
                None
            }
        }
    }

    /// A fresh schema for `owner` on the database at `base`: for a caller
    /// given its database (the benchmarks' `--store`), which reports a
    /// missing one itself.
    pub fn on(base: &str, owner: &str) -> Result<Self, String> {
        let schema = format!("t_{:016x}", RandomState::new().hash_one((owner, std::process::id())));
        off_runtime(|| async {
            let client = connect(base).await?;
            client.batch_execute(&format!("CREATE SCHEMA {schema}")).await.map_err(|e| describe(&e))
        })?;
        Ok(Self { base: base.to_owned(), schema })
    }

    /// The connection URL whose tables live in this schema (its
    /// `search_path`).
    pub fn url(&self) -> String {
        let separator = if self.base.contains('?') { '&' } else { '?' };
        format!("{}{separator}options=-csearch_path%3D{}", self.base, self.schema)
    }

    /// [`Self::url`] as `standby_test_app`, a role that may only log in
    /// (`scripts/postgres` makes it): a test grants it what a runtime role
    /// gets. `None` (after a loud message, or a panic under CI) where the
    /// role is missing.
    pub fn runtime_url(&self, test: &str) -> Option<String> {
        let exists = self.query_text("SELECT rolname::text FROM pg_roles WHERE rolname = 'standby_test_app'");
        if exists.is_empty() {
            unavailable(test, "the role standby_test_app is missing (scripts/postgres makes it)");
            return None;
        }
        let url = self.url();
        let (scheme, rest) = url.split_once("://")?;
        let host = rest.split_once('@').map_or(rest, |(_, host)| host);
        Some(format!("{scheme}://standby_test_app:standby_test_app@{host}"))
    }

    pub fn name(&self) -> &str {
        &self.schema
    }

    /// Runs `sql` (one or more statements) in the schema.
    pub fn execute(&self, sql: &str) {
        let url = self.url();
        off_runtime(|| async move { connect(&url).await?.batch_execute(sql).await.map_err(|e| describe(&e)) })
            .unwrap_or_else(|problem| panic!("{sql}: {problem}"));
    }

    /// The first column of every row `sql` returns, as text.
    pub fn query_text(&self, sql: &str) -> Vec<String> {
        let url = self.url();
        off_runtime(|| async move {
            let rows = connect(&url).await?.query(sql, &[]).await.map_err(|e| describe(&e))?;
            rows.iter().map(|row| row.try_get::<_, String>(0).map_err(|e| describe(&e))).collect()
        })
        .unwrap_or_else(|problem| panic!("{sql}: {problem}"))
    }

    /// Runs `sql` in a transaction of its own that stays open, holding the
    /// locks `sql` took, until the returned guard is dropped (then rolled
    /// back): a writer frozen inside its transaction, as the database sees
    /// it. Returns once `sql` has run.
    pub fn hold(&self, sql: &str) -> HeldTransaction {
        let (url, statements) = (self.url(), sql.to_owned());
        let (locked, is_locked) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
            runtime.block_on(async move {
                let mut client = match connect(&url).await {
                    Ok(client) => client,
                    Err(problem) => return drop(locked.send(Err(problem))),
                };
                let transaction = match client.transaction().await {
                    Ok(transaction) => transaction,
                    Err(error) => return drop(locked.send(Err(describe(&error)))),
                };
                if let Err(error) = transaction.batch_execute(&statements).await {
                    return drop(locked.send(Err(describe(&error))));
                }
                let _ = locked.send(Ok(()));
                let _ = tokio::task::spawn_blocking(move || released.recv()).await;
                let _ = transaction.rollback().await;
            });
        });
        match is_locked.recv() {
            Ok(Ok(())) => HeldTransaction { release: Some(release), thread: Some(thread) },
            Ok(Err(problem)) => panic!("{sql}: {problem}"),
            Err(_) => panic!("{sql}: the holding thread ended"),
        }
    }

    /// Every row of every table of the schema, as PostgreSQL prints it:
    /// everything the store keeps there.
    pub fn dump(&self) -> String {
        let tables = self.query_text(&format!(
            "SELECT table_name::text FROM information_schema.tables WHERE table_schema = '{}'",
            self.schema
        ));
        let rows: Vec<String> =
            tables.iter().flat_map(|table| self.query_text(&format!("SELECT t::text FROM {table} t"))).collect();
        rows.join("\n")
    }
}

/// A transaction of [`TestSchema::hold`], rolled back when dropped.
#[derive(Debug)]
pub struct HeldTransaction {
    release: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for HeldTransaction {
    fn drop(&mut self) {
        drop(self.release.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        let (base, schema) = (&self.base, &self.schema);
        let dropped = off_runtime(|| async move {
            connect(base).await?.batch_execute(&format!("DROP SCHEMA {schema} CASCADE")).await.map_err(|e| describe(&e))
        });
        if let Err(problem) = dropped {
            eprintln!("the test schema {schema} was not dropped: {problem}");
        }
    }
}

fn unavailable(test: &str, why: &str) {
    if std::env::var("CI").is_ok_and(|ci| ci == "true") {
        panic!("{test} needs PostgreSQL, which CI provides (.ci/run, scripts/postgres): {why}");
    }
    eprintln!(
        "\n*** SKIPPED {test}: it needs PostgreSQL and {why}.\n*** Run `export {URL_VAR}=\"$(scripts/postgres)\"` \
         (as root) to run it; under CI=true it fails instead.\n"
    );
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, String> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.map_err(|e| describe(&e))?;
    tokio::spawn(connection);
    Ok(client)
}

/// Runs `work` on a runtime of its own on a thread of its own: callable from
/// plain tests and from inside another runtime alike.
fn off_runtime<F, Fut, T>(work: F) -> Result<T, String>
where
    F: FnOnce() -> Fut + Send,
    Fut: Future<Output = Result<T, String>>,
    T: Send,
{
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| format!("cannot start a runtime: {e}"))?;
                runtime.block_on(work())
            })
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// The error with its causes: the driver's own text is terse ("db error").
fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
