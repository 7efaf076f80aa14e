//! The Kubernetes manifests as the cluster would get them: `kubectl
//! kustomize` of a directory under `deploy/kubernetes`, parsed into one
//! JSON value per object, and the grants of their Roles, which the
//! provider's end-to-end tests compare with the calls they saw.
//!
//! Under `CI=true` a missing `kubectl` fails the test; elsewhere the test
//! is skipped, loudly ([`kubectl_available`]).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Why a directory did not render.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("cannot run `kubectl kustomize {dir}`: {source}")]
    Spawn { dir: PathBuf, source: std::io::Error },
    #[error("`kubectl kustomize {dir}` failed ({status}): {stderr}")]
    Failed { dir: PathBuf, status: std::process::ExitStatus, stderr: String },
    #[error("`kubectl kustomize {dir}` printed what is not YAML objects: {problem}")]
    Yaml { dir: PathBuf, problem: String },
}

/// `deploy/kubernetes` of this repository: the base's entry point.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").join("deploy/kubernetes")
}

/// Whether `kubectl` runs here; `false` (with a loud line) when the test
/// is to be skipped. Panics under `CI=true` instead of skipping.
pub fn kubectl_available(test: &str) -> bool {
    let ran = Command::new("kubectl").args(["version", "--client"]).output();
    let why = match ran {
        Ok(output) if output.status.success() => return true,
        Ok(output) => format!("`kubectl version --client` failed: {}", String::from_utf8_lossy(&output.stderr).trim()),
        Err(error) => format!("no kubectl ({error})"),
    };
    assert!(
        !std::env::var("CI").is_ok_and(|ci| ci == "true"),
        "{test}: {why} (CI=true: the manifests must be rendered)"
    );
    eprintln!("*** {test}: SKIPPED: {why}; it renders deploy/kubernetes with `kubectl kustomize` ***");
    false
}

/// `kubectl kustomize DIR`: every object it prints, in its order.
pub fn render(dir: &Path) -> Result<Vec<Value>, RenderError> {
    let output = Command::new("kubectl")
        .arg("kustomize")
        .arg(dir)
        .output()
        .map_err(|source| RenderError::Spawn { dir: dir.to_owned(), source })?;
    if !output.status.success() {
        return Err(RenderError::Failed {
            dir: dir.to_owned(),
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        });
    }
    let text = String::from_utf8(output.stdout)
        .map_err(|error| RenderError::Yaml { dir: dir.to_owned(), problem: error.to_string() })?;
    let objects: Vec<Value> = serde_saphyr::from_multiple(&text)
        .map_err(|error| RenderError::Yaml { dir: dir.to_owned(), problem: error.to_string() })?;
    Ok(objects.into_iter().filter(|object| !object.is_null()).collect())
}

/// Every (API group, resource, verb) the rendered Roles grant, each rule
/// spelled out (`""` is the core group). ClusterRoles are not counted: the
/// deployment must have none, which its test checks.
pub fn role_grants(rendered: &[Value]) -> BTreeSet<(String, String, String)> {
    let strings = |value: &Value| -> Vec<String> {
        value.as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
    };
    let mut grants = BTreeSet::new();
    for role in rendered.iter().filter(|object| object["kind"] == "Role") {
        for rule in role["rules"].as_array().into_iter().flatten() {
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        grants.insert((group.clone(), resource.clone(), verb));
                    }
                }
            }
        }
    }
    grants
}

/// The one object of `kind` named `name`; panics naming what was there.
pub fn object<'a>(rendered: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> =
        rendered.iter().filter(|object| object["kind"] == kind && object["metadata"]["name"] == name).collect();
    match found.as_slice() {
        [one] => one,
        _ => panic!("expected one {kind} {name}, found {}; the objects: {:?}", found.len(), names(rendered)),
    }
}

/// Every object of `kind`.
pub fn objects<'a>(rendered: &'a [Value], kind: &str) -> Vec<&'a Value> {
    rendered.iter().filter(|object| object["kind"] == kind).collect()
}

/// `Kind/name` of every object, in order.
pub fn names(rendered: &[Value]) -> Vec<String> {
    rendered
        .iter()
        .map(|object| {
            format!("{}/{}", object["kind"].as_str().unwrap_or("?"), object["metadata"]["name"].as_str().unwrap_or("?"))
        })
        .collect()
}
