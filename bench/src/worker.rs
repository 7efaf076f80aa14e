//! A load-generator worker: `standby-bench capacity-worker`, a child of
//! the spread capacity test ([`crate::spread_capacity`]). One process may
//! hold only as many sockets as its open-files limit allows, so the bench
//! re-executes itself as several of these, each under its own limit.
//!
//! Stdin carries [`Command`]s (one standby each: the replica to dial and
//! its credential); stdout carries [`Event`]s: the counts of its standbys
//! every half second, and each assignment frame read with the instant on
//! `CLOCK_MONOTONIC`, which the bench shares. Each standby behaves as in
//! [`crate::capacity`]: heartbeats `ready`, acts its run out once assigned.
//! The worker ends when its stdin closes.

use std::collections::HashMap;
use std::io::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::capacity::{Shared, standby};
use crate::procfs;
use crate::spread::{Command, Event};

/// The hidden subcommand the bench starts its workers with.
pub const SUBCOMMAND: &str = "capacity-worker";

/// How often the worker reports its counts.
const COUNTS_EVERY: Duration = Duration::from_millis(500);

pub async fn run(heartbeat: Duration) -> Result<()> {
    procfs::raise_open_files_limit();
    let (assignments, mut assigned) = mpsc::unbounded_channel::<(String, Instant)>();
    let mut servers: HashMap<String, Arc<Shared>> = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let (base_instant, base_ns) = (Instant::now(), procfs::monotonic_ns());
    let mut ticker = tokio::time::interval(COUNTS_EVERY);
    let mut stdout = std::io::stdout();
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let Some(line) = line.context("reading the bench's commands")? else { break };
                let Some(Command::Connect { url, credential }) = Command::decode(&line) else { continue };
                let shared = match servers.get(&url) {
                    Some(shared) => Arc::clone(shared),
                    None => {
                        let shared = Arc::new(Shared::for_url(&url, heartbeat, assignments.clone())?);
                        servers.insert(url, Arc::clone(&shared));
                        shared
                    }
                };
                tasks.spawn(standby(shared, credential));
            }
            Some((id, at)) = assigned.recv() => {
                let monotonic_ns = base_ns + at.saturating_duration_since(base_instant).as_nanos() as u64;
                writeln!(stdout, "{}", Event::Assigned { id, monotonic_ns }.encode()).context("writing to the bench")?;
                stdout.flush().context("writing to the bench")?;
            }
            _ = ticker.tick() => {
                let counts = Event::Counts {
                    connected: servers.values().map(|shared| shared.connected()).sum(),
                    failed: servers.values().map(|shared| shared.failed()).sum(),
                    lost: servers.values().map(|shared| shared.lost()).sum(),
                };
                writeln!(stdout, "{}", counts.encode()).context("writing to the bench")?;
                stdout.flush().context("writing to the bench")?;
            }
            Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
        }
    }
    tasks.abort_all();
    Ok(())
}
