//! The reference control plane: the server half of the standby contract.
//!
//! Modules, one job each:
//! - [`dispatch`]: the server's rules as a pure state machine.
//! - [`store`]: durable records behind a trait; SQLite by default.
//! - [`seal`]: what a run was submitted with, encrypted at rest.
//! - [`engine`]: drives the state machine: store first, then effects.
//! - [`config`]: `serve`'s flags, file and environment merged and validated.
//! - [`server`]: HTTP and the control socket on one listener: the router.
//! - `app`: what every handler shares (state, error answer, store reads).
//! - [`agent_api`]: the agent-facing contract's handlers.
//! - [`user_api`]: the user API's handlers.
//! - [`listener`]: the accept loop: header timeout, connection cap.
//! - [`provider`]: where sandboxes come from: the trait, and the `local`,
//!   `docker` (a container per sandbox, Engine API) and `spool` (standby
//!   credentials as files, for load generation) providers, one module each,
//!   their timers' rules shared.
//! - [`containment`]: how the local provider keeps every process of a sandbox killable.
//! - [`policy`]: the pool's numeric rules (auto-stop floor, TTL schedule).
//! - [`bounds`]: what one request may carry and one answer hold (pure).
//! - [`metrics`]: the Prometheus text of `/metrics`.

pub mod agent_api;
mod app;
pub mod bounds;
pub mod cluster;
pub mod config;
pub mod containment;
pub mod credential;
pub mod dispatch;
pub mod engine;
pub mod listener;
pub mod metrics;
pub mod model;
pub mod policy;
pub mod provider;
pub mod seal;
pub mod server;
pub mod store;
mod submit_checks;
pub mod user_api;
