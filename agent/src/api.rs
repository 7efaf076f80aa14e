//! HTTP calls to the server, and the one place a failed call is read as
//! retryable or not (a status by the contract's [`Answer`]).
//!
//! A request to the server's origin carries the bearer credential and
//! `Standby-Protocol: 1`; one to any other origin (an attachment's
//! pre-signed URL) carries neither, and no redirect leaves the origin a
//! request was sent to. Answers are read with a cap. A call is one attempt; [`retry`] repeats transient failures with jittered
//! exponential backoff (backon), honouring `Retry-After`, until a deadline.

use std::sync::Arc;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use reqwest::{Method, StatusCode, Url, header};
use serde::Serialize;
use serde::de::DeserializeOwned;
use standby_protocol::{Answer, PROTOCOL_HEADER, PROTOCOL_VERSION, Refusal, Secret};
use tokio::time::Instant;

use crate::urls::{describe_url, same_origin};

/// A failed call, naming the call (method and path) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
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
    /// The answer is larger than the agent reads for this call.
    #[error("{call}: the answer exceeds the cap of {} ({cap} bytes)", human_bytes(*cap))]
    TooLarge { call: String, cap: u64 },
    /// Not attempted or not followed: off the server's origin over plain
    /// http, or a redirect to another origin.
    #[error("{call}: {problem}")]
    Refused { call: String, problem: String },
    #[error("{call}: gave up after {attempts} attempts: {last}")]
    Exhausted { call: String, attempts: u32, last: Box<ApiError> },
    /// No answer within the caller's bound for one attempt.
    #[error("{call}: no answer within {}", humantime::format_duration(*bound))]
    Unanswered { call: String, bound: Duration },
}

impl ApiError {
    /// What the failure means to the caller, as the contract reads an
    /// answer: a call that got no answer counts as a transient one, an
    /// answer the agent would not read (too large, off the origin) as fatal.
    pub(crate) fn answer(&self) -> Answer {
        match self {
            Self::Status { status, .. } => Answer::of(status.as_u16()),
            Self::Transport { .. } | Self::Unanswered { .. } => Answer::Transient,
            Self::Decode { .. } | Self::TooLarge { .. } | Self::Refused { .. } => Answer::Fatal,
            Self::Exhausted { last, .. } => last.answer(),
        }
    }

    /// The credential's refusal, if the server refused it.
    pub(crate) fn refusal(&self) -> Option<Refusal> {
        match self.answer() {
            Answer::Refused(refusal) => Some(refusal),
            Answer::Success | Answer::Transient | Answer::Fatal => None,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// `1 MiB`, `64 KiB` or `100 bytes`: a cap as people read it.
pub(crate) fn human_bytes(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

/// Parses `Retry-After`: delay-seconds or an HTTP date.
pub(crate) fn parse_retry_after(value: &str, now: std::time::SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = jiff::fmt::rfc2822::parse(value).ok()?.timestamp();
    let at = std::time::SystemTime::try_from(at).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

/// Installs the process-wide TLS provider (ring) for the clients that do
/// not take the agent's own configuration ([`crate::tls`]): reqwest is built
/// without one. Idempotent.
pub fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Largest JSON answer read from any call (spec, secrets, attachments list,
/// git and cloud credentials, metadata): read by streaming and abandoned at
/// the cap, so a broken or hostile server cannot grow the agent's memory.
pub(crate) const MAX_JSON_BYTES: u64 = 1 << 20;

/// Most redirects followed for one request.
const MAX_REDIRECTS: usize = 10;

/// A redirect the agent does not follow; its URLs are described without
/// query strings.
#[derive(Debug, thiserror::Error)]
enum RedirectRefused {
    #[error("redirect from {from} to {to} leaves the origin the request was sent to; not followed")]
    CrossOrigin { from: String, to: String },
    #[error("more than {MAX_REDIRECTS} redirects")]
    TooMany,
}

/// Redirects are followed only within the origin a request was sent to
/// (amendment 2): a server cannot bounce the run credential, or a
/// pre-signed URL's request, to another origin.
fn redirect_policy() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let Some(first) = attempt.previous().first() else {
            return attempt.follow();
        };
        if !same_origin(first, attempt.url()) {
            let refused = RedirectRefused::CrossOrigin {
                from: describe_url(first.as_str()),
                to: describe_url(attempt.url().as_str()),
            };
            return attempt.error(refused);
        }
        if attempt.previous().len() > MAX_REDIRECTS {
            return attempt.error(RedirectRefused::TooMany);
        }
        attempt.follow()
    })
}

/// A client for one server.
#[derive(Debug, Clone)]
pub(crate) struct Api {
    client: reqwest::Client,
    base: String,
    server: Url,
    insecure: bool,
    /// The trust store the client was built with, for [`Api::fresh`].
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Api {
    /// A client trusting the system's roots, for loopback test servers.
    #[cfg(test)]
    pub(crate) fn new(base: &Url) -> Result<Self, reqwest::Error> {
        Self::build(base, None, false)
    }

    /// The agent's client: `tls` is the one trust store it shares with the
    /// control socket; `insecure` allows plain http to attachments off
    /// loopback.
    pub(crate) fn with_tls(base: &Url, tls: Arc<rustls::ClientConfig>, insecure: bool) -> Result<Self, reqwest::Error> {
        Self::build(base, Some(tls), insecure)
    }

    fn build(base: &Url, tls: Option<Arc<rustls::ClientConfig>>, insecure: bool) -> Result<Self, reqwest::Error> {
        install_tls_provider();
        let mut builder = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(60))
            .redirect(redirect_policy())
            .user_agent(concat!("standby/", env!("CARGO_PKG_VERSION")));
        if let Some(tls) = &tls {
            builder = builder.tls_backend_preconfigured(rustls::ClientConfig::clone(tls));
        }
        Ok(Self {
            client: builder.build()?,
            base: base.as_str().trim_end_matches('/').to_owned(),
            server: base.clone(),
            insecure,
            tls,
        })
    }

    /// The same client with a connection pool of its own, for a call that
    /// went unanswered: its next try must not wait on another idle
    /// connection of the same pool. A sandbox cut from its network and
    /// connected again (a container's `docker network disconnect`) keeps
    /// its pooled connections, and their packets are silently dropped from
    /// then on; each try on one of them costs a whole attempt bound, and a
    /// pool of them outlasted the log's drain bound (the Docker soak lost
    /// the end of a log that way, and a final event waited on them).
    pub(crate) fn fresh(&self) -> Self {
        match Self::build(&self.server, self.tls.clone(), self.insecure) {
            Ok(fresh) => fresh,
            Err(error) => {
                tracing::warn!(%error, "cannot build a new HTTP client; the old one's connections are reused");
                self.clone()
            }
        }
    }

    /// The server's base URL.
    pub(crate) fn server(&self) -> &Url {
        &self.server
    }

    /// Plain http allowed off loopback.
    pub(crate) fn insecure(&self) -> bool {
        self.insecure
    }

    /// A path (starting with `/`) appended to the base URL, prefix kept; any
    /// other URL as is.
    pub(crate) fn url(&self, path_or_url: &str) -> String {
        if path_or_url.starts_with('/') { format!("{}{path_or_url}", self.base) } else { path_or_url.to_owned() }
    }

    /// Sends one request; a non-`2xx` answer is an error.
    pub(crate) async fn send(
        &self,
        method: Method,
        credential: &Secret,
        path_or_url: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, ApiError> {
        let call = call_name(&method, path_or_url);
        let response = self.answer(method, credential, path_or_url, body, &call).await?;
        if response.status().is_success() { Ok(response) } else { Err(refusal(call, &response)) }
    }

    /// One request, whatever the status of its answer. This is the one
    /// place a credential is attached (amendment 2): only a request to the
    /// server's origin carries it and the protocol header; one to any other
    /// origin (a pre-signed object-store URL) carries neither.
    async fn answer(
        &self,
        method: Method,
        credential: &Secret,
        path_or_url: &str,
        body: Option<&serde_json::Value>,
        call: &str,
    ) -> Result<reqwest::Response, ApiError> {
        let url = Url::parse(&self.url(path_or_url))
            .map_err(|e| ApiError::Refused { call: call.to_owned(), problem: format!("not a URL: {e}") })?;
        let mut request = self.client.request(method, url.clone());
        if same_origin(&self.server, &url) {
            request = request.bearer_auth(credential.expose()).header(PROTOCOL_HEADER, PROTOCOL_VERSION);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        request.send().await.map_err(|source| transport(call, source))
    }

    /// One `GET`, decoded as JSON (at most [`MAX_JSON_BYTES`] of it).
    pub(crate) async fn get_json<T: DeserializeOwned>(&self, credential: &Secret, path: &str) -> Result<T, ApiError> {
        let response = self.send(Method::GET, credential, path, None).await?;
        decode(call_name(&Method::GET, path), response).await
    }

    /// One `POST` of `body` (an empty object when `None`), the answer decoded as JSON.
    pub(crate) async fn post_json<B: Serialize, T: DeserializeOwned>(
        &self,
        credential: &Secret,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ApiError> {
        let value = encode(path, body)?;
        let response = self.send(Method::POST, credential, path, Some(&value)).await?;
        decode(call_name(&Method::POST, path), response).await
    }

    /// One `POST` whose answer only matters by its status (any `2xx`).
    pub(crate) async fn post<B: Serialize>(&self, credential: &Secret, path: &str, body: &B) -> Result<(), ApiError> {
        let value = encode(path, Some(body))?;
        self.send(Method::POST, credential, path, Some(&value)).await.map(drop)
    }

    /// One `POST` whose `409` answer carries a body the caller acts on (a
    /// log chunk's `{"received": n}`): `Ok(None)` for any `2xx`,
    /// `Ok(Some(body))` for a `409` with a body of type `C`, an error
    /// otherwise (a `409` without one included).
    pub(crate) async fn post_or_conflict<B: Serialize, C: DeserializeOwned>(
        &self,
        credential: &Secret,
        path: &str,
        body: &B,
    ) -> Result<Option<C>, ApiError> {
        let value = encode(path, Some(body))?;
        let call = call_name(&Method::POST, path);
        let response = self.answer(Method::POST, credential, path, Some(&value), &call).await?;
        let status = response.status();
        if status.is_success() {
            return Ok(None);
        }
        let error = refusal(call.clone(), &response);
        if status != StatusCode::CONFLICT {
            return Err(error);
        }
        match read_capped(&call, response, MAX_JSON_BYTES).await {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|_| error),
            Err(_) => Err(error),
        }
    }
}

/// How a call is named in errors and logs: the method and the URL or path,
/// without a query string.
pub(crate) fn call_name(method: &Method, path_or_url: &str) -> String {
    format!("{method} {}", describe_url(path_or_url))
}

/// A request that got no answer. A refused redirect is final; anything
/// else (refused, reset, timed out) is transient. The URL is dropped from
/// reqwest's message: the call names it, without its query string.
pub(crate) fn transport(call: &str, error: reqwest::Error) -> ApiError {
    if error.is_redirect() {
        let problem =
            std::error::Error::source(&error).map_or_else(|| "a redirect was refused".to_owned(), ToString::to_string);
        return ApiError::Refused { call: call.to_owned(), problem };
    }
    ApiError::Transport { call: call.to_owned(), source: error.without_url() }
}

/// Reads a body to its end, failing at `cap` bytes without reading further.
pub(crate) async fn read_capped(call: &str, mut response: reqwest::Response, cap: u64) -> Result<Vec<u8>, ApiError> {
    let too_large = || ApiError::TooLarge { call: call.to_owned(), cap };
    if response.content_length().is_some_and(|length| length > cap) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|source| transport(call, source))? {
        if (bytes.len() + chunk.len()) as u64 > cap {
            return Err(too_large());
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
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
    let bytes = read_capped(&call, response, MAX_JSON_BYTES).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::Decode { call, problem: standby_protocol::describe_json_error(&e) })
}

/// Backoff for HTTP calls: 100 ms doubling to 5 s, with jitter.
pub(crate) fn call_backoff() -> ExponentialBuilder {
    ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
}

/// Runs `op` until it succeeds, fails with a non-transient error, or the
/// next attempt would start after `deadline`. A `Retry-After` longer than
/// the backoff's delay is honoured.
pub(crate) async fn retry<T, F, Fut>(
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
            Err(error) if error.answer() != Answer::Transient => return Err(error),
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
        let status = |status: StatusCode| ApiError::Status { call: "GET /x".into(), status, retry_after: None };
        let cases = [
            (StatusCode::UNAUTHORIZED, Answer::Refused(Refusal::Unauthorized)),
            (StatusCode::FORBIDDEN, Answer::Refused(Refusal::Unauthorized)),
            (StatusCode::GONE, Answer::Refused(Refusal::Gone)),
            (StatusCode::TOO_MANY_REQUESTS, Answer::Transient),
            (StatusCode::SERVICE_UNAVAILABLE, Answer::Transient),
            (StatusCode::NOT_FOUND, Answer::Fatal),
            (StatusCode::BAD_REQUEST, Answer::Fatal),
        ];
        for (code, expected) in cases {
            assert_eq!(status(code).answer(), expected, "{code}");
            let exhausted = ApiError::Exhausted { call: "GET /x".into(), attempts: 2, last: Box::new(status(code)) };
            assert_eq!(exhausted.answer(), expected, "{code}, after retries");
        }
        assert_eq!(status(StatusCode::GONE).refusal(), Some(Refusal::Gone));
        assert_eq!(status(StatusCode::BAD_GATEWAY).refusal(), None);
        assert_eq!(ApiError::TooLarge { call: "GET /x".into(), cap: 1 }.answer(), Answer::Fatal);
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
