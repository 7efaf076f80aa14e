//! The operators' status page at `/ui`: plain HTML, CSS and a little
//! JavaScript compiled into the binary (`ui/*.html`, `app.css`, `app.js`;
//! nothing to build, nothing fetched from elsewhere), and the JSON it
//! polls (`data`), all behind the API key.
//!
//! The key is typed once into the sign-in form (a `POST`, so never in a
//! URL or a browser's history) and exchanged for a session cookie
//! (`session`): `HttpOnly`, `SameSite=Strict`, `Path=/ui`, `Secure` when
//! the page is served over HTTPS. Every page and data call checks the
//! session; without one a page is answered with a redirect to the sign-in
//! form and a data call with `401`, never with data. The page's calls are
//! all `GET`s but sign-out, and the cookie goes only with requests the
//! page itself makes (`SameSite=Strict`), so no other site can act with
//! it.
//!
//! Every answer carries a strict Content-Security-Policy (scripts and
//! styles from this origin only, no inline script, no framing), `nosniff`,
//! `no-store` and `no-referrer`; the script shows every string as text
//! (`textContent`), never as markup. A run's command and thread id are a
//! user's input.
//!
//! A follower forwards `/ui` like any call to the leader, which holds the
//! sessions in memory: a failover (or a restart) signs everyone out.
//!
//! This module depends on `app` and on the user API's views (the page
//! shows what the API answers) and reads; nothing depends on it but the
//! router.

mod data;
mod session;
mod status;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use standby_protocol::Secret;

use self::session::Sessions;
use crate::app::{AppState, read_body};
use crate::problem::Problem;

/// The page, the sign-in form and their assets, compiled in.
const INDEX_HTML: &str = include_str!("ui/index.html");
const SIGN_IN_HTML: &str = include_str!("ui/signin.html");
const APP_CSS: &str = include_str!("ui/app.css");
const APP_JS: &str = include_str!("ui/app.js");

/// Where the page lives, and where one without a session is sent.
pub(crate) const PAGE: &str = "/ui";
pub(crate) const SIGN_IN: &str = "/ui/sign-in";
const SIGN_OUT: &str = "/ui/sign-out";

/// The largest sign-in body: a form with the key, with room to spare.
const SIGN_IN_BODY_MAX: usize = 4096;

/// How long a refused sign-in is held before its answer, one at a time
/// per process: at most one wrong guess a second, however many
/// connections try. (The key is as strong as the operator made it; the
/// bearer API has no such brake, so this keeps the form from being the
/// cheaper way to guess.)
const REFUSED_SIGN_IN_DELAY: Duration = Duration::from_secs(1);

/// What every `/ui` answer is served with. `connect-src 'self'` is what
/// the script's `fetch` needs; nothing else loads from anywhere.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
    form-action 'self'; base-uri 'none'; frame-ancestors 'none'";

/// The status page's state: the application's, its sessions, and whether
/// its public URL is HTTPS (then the cookie is always `Secure`).
#[derive(Clone)]
pub(crate) struct UiState {
    app: AppState,
    sessions: Arc<Sessions>,
    /// Refused sign-ins wait their turn on it ([`REFUSED_SIGN_IN_DELAY`]).
    refusals: Arc<tokio::sync::Mutex<()>>,
    public_https: bool,
}

impl UiState {
    /// Whether the request carries a live session.
    fn signed_in(&self, headers: &HeaderMap) -> bool {
        session::token(headers).is_some_and(|token| self.sessions.valid(token, Instant::now()))
    }
}

/// The `/ui` routes, with their own state. `public_url` is the server's
/// (`--public-url`), to tell whether the page is served over HTTPS.
pub(crate) fn routes(app: AppState, public_url: Option<&str>) -> Router {
    let state = UiState {
        app,
        sessions: Arc::new(Sessions::default()),
        refusals: Arc::new(tokio::sync::Mutex::new(())),
        public_https: public_url.is_some_and(|url| url.to_ascii_lowercase().starts_with("https://")),
    };
    Router::new()
        .route(PAGE, get(page))
        .route("/ui/", get(page))
        .route(SIGN_IN, get(sign_in_form).post(sign_in))
        .route(SIGN_OUT, post(sign_out))
        .route("/ui/app.css", get(|| async { asset("text/css; charset=utf-8", APP_CSS) }))
        .route("/ui/app.js", get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }))
        .route("/ui/api/summary", get(data::summary))
        .route("/ui/api/runs", get(data::runs))
        .route("/ui/api/sandboxes", get(data::sandboxes))
        .route("/ui/runs/{id}/log", get(log))
        .layer(axum::middleware::map_response(guarded))
        .with_state(state)
}

/// Adds the headers every `/ui` answer carries.
async fn guarded(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::CACHE_CONTROL, "no-store"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::HeaderName::from_static("cross-origin-opener-policy"), "same-origin"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

fn asset(content_type: &'static str, text: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

fn html(status: StatusCode, text: impl Into<Body>) -> Response {
    (status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], text.into()).into_response()
}

/// `303 See Other` to `to` (a `POST` is followed by a `GET`).
fn see_other(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// `GET /ui`: the page, or the sign-in form's address without a session.
async fn page(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    if !ui.signed_in(&headers) {
        return see_other(SIGN_IN);
    }
    html(StatusCode::OK, INDEX_HTML)
}

/// `GET /ui/sign-in`: the form (the page, when signed in already).
async fn sign_in_form(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    if ui.signed_in(&headers) {
        return see_other(PAGE);
    }
    html(StatusCode::OK, SIGN_IN_HTML)
}

/// The sign-in form saying that the last attempt failed, and nothing
/// more: not whether a key was given, nor how close it was.
fn refused_form() -> Response {
    let text = SIGN_IN_HTML.replace(r#"<p id="failed" role="alert" hidden>"#, r#"<p id="failed" role="alert">"#);
    html(StatusCode::UNAUTHORIZED, text)
}

/// `POST /ui/sign-in` (`key=<api key>`, form-encoded): a session and
/// `303` to the page, or `401` with the form. The key is compared in
/// constant time, as the API's bearer is, and never logged.
async fn sign_in(State(ui): State<UiState>, headers: HeaderMap, body: Body) -> Response {
    let key = match read_body(body, SIGN_IN_BODY_MAX).await {
        Ok(body) => form_urlencoded::parse(&body)
            .find(|(name, _)| name == "key")
            .map(|(_, value)| Secret::new(value.into_owned())),
        Err(unread) => return (unread.status(), unread.to_string()).into_response(),
    };
    match key {
        Some(key) if !key.expose().is_empty() && ui.app.api_key.matches(key.expose()) => {
            let token = ui.sessions.open(Instant::now());
            let secure = session::over_https(&headers, ui.public_https);
            let mut response = see_other(PAGE);
            if let Ok(cookie) = HeaderValue::from_str(&session::set_cookie(&token, secure)) {
                response.headers_mut().insert(header::SET_COOKIE, cookie);
            }
            tracing::info!("status page: signed in");
            response
        }
        _ => {
            let _turn = ui.refusals.lock().await;
            tokio::time::sleep(REFUSED_SIGN_IN_DELAY).await;
            tracing::info!("status page: a sign-in was refused");
            refused_form()
        }
    }
}

/// `POST /ui/sign-out`: ends the session here and in the browser; `303`
/// to the sign-in form. Refused when the browser says another site sent
/// it (`Sec-Fetch-Site`).
async fn sign_out(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    let site = headers.get("sec-fetch-site").and_then(|value| value.to_str().ok());
    if site.is_some_and(|site| !matches!(site, "same-origin" | "none")) {
        return Problem::new(StatusCode::FORBIDDEN, "sign-out comes from the status page only").into_response();
    }
    if let Some(token) = session::token(&headers) {
        ui.sessions.close(token);
    }
    let secure = session::over_https(&headers, ui.public_https);
    let mut response = see_other(SIGN_IN);
    if let Ok(cookie) = HeaderValue::from_str(&session::clear_cookie(secure)) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// `401` of a data call or a log read without a session: the script
/// sends the browser to the sign-in form.
fn no_session() -> Response {
    Problem::new(StatusCode::UNAUTHORIZED, "sign in to the status page first").into_response()
}

/// `GET /ui/runs/{id}/log`: the run's whole log, as `GET
/// /v1/runs/{id}/log` gives it, as plain text (never rendered: `nosniff`
/// and the policy forbid it).
async fn log(State(ui): State<UiState>, headers: HeaderMap, run_id: Result<Path<String>, PathRejection>) -> Response {
    if !ui.signed_in(&headers) {
        return no_session();
    }
    let run_id = match run_id {
        Ok(Path(run_id)) => run_id,
        Err(rejection) => return Problem::from(rejection).into_response(),
    };
    match crate::user_api::reads::log_answer(ui.app.clone(), run_id, 0, None).await {
        Ok(response) => response,
        Err(problem) => problem.into_response(),
    }
}
