//! End-to-end testing of the `standby` agent: [`server::TestServer`], a
//! faithful server half of the contract, and [`harness`], which runs the
//! real binary against it with real processes, git repos and sockets.

pub mod harness;
pub mod postgres;
pub mod proxy;
pub mod server;
pub mod server_process;

pub use harness::{AgentBuilder, AgentProcess, GitRepo, standby_bin};
pub use server::TestServer;
