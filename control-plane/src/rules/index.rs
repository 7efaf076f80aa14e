//! The sandboxes in memory, with the indexes placement and the pool's
//! accounting read: every warm standby oldest first (placement takes the
//! oldest ready one), the standbys by when they expire, and how many
//! sandboxes cost compute. A change of a sandbox goes through
//! [`LiveSandboxes::get_mut`], whose guard re-indexes it when dropped, so
//! no rule can change a sandbox and forget an index; a run's placement and
//! a pool top-up then look up instead of scanning every sandbox, which at
//! 17,000 standbys made a burst 20 times slower than at 1,000.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::{Deref, DerefMut};

use super::Live;
use crate::model::{Millis, SandboxKind, SandboxState};

/// Where a sandbox stands in the indexes.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Standing {
    /// A warm standby with no run whose agent runs: `(created_at, id)`.
    standby: Option<(Millis, String)>,
    /// Its expiry, when it is such a standby and has one: `(expires_at, id)`.
    expiry: Option<(Millis, String)>,
    /// Its agent runs or is being started: it counts against the cap.
    running: bool,
    /// Not retired: the tick's timers (silence, Tier 2 windows) look at it.
    active: Option<String>,
}

impl Standing {
    fn of(live: &Live) -> Self {
        let record = &live.record;
        let standby = record.kind == SandboxKind::Warm && record.state == SandboxState::Standby && !live.exited;
        Self {
            standby: standby.then(|| (record.created_at, record.id.clone())),
            expiry: record.expires_at.filter(|_| standby).map(|at| (at, record.id.clone())),
            running: !live.exited,
            active: (record.state != SandboxState::Retired).then(|| record.id.clone()),
        }
    }
}

/// The indexes themselves, kept apart from the map so that a guard can
/// hold both.
#[derive(Debug, Default)]
struct Indexes {
    standbys: BTreeSet<(Millis, String)>,
    expiries: BTreeSet<(Millis, String)>,
    running: usize,
    active: BTreeSet<String>,
}

impl Indexes {
    fn remove(&mut self, standing: &Standing) {
        if let Some(key) = &standing.standby {
            self.standbys.remove(key);
        }
        if let Some(key) = &standing.expiry {
            self.expiries.remove(key);
        }
        self.running -= usize::from(standing.running);
        if let Some(id) = &standing.active {
            self.active.remove(id);
        }
    }

    fn add(&mut self, standing: Standing) {
        self.running += usize::from(standing.running);
        if let Some(key) = standing.standby {
            self.standbys.insert(key);
        }
        if let Some(key) = standing.expiry {
            self.expiries.insert(key);
        }
        if let Some(id) = standing.active {
            self.active.insert(id);
        }
    }
}

/// Every sandbox the machine holds, by id, and its indexes.
#[derive(Debug, Default)]
pub(super) struct LiveSandboxes {
    map: BTreeMap<String, Live>,
    indexes: Indexes,
}

impl LiveSandboxes {
    pub(super) fn get(&self, sandbox_id: &str) -> Option<&Live> {
        self.map.get(sandbox_id)
    }

    /// The sandbox, to change: re-indexed when the guard is dropped.
    pub(super) fn get_mut(&mut self, sandbox_id: &str) -> Option<LiveMut<'_>> {
        let live = self.map.get_mut(sandbox_id)?;
        let before = Standing::of(live);
        Some(LiveMut { live, indexes: &mut self.indexes, before })
    }

    pub(super) fn insert(&mut self, sandbox_id: String, live: Live) {
        let standing = Standing::of(&live);
        if let Some(earlier) = self.map.insert(sandbox_id, live) {
            self.indexes.remove(&Standing::of(&earlier));
        }
        self.indexes.add(standing);
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Live> {
        self.map.values()
    }

    /// Sandboxes whose agent runs or is being started.
    pub(super) fn running(&self) -> usize {
        self.indexes.running
    }

    /// Every sandbox not retired: what the tick's timers look at (retired
    /// ones stay in memory for the API, and would otherwise make every
    /// tick cost all sandboxes ever made).
    pub(super) fn active(&self) -> impl Iterator<Item = &Live> {
        self.indexes.active.iter().filter_map(|id| self.map.get(id))
    }

    /// Warm standbys with no run whose agent runs, oldest first.
    pub(super) fn standbys(&self) -> impl Iterator<Item = &Live> {
        self.indexes.standbys.iter().filter_map(|(_, id)| self.map.get(id))
    }

    /// How many of those are not expired at `now`.
    pub(super) fn standbys_unexpired(&self, now: Millis) -> usize {
        let expired = self.indexes.expiries.iter().take_while(|(at, _)| *at <= now).count();
        self.indexes.standbys.len() - expired
    }

    /// Whether a standby has expired at `now`.
    pub(super) fn any_standby_expired(&self, now: Millis) -> bool {
        self.indexes.expiries.first().is_some_and(|(at, _)| *at <= now)
    }

    /// The indexes as a scan of every sandbox would make them: the tests
    /// hold the kept indexes to it after every input.
    #[cfg(test)]
    pub(super) fn check(&self) {
        let mut scanned = Indexes::default();
        for live in self.map.values() {
            scanned.add(Standing::of(live));
        }
        assert_eq!(scanned.standbys, self.indexes.standbys, "the standby index");
        assert_eq!(scanned.expiries, self.indexes.expiries, "the expiry index");
        assert_eq!(scanned.running, self.indexes.running, "the running count");
        assert_eq!(scanned.active, self.indexes.active, "the sandboxes not retired");
    }
}

/// A sandbox being changed; its indexes follow when this is dropped.
pub(super) struct LiveMut<'a> {
    live: &'a mut Live,
    indexes: &'a mut Indexes,
    before: Standing,
}

impl Deref for LiveMut<'_> {
    type Target = Live;

    fn deref(&self) -> &Live {
        self.live
    }
}

impl DerefMut for LiveMut<'_> {
    fn deref_mut(&mut self) -> &mut Live {
        self.live
    }
}

impl Drop for LiveMut<'_> {
    fn drop(&mut self) {
        let after = Standing::of(self.live);
        if after != self.before {
            self.indexes.remove(&self.before);
            self.indexes.add(after);
        }
    }
}
