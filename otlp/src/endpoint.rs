//! Where spans go: the OTLP/HTTP rule for an endpoint's traces URL.

/// Why an endpoint is refused. The message names the setting's value
/// without its userinfo, query or fragment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("`{0}` is not a URL")]
    NotUrl(String),
    #[error("`{0}` is not an http or https URL")]
    Scheme(String),
    #[error("`{0}` has no host")]
    NoHost(String),
}

/// The URL spans are POSTed to, from an OTLP endpoint as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` means one: the base of every signal, so
/// `v1/traces` is appended to its path (`http://collector:4318` →
/// `http://collector:4318/v1/traces`, `https://h/otlp/` →
/// `https://h/otlp/v1/traces`). A URL whose path already ends with
/// `/v1/traces` is the traces URL itself, as
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` would be, and is used as it is.
pub fn traces_url(endpoint: &str) -> Result<reqwest::Url, EndpointError> {
    let shown = || shown(endpoint);
    let mut url = reqwest::Url::parse(endpoint.trim()).map_err(|_| EndpointError::NotUrl(shown()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(EndpointError::Scheme(shown()));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(EndpointError::NoHost(shown()));
    }
    if !url.path().trim_end_matches('/').ends_with("/v1/traces") {
        let path = format!("{}/v1/traces", url.path().trim_end_matches('/'));
        url.set_path(&path);
    }
    Ok(url)
}

/// The endpoint as an error shows it: no userinfo, query or fragment (any
/// may hold a credential).
fn shown(endpoint: &str) -> String {
    match reqwest::Url::parse(endpoint.trim()) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            url.to_string()
        }
        Err(_) => {
            let host_on = endpoint.rsplit('@').next().unwrap_or_default();
            host_on.split(['?', '#']).next().unwrap_or_default().chars().take(80).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signal_path_is_appended_to_a_base() {
        let cases = [
            ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
            ("http://127.0.0.1:4318/", "http://127.0.0.1:4318/v1/traces"),
            ("https://collector.example/otlp/", "https://collector.example/otlp/v1/traces"),
            ("https://collector.example/otlp", "https://collector.example/otlp/v1/traces"),
            ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
            ("http://c:4318/custom/v1/traces", "http://c:4318/custom/v1/traces"),
        ];
        for (endpoint, url) in cases {
            assert_eq!(traces_url(endpoint).map(String::from), Ok(url.to_owned()), "{endpoint}");
        }
    }

    #[test]
    fn other_urls_are_refused_without_their_secrets() {
        assert_eq!(traces_url("grpc://c:4317"), Err(EndpointError::Scheme("grpc://c:4317".into())));
        assert!(matches!(traces_url("collector:4318"), Err(EndpointError::Scheme(_) | EndpointError::NotUrl(_))));
        assert!(matches!(traces_url("not a url"), Err(EndpointError::NotUrl(_))));
        let error = traces_url("ftp://user:hunter2@c/?token=s3cret").expect_err("ftp");
        let text = error.to_string();
        assert!(!text.contains("hunter2") && !text.contains("s3cret"), "{text}");
        let error = traces_url("http//user:hunter2@c?token=s3cret").expect_err("no scheme");
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }
}
