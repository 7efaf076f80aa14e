//! Log setup: `tracing` to stderr, as text or JSON.
//!
//! Dependencies that handle frames and headers (tungstenite, hyper, reqwest,
//! h2, rustls, rmcp) are capped at `info` whatever the filter says: at
//! `debug` and `trace` they print frame payloads, request headers and MCP
//! lines, which carry the run credential and the assignment.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

const CAPPED_DEPENDENCIES: &[&str] =
    &["tungstenite", "tokio_tungstenite", "hyper", "hyper_util", "reqwest", "h2", "rustls", "axum", "rmcp"];

/// The filter the agent logs with: `filter` (from `STANDBY_LOG`), else
/// `RUST_LOG`, else `info`, with the dependency caps appended last so they
/// win over a broad user directive.
pub fn filter(filter: Option<&str>) -> Result<EnvFilter, String> {
    let requested = filter
        .map(str::to_owned)
        .or_else(|| std::env::var("RUST_LOG").ok())
        .filter(|f| !f.trim().is_empty())
        .unwrap_or_else(|| "info".to_owned());
    let caps = CAPPED_DEPENDENCIES.iter().map(|target| format!("{target}=info"));
    let directives = std::iter::once(requested.clone()).chain(caps).collect::<Vec<_>>().join(",");
    EnvFilter::builder().parse(&directives).map_err(|e| format!("`{requested}` is not a valid log filter: {e}"))
}

/// Installs the global subscriber. Fails only if one is already installed.
pub fn init(filter: EnvFilter, format: LogFormat) -> Result<(), String> {
    // Colour only for a person at a terminal, never in collected logs.
    let ansi = std::io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(false).try_init(),
    };
    result.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled_under(filter_text: &str, target_is_dependency: bool) -> bool {
        use tracing_subscriber::layer::SubscriberExt;
        let subscriber = tracing_subscriber::registry().with(filter(Some(filter_text)).expect("valid"));
        tracing::subscriber::with_default(subscriber, || {
            if target_is_dependency {
                tracing::enabled!(target: "tungstenite::protocol", tracing::Level::TRACE)
            } else {
                tracing::enabled!(target: "standby_agent::control", tracing::Level::TRACE)
            }
        })
    }

    #[test]
    fn dependencies_stay_at_info_whatever_the_filter() {
        assert!(enabled_under("trace", false), "our own trace is on");
        assert!(!enabled_under("trace", true), "a broad trace does not reach tungstenite");
        assert!(!enabled_under("tungstenite=trace", true), "nor does an explicit one");
    }

    #[test]
    fn bad_filter_is_named() {
        let error = filter(Some("standby=lots")).expect_err("invalid");
        assert!(error.contains("standby=lots"), "{error}");
    }
}
