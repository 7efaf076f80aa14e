//! `docs/contract.md` is the normative contract: its tables must say what
//! the crate's rules do.

use standby_protocol::ExitCode;

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
