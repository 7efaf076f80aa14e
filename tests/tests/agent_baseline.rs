//! The shipped agent runs in the images users already have: built against
//! the glibc baseline (`scripts/dist`: `cargo zigbuild --target
//! x86_64-unknown-linux-gnu.2.17`), it needs no glibc symbol newer than
//! 2.17 (RHEL 7; Debian 11, Ubuntu 20.04 and Amazon Linux 2 are newer).
//!
//! CI builds that agent and names it in `STANDBY_BASELINE_AGENT`; elsewhere
//! the test is skipped, loudly (under `CI=true` it fails instead). Needs
//! `objdump` (binutils).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use standby_e2e::standby_bin;

const BASELINE: &str = "2.17";
const VAR: &str = "STANDBY_BASELINE_AGENT";

/// `scripts/check-glibc BINARY 2.17`, the check `scripts/dist` runs.
fn check(bin: &Path) -> Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check-glibc");
    Command::new(script).arg(bin).arg(BASELINE).output().expect("scripts/check-glibc runs")
}

fn baseline_agent() -> Option<PathBuf> {
    match std::env::var_os(VAR) {
        Some(path) => Some(PathBuf::from(path)),
        None if std::env::var("CI").is_ok_and(|ci| ci == "true") => {
            panic!("{VAR} is unset: CI builds the baseline agent (.ci/run, `cargo zigbuild`) and names it there")
        }
        None => {
            eprintln!(
                "\n*** SKIPPED: {VAR} is unset. Build the agent with `cargo zigbuild --target \
                 x86_64-unknown-linux-gnu.{BASELINE} -p standby-agent` (scripts/zigbuild-tools installs it) \
                 and name it in {VAR}; under CI=true this fails instead.\n"
            );
            None
        }
    }
}

#[test]
fn the_shipped_agent_needs_no_glibc_symbol_newer_than_the_baseline() {
    let Some(agent) = baseline_agent() else { return };
    let output = check(&agent);
    let said = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{said}");
    let version = Command::new(&agent).arg("--version").output().expect("the baseline agent runs");
    let version = String::from_utf8_lossy(&version.stdout);
    assert!(version.starts_with("standby ") && version.contains("(commit "), "{version}");
}

/// The check itself tells: the agent built for this machine's glibc (2.34
/// or newer on every release the tests run on) is refused, naming a symbol
/// past the baseline.
#[test]
fn the_check_refuses_a_binary_built_for_a_newer_glibc() {
    let output = check(&standby_bin());
    let said = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{said}");
    assert!(said.contains("newer than the baseline 2.17") && said.contains("(GLIBC_2."), "{said}");
}
