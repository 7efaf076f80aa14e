//! HTTP calls to the server, and the one place errors are classified as
//! retryable or not.
//!
//! Every request carries the bearer credential and `Standby-Protocol: 1`.
//! A call is one attempt; [`retry`] repeats transient failures with jittered
//! exponential backoff (backon), honouring `Retry-After`, until a deadline.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use reqwest::{Method, StatusCode, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use standby_protocol::{PROTOCOL_HEADER, PROTOCOL_VERSION, Secret};
use tokio::time::Instant;

/// What to do about a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Worth another attempt: refused or reset connections, timeouts, `408`,
    /// `429` and `5xx`.
    Transient,
    /// `401` or `403`: this credential is not (or no longer) accepted.
    Unauthorized,
    /// `410`: the credential's subject is gone.
    Gone,
    /// Anything else: retrying cannot help.
    Fatal,
}

/// Classifies an HTTP status, for HTTP calls and WebSocket upgrades alike.
pub fn classify_status(status: StatusCode) -> Class {
    match status.as_u16() {
        401 | 403 => Class::Unauthorized,
        410 => Class::Gone,
        408 | 429 => Class::Transient,
        s if s >= 500 => Class::Transient,
        _ => Class::Fatal,
    }
}

/// A failed call, naming the call (method and path) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{call}: server answered {status}")]
    Status { call: String, status: StatusCode, retry_after: Option<Duration> },
    #[error("{call}: {source}")]
    Transport {
        call: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{call}: unexpected answer: {problem}")]
    Decode { call: String, problem: String },
    #[error("{call}: gave up after {attempts} attempts: {last}")]
    Exhausted { call: String, attempts: u32, last: Box<ApiError> },
}

impl ApiError {
    pub fn class(&self) -> Class {
        match self {
            Self::Status { status, .. } => classify_status(*status),
            Self::Transport { .. } => Class::Transient,
            Self::Decode { .. } => Class::Fatal,
            Self::Exhausted { last, .. } => match last.class() {
                Class::Transient => Class::Transient,
                other => other,
            },
        }
    }

    /// The HTTP status the server answered, if it answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(status.as_u16()),
            Self::Exhausted { last, .. } => last.status(),
            Self::Transport { .. } | Self::Decode { .. } => None,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// Parses `Retry-After`: delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = jiff::fmt::rfc2822::parse(value).ok()?.timestamp();
    let at = std::time::SystemTime::try_from(at).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

/// Installs the process-wide TLS provider (ring) that reqwest and
/// tungstenite use; reqwest is built without one. Idempotent: every place
/// that builds an HTTP client calls it first.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// A client for one server.
#[derive(Debug, Clone)]
pub struct Api {
    client: reqwest::Client,
    base: String,
}

impl Api {
    pub fn new(base: &reqwest::Url) -> Result<Self, reqwest::Error> {
        install_tls_provider();
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(60))
            .user_agent(concat!("standby/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self { client, base: base.as_str().trim_end_matches('/').to_owned() })
    }

    /// A path (starting with `/`) appended to the base URL, prefix kept; any
    /// other URL as is.
    pub fn url(&self, path_or_url: &str) -> String {
        if path_or_url.starts_with('/') { format!("{}{path_or_url}", self.base) } else { path_or_url.to_owned() }
    }

    async fn send(
        &self,
        method: Method,
        credential: &Secret,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, ApiError> {
        let call = format!("{method} {path}");
        let response = self.answer(method, credential, path, body).await?;
        if response.status().is_success() { Ok(response) } else { Err(refusal(call, &response)) }
    }

    /// One request, whatever the status of its answer.
    async fn answer(
        &self,
        method: Method,
        credential: &Secret,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, ApiError> {
        let call = format!("{method} {path}");
        let mut request = self
            .client
            .request(method, self.url(path))
            .bearer_auth(credential.expose())
            .header(PROTOCOL_HEADER, PROTOCOL_VERSION);
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await.map_err(|source| ApiError::Transport { call, source: source.without_url() })
    }

    /// One `GET`, decoded as JSON.
    pub async fn get_json<T: DeserializeOwned>(&self, credential: &Secret, path: &str) -> Result<T, ApiError> {
        let response = self.send(Method::GET, credential, path, None).await?;
        decode(format!("GET {path}"), response).await
    }

    /// One `POST` of `body` (an empty object when `None`), the answer decoded as JSON.
    pub async fn post_json<B: Serialize, T: DeserializeOwned>(
        &self,
        credential: &Secret,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ApiError> {
        let value = encode(path, body)?;
        let response = self.send(Method::POST, credential, path, Some(&value)).await?;
        decode(format!("POST {path}"), response).await
    }

    /// One `POST` whose answer only matters by its status (any `2xx`).
    pub async fn post<B: Serialize>(&self, credential: &Secret, path: &str, body: &B) -> Result<(), ApiError> {
        let value = encode(path, Some(body))?;
        self.send(Method::POST, credential, path, Some(&value)).await.map(drop)
    }

    /// One `POST` whose `409` answer carries a body the caller acts on (a
    /// log chunk's `{"received": n}`): `Ok(None)` for any `2xx`,
    /// `Ok(Some(body))` for a `409` with a body of type `C`, an error
    /// otherwise (a `409` without one included).
    pub async fn post_or_conflict<B: Serialize, C: DeserializeOwned>(
        &self,
        credential: &Secret,
        path: &str,
        body: &B,
    ) -> Result<Option<C>, ApiError> {
        let value = encode(path, Some(body))?;
        let call = format!("POST {path}");
        let response = self.answer(Method::POST, credential, path, Some(&value)).await?;
        let status = response.status();
        if status.is_success() {
            return Ok(None);
        }
        let error = refusal(call, &response);
        if status != StatusCode::CONFLICT {
            return Err(error);
        }
        match response.bytes().await {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|_| error),
            Err(_) => Err(error),
        }
    }

    /// One `GET` of raw bytes, at most `limit` of them.
    pub async fn get_bytes(&self, credential: &Secret, path_or_url: &str, limit: u64) -> Result<Vec<u8>, ApiError> {
        let call = format!("GET {path_or_url}");
        let mut response = self.send(Method::GET, credential, path_or_url, None).await?;
        let mut bytes = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|source| ApiError::Transport { call: call.clone(), source: source.without_url() })?
        {
            bytes.extend_from_slice(&chunk);
            if bytes.len() as u64 > limit {
                return Err(ApiError::Decode { call, problem: format!("body exceeds {limit} bytes") });
            }
        }
        Ok(bytes)
    }
}

/// The error for a non-`2xx` answer, with its `Retry-After`.
fn refusal(call: String, response: &reqwest::Response) -> ApiError {
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| parse_retry_after(v, std::time::SystemTime::now()));
    ApiError::Status { call, status: response.status(), retry_after }
}

fn encode<B: Serialize>(path: &str, body: Option<&B>) -> Result<serde_json::Value, ApiError> {
    match body {
        Some(body) => serde_json::to_value(body).map_err(|e| ApiError::Decode {
            call: format!("POST {path}"),
            problem: standby_protocol::describe_json_error(&e),
        }),
        None => Ok(serde_json::Value::Object(Default::default())),
    }
}

async fn decode<T: DeserializeOwned>(call: String, response: reqwest::Response) -> Result<T, ApiError> {
    let bytes = response
        .bytes()
        .await
        .map_err(|source| ApiError::Transport { call: call.clone(), source: source.without_url() })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::Decode { call, problem: standby_protocol::describe_json_error(&e) })
}

/// Backoff for HTTP calls: 100 ms doubling to 5 s, with jitter.
pub fn call_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
}

/// Runs `op` until it succeeds, fails with a non-transient error, or the
/// next attempt would start after `deadline`. A `Retry-After` longer than
/// the backoff's delay is honoured.
pub async fn retry<T, F, Fut>(
    call: &str,
    deadline: Instant,
    backoff: ExponentialBuilder,
    mut op: F,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ApiError>>,
{
    let mut delays = backoff.build();
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let error = match op().await {
            Ok(value) => return Ok(value),
            Err(error) if error.class() != Class::Transient => return Err(error),
            Err(error) => error,
        };
        let delay = delays.next().unwrap_or(Duration::from_secs(5)).max(error.retry_after().unwrap_or_default());
        if crate::time::after(Instant::now(), delay) >= deadline {
            return Err(ApiError::Exhausted { call: call.to_owned(), attempts, last: Box::new(error) });
        }
        tracing::debug!(call, attempt = attempts, delay_ms = delay.as_millis() as u64, error = %error, "retrying");
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification() {
        assert_eq!(classify_status(StatusCode::UNAUTHORIZED), Class::Unauthorized);
        assert_eq!(classify_status(StatusCode::FORBIDDEN), Class::Unauthorized);
        assert_eq!(classify_status(StatusCode::GONE), Class::Gone);
        assert_eq!(classify_status(StatusCode::TOO_MANY_REQUESTS), Class::Transient);
        assert_eq!(classify_status(StatusCode::SERVICE_UNAVAILABLE), Class::Transient);
        assert_eq!(classify_status(StatusCode::NOT_FOUND), Class::Fatal);
        assert_eq!(classify_status(StatusCode::BAD_REQUEST), Class::Fatal);
    }

    #[test]
    fn retry_after_forms() {
        let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        let date = "Sun, 09 Sep 2001 01:46:50 GMT"; // 10 s after `now`
        assert_eq!(parse_retry_after(date, now), Some(Duration::from_secs(10)));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_stops_at_the_deadline_and_on_fatal_errors() {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut calls = 0;
        let result: Result<(), _> = retry("GET /x", deadline, call_backoff(), || {
            calls += 1;
            async {
                Err(ApiError::Status { call: "GET /x".into(), status: StatusCode::BAD_GATEWAY, retry_after: None })
            }
        })
        .await;
        assert!(matches!(result, Err(ApiError::Exhausted { .. })));
        assert!(calls > 3, "{calls} attempts in 2 s of 100 ms-based backoff");

        let mut calls = 0;
        let result: Result<(), _> = retry("GET /y", deadline, call_backoff(), || {
            calls += 1;
            async { Err(ApiError::Status { call: "GET /y".into(), status: StatusCode::GONE, retry_after: None }) }
        })
        .await;
        assert!(matches!(result, Err(ApiError::Status { .. })));
        assert_eq!(calls, 1);
    }
}
