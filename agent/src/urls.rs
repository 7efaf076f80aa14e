//! URLs as the agent describes them and the origin rule (amendment 2).
//!
//! [`describe_url`] is the one way a URL enters a log line or an error
//! message: a clone URL may carry a token as userinfo, a pre-signed object
//! URL carries its signature in the query string, and neither may leave the
//! sandbox in the agent's own output.
//!
//! The run credential goes only to the server's origin (scheme, host, port
//! of `STANDBY_SERVER_URL`); [`attachment_target`] decides, as a pure
//! function, where an attachment is fetched from and with what.

use std::net::IpAddr;

use reqwest::Url;

/// `url` without userinfo (`user:password@`), query string and fragment,
/// for logs and errors.
///
/// Only URLs with a scheme (`scheme://`) carry userinfo; an scp-like
/// `git@host:path` names a login, not a credential, and keeps it. A path
/// (`/v1/…`) loses its query string like any URL.
pub fn describe_url(url: &str) -> String {
    let url = &url[..url.find(['?', '#']).unwrap_or(url.len())];
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let authority_start = scheme_end + 3;
    let rest = &url[authority_start..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{}{}", &url[..authority_start], &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// Whether `host` (as in a URL, IPv6 in brackets or not) is a loopback address.
pub fn is_loopback(host: &str) -> bool {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    bare.eq_ignore_ascii_case("localhost") || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether two URLs share an origin: scheme, host and port (a default port
/// counts as written).
pub fn same_origin(a: &Url, b: &Url) -> bool {
    a.origin() == b.origin()
}

/// Resolves an attachment's `url`: a path starting with `/` is appended to
/// the server URL (prefix kept); any other must be an absolute `http(s)` URL.
/// One on another origin must be `https` unless its host is loopback or
/// `insecure` is set. Whether the request carries the credential is decided
/// where every request is made ([`crate::api::Api::send`]), by the origin.
/// The error names the URL without its query string.
pub fn attachment_target(server: &Url, url: &str, insecure: bool) -> Result<Url, String> {
    if url.starts_with('/') {
        let joined = format!("{}{url}", server.as_str().trim_end_matches('/'));
        return Url::parse(&joined).map_err(|e| format!("`{}` is not a valid path: {e}", describe_url(url)));
    }
    let parsed = Url::parse(url).map_err(|e| format!("`{}` is not a URL: {e}", describe_url(url)))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!("`{}` has scheme `{}`; expected http or https", describe_url(url), parsed.scheme()));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(format!("`{}` carries userinfo", describe_url(url)));
    }
    if same_origin(server, &parsed) {
        return Ok(parsed);
    }
    let host = parsed.host_str().unwrap_or_default();
    if parsed.scheme() == "http" && !insecure && !is_loopback(host) {
        return Err(format!(
            "`{}` is plain http to `{host}`, which is not a loopback address; only https is used off the server's origin (or --insecure)",
            describe_url(url)
        ));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server() -> Url {
        Url::parse("https://cp.example:8443/base").expect("a URL")
    }

    #[test]
    fn described_urls_lose_userinfo_query_and_fragment() {
        assert_eq!(describe_url("https://user:hunter2@git.example/a.git"), "https://git.example/a.git");
        assert_eq!(describe_url("https://tok@en@git.example/a@b.git"), "https://git.example/a@b.git");
        assert_eq!(describe_url("file:///srv/a.git"), "file:///srv/a.git");
        assert_eq!(describe_url("git@host:a.git"), "git@host:a.git");
        assert_eq!(
            describe_url("https://bucket.s3.example/o/spec.md?X-Amz-Signature=sekrit&X-Amz-Credential=k#frag"),
            "https://bucket.s3.example/o/spec.md"
        );
        assert_eq!(describe_url("https://u:p@h.example?sig=1"), "https://h.example");
        assert_eq!(describe_url("https://h.example/a?next=https://u:p@x"), "https://h.example/a");
        assert_eq!(describe_url("/v1/executions/e/attachments/a?sig=sekrit"), "/v1/executions/e/attachments/a");
    }

    #[test]
    fn paths_and_the_servers_own_origin_get_the_credential() {
        let path = attachment_target(&server(), "/v1/x?y=1", false).expect("a path");
        assert_eq!(path, Url::parse("https://cp.example:8443/base/v1/x?y=1").expect("a URL"));
        assert!(same_origin(&server(), &path));
        for same in ["https://cp.example:8443/elsewhere", "https://CP.example:8443/a"] {
            let target = attachment_target(&server(), same, false).expect(same);
            assert!(same_origin(&server(), &target), "{same}");
        }
        let default_port = Url::parse("https://cp.example/base").expect("a URL");
        let target = attachment_target(&default_port, "https://cp.example:443/a", false).expect("a URL");
        assert!(same_origin(&default_port, &target));
    }

    #[test]
    fn another_origin_gets_no_credential() {
        for other in [
            "https://cp.example/a",         // another port
            "http://cp.example:8443/a",     // another scheme (loopback rule aside: refused below)
            "https://store.example:8443/a", // another host
            "https://cp.example.evil:8443/a",
        ] {
            match attachment_target(&server(), other, true) {
                Ok(target) if !same_origin(&server(), &target) => {}
                other_target => panic!("{other}: {other_target:?}"),
            }
        }
    }

    #[test]
    fn plain_http_off_origin_needs_loopback_or_insecure() {
        let error =
            attachment_target(&server(), "http://store.example/o?X-Amz-Signature=sekrit", false).expect_err("refused");
        assert!(error.contains("http://store.example/o") && !error.contains("sekrit"), "{error}");
        let foreign = |url| attachment_target(&server(), url, false).is_ok_and(|t| !same_origin(&server(), &t));
        assert!(
            attachment_target(&server(), "http://store.example/o", true).is_ok_and(|t| !same_origin(&server(), &t))
        );
        for loopback in ["http://127.0.0.2:9/o", "http://localhost:9/o", "http://[::1]:9/o"] {
            assert!(foreign(loopback), "{loopback}");
        }
    }

    #[test]
    fn odd_urls_are_refused_without_their_query() {
        for bad in ["spec.md?sig=sekrit", "ftp://h/o?sig=sekrit", "https://u:p@h/o?sig=sekrit"] {
            let error = attachment_target(&server(), bad, true).expect_err(bad);
            assert!(!error.contains("sekrit") && !error.contains(":p@"), "{error}");
        }
    }
}
