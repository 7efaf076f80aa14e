//! `standby`: parse the configuration, set up logging, run one agent life,
//! exit with its code. Everything else lives in the library.

use std::process::ExitCode;

use clap::Parser;
use standby_agent::config::Args;
use standby_agent::{agent, logging, tls};
use standby_protocol::ExitCode as Exit;

fn main() -> ExitCode {
    // `standby hold`: a container's PID 1 between agents (the Docker
    // provider). A word of its own rather than a flag: it takes none of
    // the agent's configuration, and needs none of it to be valid.
    // `standby clear` and `standby busy` ask it from an exec beside it
    // (the Kubernetes provider: no signal call there).
    if std::env::args_os().len() == 2 {
        match std::env::args_os().nth(1).as_deref().and_then(|word| word.to_str()) {
            Some("hold") => return standby_agent::hold::run(),
            Some("clear") => return standby_agent::hold::clear(),
            Some("busy") => return standby_agent::hold::busy(),
            _ => {}
        }
    }
    // First, before any credential is read: nothing of the same user may
    // read this process's environment or memory.
    let undumpable = standby_agent::process::make_undumpable();
    // Usage errors exit 2 (clap's own code), `--help`/`--version` exit 0.
    let args = Args::parse();
    let format = args.log_format;
    let filter = match logging::filter(args.log_filter.as_deref()) {
        Ok(filter) => filter,
        Err(message) => return usage(&format!("invalid STANDBY_LOG (--log): {message}")),
    };
    let config = match args.validate() {
        Ok(config) => config,
        Err(error) => return usage(&error.to_string()),
    };
    let spec_source = match agent::spec_source(&config) {
        Ok(source) => source,
        Err(message) => return usage(&message),
    };
    if let Err(message) = logging::init(filter, format) {
        eprintln!("standby: cannot set up logging: {message}");
        return Exit::Internal.into();
    }
    if let Err(error) = undumpable {
        tracing::warn!(%error, "cannot make the agent non-dumpable; processes of its user can read its memory");
    }
    standby_agent::api::install_tls_provider();
    // Reading the CA file is IO, so it follows validation (and logging, for
    // what loading the system's roots reports); a file that cannot be used
    // is bad configuration all the same.
    let tls = match tls::client_config(config.ca_file.as_deref()) {
        Ok(tls) => tls,
        Err(error) => return usage(&error.to_string()),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("standby: cannot start the async runtime: {e}");
            return Exit::Internal.into();
        }
    };
    tracing::info!(version = standby_agent::config::VERSION, server = %config.server_url, workspace = %config.workspace.display(), "standby starting");
    runtime.block_on(agent::run(config, spec_source, tls)).into()
}

fn usage(message: &str) -> ExitCode {
    eprintln!("standby: {message}");
    Exit::Usage.into()
}
