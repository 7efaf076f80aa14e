//! The `standby` agent: prepares a sandbox before any run exists, holds a
//! control socket to the server, and on assignment installs the run and
//! starts it with as little on the critical path as possible.
//!
//! The lifecycle is decided by the pure state machine in `lifecycle`, and
//! when to reconnect by the pure policy in `reconnect`; the IO around them
//! (socket, HTTP, processes, terminal) lives in the other modules and is
//! driven by [`agent`]. The contract's rules (exit codes, stages and causes,
//! refusals, paths, the state directory) come from `standby_protocol`.
//!
//! # API boundary
//!
//! This library exists for the `standby` binary; what it exports is what
//! other crates use, and nothing else:
//! - `main.rs`: [`config::Args`] and [`config::Config`], [`agent::spec_source`]
//!   and [`agent::run`], [`logging`], [`tls::client_config`],
//!   [`process::make_undumpable`], [`api::install_tls_provider`],
//!   [`hold::run`] (`standby hold`, a container's PID 1);
//! - the fuzz target and the throughput example: [`redact::Redactor`];
//! - the soak test's simulated fleet: the reconnect bounds, as
//!   [`control::BACKOFF_MIN`], [`control::BACKOFF_CAP`] and
//!   [`control::STABLE_AFTER`].
//!
//! Everything else is `pub(crate)` or private.

pub mod agent;
pub mod api;
pub mod config;
pub mod control;
mod git;
pub mod hold;
mod hygiene;
mod install;
mod lifecycle;
pub mod logging;
mod logship;
mod mcp;
mod paths;
mod prepare;
pub mod process;
mod reaper;
mod reconnect;
pub mod redact;
mod shell;
mod telemetry;
mod time;
pub mod tls;
mod urls;
