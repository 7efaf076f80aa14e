//! The reference control plane: the server half of the standby contract.
//!
//! Modules, one job each:
//! - [`rules`]: the server's rules as a pure state machine.
//! - [`policy`]: the pool's policy and its numeric rules (auto-stop floor,
//!   TTL schedule).
//! - [`store`]: durable records behind a trait; SQLite by default.
//! - `model`: the records; `credential`: tokens minted, kept as hashes.
//! - [`seal`]: what a run was submitted with, encrypted at rest.
//! - `engine`: drives the state machine: store first, then effects.
//! - [`config`]: `serve`'s flags, file and environment merged and validated.
//! - [`data_dir`]: the data directory's lock (a `serve` runs on it) and
//!   instance id.
//! - [`server`]: HTTP and the control socket on one listener: the router.
//! - `app`: what every handler shares (state, error answer, store reads).
//! - `agent_api`: the agent-facing contract's handlers.
//! - `user_api`: the user API's handlers; `problem`: its error shape.
//! - `ui`: the operators' status page at `/ui` (its assets compiled in),
//!   behind a session signed in with the API key.
//! - [`api_bounds`]: what one request may carry and one answer hold (pure).
//! - `metrics`: the Prometheus text of `/metrics`.
//! - `telemetry`: traces: the OTLP exporter and a started run's spans.
//! - [`listener`]: the accept loop: header timeout, connection cap.
//! - [`cluster`]: replicas on one PostgreSQL store: the lease, forwarding
//!   to the leader, the agents' sockets relayed.
//! - [`provider`]: where sandboxes come from: the trait, and the `local`,
//!   `docker` (a container per sandbox, Engine API) and `spool` (standby
//!   credentials as files, for load generation) providers, one module each,
//!   their timers' rules shared.
//! - [`containment`]: how the local provider keeps every process of a sandbox killable.
//!
//! # API boundary
//!
//! A module is `pub` only when another crate uses it, or a `pub` type
//! shows its types: the `standby-server` binary (`main.rs` and its demo:
//! `cluster`, `config`, `data_dir`, `listener`, `provider`, `seal`, `server`,
//! `store`), the integration tests (`api_bounds`, `rules`), and
//! `containment` and `policy`, whose choices the configuration holds. The
//! handlers, the engine, the records and the metrics are private to the
//! crate.

mod agent_api;
pub mod api_bounds;
mod app;
pub mod cluster;
pub mod config;
pub mod containment;
mod credential;
pub mod data_dir;
mod engine;
mod link;
pub mod listener;
mod metrics;
mod model;
pub mod policy;
mod problem;
pub mod provider;
pub mod rules;
pub mod seal;
pub mod server;
pub mod store;
mod telemetry;
mod ui;
mod user_api;
