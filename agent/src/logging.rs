//! Log setup: `tracing` to stderr, as text or JSON.
//!
//! Dependencies that handle frames, headers and TLS (tungstenite, hyper,
//! reqwest, h2, rustls, axum, rmcp) are capped at `info` whatever the filter
//! says: at `debug` and `trace` they print frame payloads, request headers
//! and MCP lines, which carry the run credential and the assignment.
//!
//! The caps are a filter of their own that every line must also pass, not
//! directives added to the user's: an `EnvFilter` lets the most specific
//! directive win, so `tungstenite::protocol=trace` would beat a
//! `tungstenite=info` cap, and a span directive (`[{field}]=trace`) enables
//! every target inside the span.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
use tracing_subscriber::layer::{Filter, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

use crate::config::LogFormat;

/// Target prefixes held at `info` at most: a target starting with one of
/// these (`tungstenite::protocol`, `hyper_util::client`) is capped.
const CAPPED_DEPENDENCIES: &[&str] =
    &["tungstenite", "tokio_tungstenite", "hyper", "h2", "reqwest", "rustls", "axum", "rmcp"];
/// The most a capped dependency logs.
const CAP: LevelFilter = LevelFilter::INFO;

/// The user's filter: `filter` (from `STANDBY_LOG`), else `RUST_LOG`, else
/// `info`. The caps apply on top of it (see [`init`]).
pub fn filter(filter: Option<&str>) -> Result<EnvFilter, String> {
    let requested = filter
        .map(str::to_owned)
        .or_else(|| std::env::var("RUST_LOG").ok())
        .filter(|f| !f.trim().is_empty())
        .unwrap_or_else(|| "info".to_owned());
    EnvFilter::builder().parse(&requested).map_err(|e| format!("`{requested}` is not a valid log filter: {e}"))
}

/// What every line must pass: the user's filter and the dependency caps.
fn capped<S: tracing::Subscriber + for<'a> LookupSpan<'a>>(user: EnvFilter) -> impl Filter<S> {
    let caps = Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_targets(CAPPED_DEPENDENCIES.iter().map(|target| (*target, CAP)));
    user.and(caps)
}

/// Installs the global subscriber (and the bridge from the `log` crate,
/// which tungstenite and reqwest log through). Fails only if one is
/// already installed.
pub fn init(filter: EnvFilter, format: LogFormat) -> Result<(), String> {
    // Colour only for a person at a terminal, never in collected logs.
    let ansi = std::io::stderr().is_terminal();
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(ansi);
    let result = match format {
        LogFormat::Text => tracing_subscriber::registry().with(layer.with_filter(capped(filter))).try_init(),
        LogFormat::Json => tracing_subscriber::registry()
            .with(layer.json().flatten_event(true).with_current_span(false).with_filter(capped(filter)))
            .try_init(),
    };
    result.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `target` logs at `trace` under `filter_text`, inside a span
    /// with a `credential` field.
    fn traces(filter_text: &str, target: &str) -> bool {
        let layer = tracing_subscriber::fmt::layer().with_writer(std::io::sink);
        let subscriber =
            tracing_subscriber::registry().with(layer.with_filter(capped(filter(Some(filter_text)).expect("valid"))));
        tracing::subscriber::with_default(subscriber, || {
            tracing::info_span!("span", credential = 1).in_scope(|| match target {
                "tungstenite::protocol" => tracing::enabled!(target: "tungstenite::protocol", tracing::Level::TRACE),
                "hyper_util::client" => tracing::enabled!(target: "hyper_util::client", tracing::Level::TRACE),
                "standby_agent::control" => tracing::enabled!(target: "standby_agent::control", tracing::Level::TRACE),
                other => panic!("no callsite for {other}"),
            })
        })
    }

    #[test]
    fn dependencies_stay_at_info_whatever_the_filter() {
        assert!(traces("trace", "standby_agent::control"), "our own trace is on");
        for filter in [
            "trace",
            "tungstenite=trace",
            "tungstenite::protocol=trace",
            "info,tungstenite::protocol[span]=trace",
            "[{credential}]=trace",
            "[span]=trace",
        ] {
            assert!(!traces(filter, "tungstenite::protocol"), "{filter} widened tungstenite");
            assert!(!traces(filter, "hyper_util::client"), "{filter} widened hyper_util");
        }
        assert!(traces("[{credential}]=trace", "standby_agent::control"), "span directives still work for our own");
    }

    #[test]
    fn bad_filter_is_named() {
        let error = filter(Some("standby=lots")).expect_err("invalid");
        assert!(error.contains("standby=lots"), "{error}");
    }
}
