//! End-to-end testing of the `standby` agent: [`server::TestServer`], the
//! server half of the contract as a recorder and fault injector over the
//! protocol crate's rules, and [`harness`], which runs the real binary
//! against it with real processes, git repos and sockets.

pub mod browser;
pub mod cluster;
pub mod docker;
pub mod harness;
pub mod kube_fake;
pub mod kustomize;
pub mod otlp;
pub mod postgres;
pub mod prometheus;
pub mod provider_runs;
pub mod proxy;
pub mod server;
pub mod server_process;
pub mod spooled;

pub use harness::{AgentBuilder, AgentProcess, GitRepo, standby_bin};
pub use server::TestServer;
