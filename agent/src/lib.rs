//! The `standby` agent: prepares a sandbox before any run exists, holds a
//! control socket to the server, and on assignment installs the run and
//! starts it with as little on the critical path as possible.
//!
//! The lifecycle is decided by the pure state machine in [`lifecycle`]; the
//! IO around it (socket, HTTP, processes, terminal) lives in the other
//! modules and is driven by [`agent`].

pub mod agent;
pub mod api;
pub mod attachments;
pub mod config;
pub mod control;
pub mod exit;
pub mod git;
pub mod hygiene;
pub mod install;
pub mod lifecycle;
pub mod logging;
pub mod logship;
pub mod mcp;
pub mod paths;
pub mod prepare;
pub mod process;
pub mod reaper;
pub mod redact;
pub mod shell;
pub mod time;
pub mod tls;
pub mod urls;
