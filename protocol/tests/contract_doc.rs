//! `docs/contract.md` is the normative contract: its exit-code table and
//! its HTTP calls must say what the crate's `ExitCode` and `Endpoint` do.

use std::collections::BTreeSet;

use standby_protocol::{CredentialKind, Endpoint, ExitCode};

fn contract() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/contract.md");
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The rows of the first table after `heading`, as cells.
fn table_after(document: &str, heading: &str) -> Vec<Vec<String>> {
    let start = document.find(heading).unwrap_or_else(|| panic!("no {heading:?} in docs/contract.md"));
    document[start..]
        .lines()
        .skip_while(|line| !line.starts_with('|'))
        .take_while(|line| line.starts_with('|'))
        .skip(2)
        .map(|line| line.trim_matches('|').split('|').map(|cell| cell.trim().to_owned()).collect())
        .collect()
}

#[test]
fn the_exit_code_table_is_the_crates() {
    let rows = table_after(&contract(), "\n## Exit codes");
    let documented: Vec<(String, String)> =
        rows.into_iter().map(|row| (row[0].clone(), row[1].trim_start_matches("**(1.1)** ").to_owned())).collect();
    let crate_table: Vec<(String, String)> = ExitCode::ALL
        .into_iter()
        .filter(|exit| exit.in_contract())
        .map(|exit| (exit.code().to_string(), exit.help().to_owned()))
        .collect();
    assert_eq!(documented, crate_table, "docs/contract.md's exit codes differ from standby_protocol::ExitCode");
}

/// `METHOD /path` of a call, as the contract writes it.
fn call(endpoint: Endpoint) -> String {
    format!("{} {}", endpoint.method().as_str(), endpoint.route())
}

/// The table of calls made with the run credential lists exactly the
/// crate's run-credential endpoints, each with its method and path
/// template; the one call made with the standby credential is stated where
/// the spec is.
#[test]
fn the_http_calls_table_is_the_crates() {
    let contract = contract();
    let documented: BTreeSet<String> = table_after(&contract, "\n## HTTP calls with the run credential")
        .into_iter()
        .map(|row| row[0].trim_matches('`').to_owned())
        .collect();
    let crate_calls: BTreeSet<String> =
        Endpoint::ALL.into_iter().filter(|endpoint| endpoint.credential() == CredentialKind::Run).map(call).collect();
    let undocumented: Vec<&String> = crate_calls.difference(&documented).collect();
    let unknown: Vec<&String> = documented.difference(&crate_calls).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "docs/contract.md's HTTP calls differ from standby_protocol::Endpoint: \
         missing from the table: {undocumented:?}; in the table but no endpoint: {unknown:?}"
    );
    for endpoint in Endpoint::ALL.into_iter().filter(|endpoint| endpoint.credential() == CredentialKind::Standby) {
        let sentence = format!("`{}` with the standby credential", call(endpoint));
        assert!(contract.contains(&sentence), "docs/contract.md does not say {sentence:?}");
    }
}
