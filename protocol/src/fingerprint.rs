use std::fmt;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Workspace;

/// SHA-256 (lowercase hex) of a workspace's canonical JSON with every
/// `expected_sha` removed.
///
/// The SHA is left out because a run pins the commit it needs while the
/// standby was prepared from a branch head: the refresh step moves the
/// checkout, so a different commit must not disqualify a prepared sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fingerprint(String);

impl Fingerprint {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Canonical form: every known field present (absent optional values as
/// `null`), object keys sorted, no insignificant whitespace, UTF-8.
pub fn fingerprint(workspace: &Workspace) -> Fingerprint {
    let mut value = serde_json::to_value(workspace).unwrap_or_default();
    if let Some(repos) = value.get_mut("repos").and_then(|r| r.as_array_mut()) {
        for repo in repos {
            if let Some(object) = repo.as_object_mut() {
                object.remove("expected_sha");
            }
        }
    }
    // serde_json's map is ordered by key unless `preserve_order` is enabled,
    // which this crate does not enable, so `to_string` is already canonical.
    let canonical = value.to_string();
    let digest = Sha256::digest(canonical.as_bytes());
    Fingerprint(digest.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Repo, SetupStep};

    fn workspace(sha: Option<&str>) -> Workspace {
        Workspace {
            repos: vec![Repo {
                url: "file:///srv/app.git".into(),
                path: "app".into(),
                git_ref: Some("main".into()),
                expected_sha: sha.map(str::to_owned),
            }],
            setup: vec![SetupStep {
                name: "deps".into(),
                command: vec!["make".into()],
                cwd: Some("app".into()),
                timeout_s: Some(60),
                inputs: None,
            }],
        }
    }

    #[test]
    fn expected_sha_is_not_part_of_the_fingerprint() {
        assert_eq!(fingerprint(&workspace(None)), fingerprint(&workspace(Some("abc"))));
    }

    #[test]
    fn any_other_change_is() {
        let mut other = workspace(None);
        other.setup[0].timeout_s = Some(61);
        assert_ne!(fingerprint(&workspace(None)), fingerprint(&other));
    }

    #[test]
    fn declared_inputs_count_only_when_present() {
        let mut declared = workspace(None);
        declared.setup[0].inputs = Some(vec!["app/Makefile".into()]);
        assert_ne!(fingerprint(&workspace(None)), fingerprint(&declared));
        let mut other = declared.clone();
        other.setup[0].inputs = Some(vec!["app/Makefile.lock".into()]);
        assert_ne!(fingerprint(&declared), fingerprint(&other));
    }

    #[test]
    fn absent_lists_equal_empty_lists() {
        let parsed: Workspace = serde_json::from_str("{}").expect("an empty workspace");
        assert_eq!(fingerprint(&parsed), fingerprint(&Workspace::default()));
    }

    #[test]
    fn canonical_form_is_stable() {
        // Pinned so that servers in other languages can check their own
        // implementation against it (docs/protocol.md gives the same value).
        let parsed: Workspace = serde_json::from_str(
            r#"{"repos":[{"url":"https://git.example/app.git","path":"app","ref":"main","expected_sha":"0123"}],
                "setup":[{"name":"deps","command":["npm","ci"],"cwd":"app","timeout_s":900}]}"#,
        )
        .expect("a workspace");
        assert_eq!(fingerprint(&parsed).as_str(), "f8560f4b30d21ea699a613a76f9d0a16b02f4c38df2fb551d386540417374fbb");
    }
}
