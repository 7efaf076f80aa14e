//! A PostgreSQL URL as it may be shown: without its password.

const REDACTED: &str = "[REDACTED]";

/// `url` with the password of its user info and any `password` parameter
/// replaced by `[REDACTED]`: the only form of a store URL that reaches an
/// error, a log line or `--help`. When in doubt it hides more: everything
/// between the first `:` after the scheme and the last `@` before the query.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), url),
    };
    let (location, query) = match rest.split_once('?') {
        Some((location, query)) => (location, Some(query)),
        None => (rest, None),
    };
    let location = match location.rsplit_once('@') {
        Some((user_info, host)) => match user_info.split_once(':') {
            Some((user, _password)) => format!("{user}:{REDACTED}@{host}"),
            None => format!("{user_info}@{host}"),
        },
        None => location.to_owned(),
    };
    let mut redacted = format!("{scheme}{location}");
    if let Some(query) = query {
        let parameters: Vec<String> = query
            .split('&')
            .map(|parameter| match parameter.split_once('=') {
                Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}={REDACTED}"),
                _ => parameter.to_owned(),
            })
            .collect();
        redacted.push('?');
        redacted.push_str(&parameters.join("&"));
    }
    redacted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_password_is_hidden_wherever_it_is_given() {
        let cases = [
            ("postgres://standby:hunter2@db:5432/standby", "postgres://standby:[REDACTED]@db:5432/standby"),
            ("postgresql://standby@db/standby", "postgresql://standby@db/standby"),
            ("postgres://db/standby", "postgres://db/standby"),
            (
                "postgres://db/standby?user=u&password=hunter2&sslmode=disable",
                "postgres://db/standby?user=u&password=[REDACTED]&sslmode=disable",
            ),
            ("postgres://u:p%40ss@db/x?PASSWORD=hunter2", "postgres://u:[REDACTED]@db/x?PASSWORD=[REDACTED]"),
            // Unencoded `@` and `/` in a password: the last `@` ends it.
            ("postgres://u:hun@t/er2@db/x", "postgres://u:[REDACTED]@db/x"),
            (
                "postgres://u:pw@127.0.0.1:5432/x?options=-csearch_path%3Dt",
                "postgres://u:[REDACTED]@127.0.0.1:5432/x?options=-csearch_path%3Dt",
            ),
        ];
        for (url, shown) in cases {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
