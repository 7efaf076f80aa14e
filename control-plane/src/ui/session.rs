//! The status page's sessions: the API key is given once, to the sign-in
//! form, and the browser holds a random session token in a cookie from
//! then on, so the key is never kept by the browser, put in a URL or sent
//! with every poll.
//!
//! The server keeps only each token's SHA-256, in memory, in a bounded
//! table with an absolute lifetime: a stolen table gives no way in, a
//! restart (or a failover: the new leader's table is empty) signs everyone
//! out, and no number of sign-ins grows it past [`MAX_SESSIONS`]. Time is
//! passed in, so the rules are tested without waiting.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, header};
use base64::Engine as _;
use rand::RngCore as _;
use sha2::{Digest, Sha256};
use standby_protocol::Secret;

/// The cookie's name.
pub(crate) const COOKIE: &str = "standby_session";

/// How long a session lasts from its sign-in, used or not: an operator's
/// working day. The cookie itself has no expiry (it ends with the browser).
pub(crate) const LIFETIME: Duration = Duration::from_secs(12 * 3600);

/// Sessions held at once. The oldest is dropped for a new one past it: a
/// flood of sign-ins (each needs the key) signs others out, nothing more.
pub(crate) const MAX_SESSIONS: usize = 256;

/// The live sessions: token hash → when it ends.
#[derive(Debug, Default)]
pub(crate) struct Sessions {
    table: Mutex<HashMap<[u8; 32], Instant>>,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Sessions {
    /// A new session: its token, to be given to the browser once.
    pub(crate) fn open(&self, now: Instant) -> Secret {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        let token = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if table.len() >= MAX_SESSIONS {
            table.retain(|_, ends| *ends > now);
        }
        if table.len() >= MAX_SESSIONS
            && let Some(oldest) = table.iter().min_by_key(|(_, ends)| **ends).map(|(hash, _)| *hash)
        {
            table.remove(&oldest);
        }
        table.insert(digest(&token), now + LIFETIME);
        Secret::new(token)
    }

    /// Whether `token` names a live session (an ended one is forgotten).
    pub(crate) fn valid(&self, token: &str, now: Instant) -> bool {
        let hash = digest(token);
        let mut table = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        match table.get(&hash) {
            Some(ends) if *ends > now => true,
            Some(_) => {
                table.remove(&hash);
                false
            }
            None => false,
        }
    }

    /// Ends the session of `token` (sign-out).
    pub(crate) fn close(&self, token: &str) {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).remove(&digest(token));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

/// The session token of the request's `Cookie` headers, if any.
pub(crate) fn token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty())
}

/// Whether the browser reached the page over HTTPS: the public URL says
/// so (`--public-url https://…`, a proxy terminating TLS in front), or
/// the proxy that forwarded the request does (`X-Forwarded-Proto: https`,
/// `Forwarded: proto=https`). The server itself never terminates TLS.
/// Believing the header needs no trust in who sent it: it can only make
/// the cookie stricter (`Secure`), never weaker.
pub(crate) fn over_https(headers: &HeaderMap, public_https: bool) -> bool {
    let said = |name: &str, https: &dyn Fn(&str) -> bool| {
        headers.get_all(name).iter().filter_map(|value| value.to_str().ok()).any(https)
    };
    public_https
        || said("x-forwarded-proto", &|value| value.split(',').next().is_some_and(|v| v.trim() == "https"))
        || said("forwarded", &|value| {
            value.split([';', ',']).filter_map(|pair| pair.trim().split_once('=')).any(|(name, value)| {
                name.eq_ignore_ascii_case("proto") && value.trim_matches('"').eq_ignore_ascii_case("https")
            })
        })
}

/// The `Set-Cookie` value that hands the browser `token`: only for `/ui`,
/// never readable by script, never sent with a request another site
/// starts (so no other site can make the browser call the page's API or
/// sign it out), and only over HTTPS when the page is served so.
pub(crate) fn set_cookie(token: &Secret, secure: bool) -> String {
    format!("{COOKIE}={}; Path=/ui; HttpOnly; SameSite=Strict{}", token.expose(), if secure { "; Secure" } else { "" })
}

/// The `Set-Cookie` value that makes the browser drop the cookie.
pub(crate) fn clear_cookie(secure: bool) -> String {
    format!("{COOKIE}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0{}", if secure { "; Secure" } else { "" })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_session_lives_until_its_lifetime_or_sign_out_and_only_its_token_opens_it() {
        let sessions = Sessions::default();
        let start = Instant::now();
        let token = sessions.open(start);
        assert_eq!(token.expose().len(), 43, "256 random bits");
        assert!(sessions.valid(token.expose(), start + LIFETIME - Duration::from_secs(1)));
        assert!(!sessions.valid(&format!("{}x", token.expose()), start));
        assert!(!sessions.valid(token.expose(), start + LIFETIME), "ended");
        assert_eq!(sessions.len(), 0, "an ended session is forgotten");
        let other = sessions.open(start);
        sessions.close(other.expose());
        assert!(!sessions.valid(other.expose(), start), "signed out");
    }

    #[test]
    fn the_table_is_bounded_and_drops_ended_sessions_then_the_oldest() {
        let sessions = Sessions::default();
        let start = Instant::now();
        let first = sessions.open(start);
        let tokens: Vec<Secret> =
            (1..MAX_SESSIONS).map(|n| sessions.open(start + Duration::from_millis(n as u64))).collect();
        assert_eq!(sessions.len(), MAX_SESSIONS);
        let late = start + Duration::from_secs(1);
        let newest = sessions.open(late);
        assert_eq!(sessions.len(), MAX_SESSIONS, "bounded");
        assert!(!sessions.valid(first.expose(), late), "the oldest went");
        assert!(sessions.valid(tokens[0].expose(), late) && sessions.valid(newest.expose(), late));
        // Past the first ones' lifetime, a sign-in sweeps every ended one.
        let after = start + LIFETIME + Duration::from_millis(MAX_SESSIONS as u64 / 2);
        sessions.open(after);
        assert!(sessions.len() < MAX_SESSIONS / 2 + 2, "{}", sessions.len());
    }

    #[test]
    fn the_token_is_read_from_any_cookie_header_and_only_under_its_name() {
        let mut headers = HeaderMap::new();
        assert_eq!(token(&headers), None);
        headers.append(header::COOKIE, HeaderValue::from_static("theme=dark; standby_sessionx=no"));
        assert_eq!(token(&headers), None);
        headers.append(header::COOKIE, HeaderValue::from_static("a=b;  standby_session=abc_-1 ; c=d"));
        assert_eq!(token(&headers), Some("abc_-1"));
        let mut empty = HeaderMap::new();
        empty.append(header::COOKIE, HeaderValue::from_static("standby_session="));
        assert_eq!(token(&empty), None);
    }

    #[test]
    fn the_cookie_is_http_only_strict_scoped_to_the_page_and_secure_over_https() {
        let token = Secret::new("t0k");
        assert_eq!(set_cookie(&token, false), "standby_session=t0k; Path=/ui; HttpOnly; SameSite=Strict");
        assert!(set_cookie(&token, true).ends_with("; Secure"));
        assert_eq!(clear_cookie(false), "standby_session=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0");
        let mut headers = HeaderMap::new();
        assert!(!over_https(&headers, false));
        assert!(over_https(&headers, true), "the public URL is https");
        headers.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        assert!(over_https(&headers, false));
        headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
        assert!(!over_https(&headers, false));
        let mut forwarded = HeaderMap::new();
        forwarded.insert("forwarded", HeaderValue::from_static("for=10.0.0.1;Proto=\"HTTPS\";host=x"));
        assert!(over_https(&forwarded, false));
    }
}
