//! Names the commit the agent is built from (`standby --version`), so a
//! platform team can tell which build an image holds. `STANDBY_COMMIT`
//! overrides it (a build outside a git checkout, such as an image's
//! builder stage, passes it in); without either it is `unknown`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=STANDBY_COMMIT");
    let commit = std::env::var("STANDBY_COMMIT").ok().filter(|commit| !commit.is_empty()).or_else(git_commit);
    println!("cargo:rustc-env=STANDBY_COMMIT={}", commit.as_deref().unwrap_or("unknown"));
}

/// `HEAD`'s commit (12 digits, `-dirty` when tracked files changed), and
/// the files whose change moves it, so cargo runs this again then.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| {
        let output = Command::new("git").args(args).output().ok()?;
        output.status.success().then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let git_dir = PathBuf::from(git(&["rev-parse", "--absolute-git-dir"])?);
    println!("cargo:rerun-if-changed={}", git_dir.join("HEAD").display());
    println!("cargo:rerun-if-changed={}", git_dir.join("index").display());
    if let Some(reference) = git(&["symbolic-ref", "-q", "HEAD"]) {
        let common = git(&["rev-parse", "--git-common-dir"]).map_or_else(|| git_dir.clone(), PathBuf::from);
        println!("cargo:rerun-if-changed={}", common.join(&reference).display());
        println!("cargo:rerun-if-changed={}", common.join("packed-refs").display());
    }
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|status| !status.is_empty());
    Some(if dirty { format!("{commit}-dirty") } else { commit })
}
