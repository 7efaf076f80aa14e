//! Prepared snapshots: where the provider can make sandboxes from a
//! snapshot of a prepared one (`RulesConfig::snapshots`), the first pool
//! standby of a fingerprint that becomes ready is snapshotted, and later
//! standbys and cold sandboxes of that fingerprint start from it.
//!
//! - **Nothing of a run in a snapshot**: the standby is held out of
//!   placement from the moment its snapshot is asked for until the provider
//!   answers ([`Input::SnapshotTaken`](super::Input::SnapshotTaken)), so no
//!   assignment (and no run credential, secret or file of a run) can reach
//!   its filesystem while it is copied. A workspace whose repository URL
//!   carries a credential is never snapshotted: the clone's remote holds
//!   the URL.
//! - **One at a time per fingerprint**: a fingerprint with a snapshot made
//!   (by this process) or under way asks for none; one whose snapshot
//!   failed waits [`RETRY_AFTER`] before the next ready standby is tried,
//!   so a provider that cannot commit (a full disk) is not asked on every
//!   standby. What is kept is in memory: after a restart the provider is
//!   asked again and answers from its own images.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use standby_protocol::{Fingerprint, Workspace};

use super::{Effect, Rules, Step};
use crate::model::Millis;

/// How long a fingerprint whose snapshot failed waits for the next try.
pub const RETRY_AFTER: Duration = Duration::from_secs(600);

/// The snapshots this process knows of, by fingerprint.
#[derive(Debug, Default)]
pub(super) struct Snapshots {
    made: HashSet<Fingerprint>,
    taking: HashSet<Fingerprint>,
    failed_until: HashMap<Fingerprint, Millis>,
}

impl Snapshots {
    /// Whether a ready standby of `fingerprint` should be snapshotted now.
    fn wanted(&self, now: Millis, fingerprint: &Fingerprint) -> bool {
        !self.made.contains(fingerprint)
            && !self.taking.contains(fingerprint)
            && self.failed_until.get(fingerprint).is_none_or(|until| now >= *until)
    }
}

/// Whether `workspace` may be kept in a snapshot: none of its repository
/// URLs carries a user or password (`https://user:token@host/…`), which
/// the clone's remote would keep.
pub fn snapshot_safe(workspace: &Workspace) -> bool {
    workspace.repos.iter().all(|repo| !has_userinfo(&repo.url))
}

/// Whether a URL's authority names a user (`scheme://user[:password]@host`).
/// An scp-like address (`git@host:path`) names only an SSH user, never a
/// secret, and has no `://`.
fn has_userinfo(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else { return false };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    authority.contains('@')
}

impl Rules {
    /// A pool standby became ready for the first time: snapshots it when
    /// its fingerprint has no snapshot yet, holding it out of placement
    /// until the provider answers.
    pub(super) fn snapshot_if_first(&mut self, now: Millis, step: &mut Step, sandbox_id: &str) {
        if !self.config.snapshots {
            return;
        }
        let Some(live) = self.sandboxes.get(sandbox_id) else { return };
        let fingerprint = live.record.fingerprint.clone();
        let safe =
            live.record.workspace.as_ref().map_or_else(|| snapshot_safe(&self.config.pool_workspace), snapshot_safe);
        if !safe || !self.snapshots.wanted(now, &fingerprint) {
            return;
        }
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.snapshotting = true;
        }
        self.snapshots.taking.insert(fingerprint.clone());
        tracing::info!(sandbox_id, %fingerprint, "first ready standby of its fingerprint: snapshotting it");
        step.effects.push(Effect::Snapshot { sandbox_id: sandbox_id.to_owned(), fingerprint });
    }

    /// The provider answered a snapshot: the standby is placeable again.
    pub(super) fn snapshot_taken(
        &mut self,
        now: Millis,
        sandbox_id: &str,
        fingerprint: Fingerprint,
        outcome: Result<(), String>,
    ) -> Step {
        let mut step = Step::default();
        self.snapshots.taking.remove(&fingerprint);
        match outcome {
            Ok(()) => {
                self.snapshots.failed_until.remove(&fingerprint);
                self.snapshots.made.insert(fingerprint);
            }
            Err(error) => {
                tracing::warn!(sandbox_id, %fingerprint, error, "snapshotting a prepared standby failed");
                self.snapshots.failed_until.insert(fingerprint, now.plus(RETRY_AFTER));
            }
        }
        if let Some(mut live) = self.sandboxes.get_mut(sandbox_id) {
            live.snapshotting = false;
            live.snapshot_ended_at = Some(now);
        }
        self.dispatch_queued(now, &mut step);
        self.expire_standbys(now, &mut step);
        step
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use standby_protocol::Repo;

    fn repo(url: &str) -> Repo {
        Repo { url: url.into(), path: "app".into(), git_ref: None, expected_sha: None }
    }

    #[test]
    fn a_url_with_a_user_is_not_kept_in_a_snapshot() {
        for url in ["https://x-access-token:ghs_secret@git.example/app.git", "http://user@10.0.0.1:8080/app"] {
            assert!(!snapshot_safe(&Workspace { repos: vec![repo(url)], setup: vec![] }), "{url}");
        }
        for url in [
            "https://git.example/app.git",
            "file:///srv/app.git",
            "git@git.example:org/app.git",
            "https://git.example/app.git?ref=a@b",
            "https://git.example/users/@me/app.git",
        ] {
            assert!(snapshot_safe(&Workspace { repos: vec![repo(url)], setup: vec![] }), "{url}");
        }
    }

    #[test]
    fn a_failed_fingerprint_waits_before_the_next_try() {
        let fingerprint = standby_protocol::fingerprint(&Workspace::default());
        let mut snapshots = Snapshots::default();
        assert!(snapshots.wanted(Millis(0), &fingerprint));
        snapshots.failed_until.insert(fingerprint.clone(), Millis(0).plus(RETRY_AFTER));
        assert!(!snapshots.wanted(Millis(1_000), &fingerprint));
        assert!(snapshots.wanted(Millis(0).plus(RETRY_AFTER), &fingerprint));
        snapshots.made.insert(fingerprint.clone());
        assert!(!snapshots.wanted(Millis(0).plus(RETRY_AFTER), &fingerprint));
    }
}
