use std::collections::BTreeMap;

use base64::Engine;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Secret;

/// `GET /v1/executions/{id}/secrets`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretsResponse {
    pub secrets: BTreeMap<String, Secret>,
}

/// `GET /v1/executions/{id}/attachments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AttachmentsResponse {
    pub attachments: Vec<Attachment>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Attachment {
    /// A plain file name: one with a path separator or `..` fails the install.
    pub name: String,
    /// Starting with `/`: appended to the server's base URL; else absolute.
    pub url: String,
    /// Lowercase hex SHA-256 of the content.
    pub sha256: String,
}

/// `POST /v1/executions/{id}/git-credentials`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GitCredentialsResponse {
    pub credentials: Vec<GitCredential>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct GitCredential {
    pub protocol: String,
    pub host: String,
    pub username: String,
    pub password: Secret,
}

/// `POST /v1/executions/{id}/cloud-credentials`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CloudCredentialsResponse {
    pub env: BTreeMap<String, Secret>,
}

/// `POST /v1/executions/{id}/events`. A retried event keeps its `event_id`,
/// so the server can drop duplicates.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Event {
    pub event_id: String,
    #[serde(flatten)]
    pub kind: EventKind,
    /// **(1.1, note 10)** On the run's final event (`exited`, `cancelled`):
    /// bytes of the run's (redacted) output the server's log lacks because
    /// the agent gave up on them: never acknowledged when shipping ended,
    /// plus those already reported as `dropped`. Absent when nothing was
    /// lost, so a log is complete exactly when its run's final event has
    /// none. A server ignores it on other events. Sent with the event rather
    /// than inferred from the log, because only the agent knows how long the
    /// output was: without it a log cut short looks like a short log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_lost: Option<u64>,
    /// **(1.3)** On `started`: the agent's own timing of the start, in
    /// microseconds, by name: each install step it ran (the `stage` names
    /// of `install_failed`: `check`, `secrets`, `refresh`, …), `confirm`
    /// (assignment to delivery confirmed), `spawn` (the run started on the
    /// prepared terminal) and `critical_path` (assignment to start). The
    /// steps run in parallel, each from the assignment's arrival. For
    /// display only: a server ignores it on other events, and one past
    /// [`INSTALL_TIMING_MAX`] entries (or with a longer name) is ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub install_us: Option<BTreeMap<String, u64>>,
}

/// Most entries of an event's [`Event::install_us`] a server keeps, and
/// the longest name.
pub const INSTALL_TIMING_MAX: usize = 32;
/// Longest name in [`Event::install_us`].
pub const INSTALL_TIMING_NAME_MAX: usize = 32;

impl Event {
    /// An event that says nothing of the log.
    pub fn new(event_id: impl Into<String>, kind: EventKind) -> Self {
        Self { event_id: event_id.into(), kind, log_lost: None, install_us: None }
    }

    /// The `started` event carrying the agent's timing of the start
    /// ([`Event::install_us`]); any other event is left as it is.
    #[must_use]
    pub fn with_install_timing(self, timing: BTreeMap<String, u64>) -> Self {
        let carries = matches!(self.kind, EventKind::Started) && !timing.is_empty();
        Self { install_us: carries.then_some(timing), ..self }
    }

    /// The start's timing a server keeps: only on `started`, only within
    /// [`INSTALL_TIMING_MAX`] entries of names up to
    /// [`INSTALL_TIMING_NAME_MAX`] characters.
    pub fn install_timing(&self) -> Option<&BTreeMap<String, u64>> {
        let timing = self.install_us.as_ref().filter(|_| matches!(self.kind, EventKind::Started))?;
        let bounded = timing.len() <= INSTALL_TIMING_MAX
            && timing.keys().all(|name| !name.is_empty() && name.len() <= INSTALL_TIMING_NAME_MAX);
        bounded.then_some(timing)
    }

    /// The event carrying `lost` bytes of the run's output given up on,
    /// under the rule of [`Event::log_lost`]: only a final event carries
    /// it, and only when some was lost.
    #[must_use]
    pub fn with_log_lost(self, lost: u64) -> Self {
        let carries = matches!(self.kind, EventKind::Exited { .. } | EventKind::Cancelled) && lost > 0;
        Self { log_lost: carries.then_some(lost), ..self }
    }

    /// What a server records of the run's log when this event ends the run:
    /// `Some(bytes lost)` (0: the agent delivered all the output there was)
    /// for a final event (`exited`, `cancelled`), `None` for any other.
    pub fn log_outcome(&self) -> Option<u64> {
        match self.kind {
            EventKind::Exited { .. } | EventKind::Cancelled => Some(self.log_lost.unwrap_or(0)),
            EventKind::Started | EventKind::InstallFailed { .. } => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    Started,
    Exited { code: i32 },
    Cancelled,
    InstallFailed { requeueable: bool, stage: String, message: String },
}

impl EventKind {
    /// Every event type's name on the wire, in the order a run reports them.
    pub const NAMES: [&'static str; 4] = ["install_failed", "started", "exited", "cancelled"];

    /// The `type` this event carries on the wire.
    pub const fn name(&self) -> &'static str {
        match self {
            Self::Started => "started",
            Self::Exited { .. } => "exited",
            Self::Cancelled => "cancelled",
            Self::InstallFailed { .. } => "install_failed",
        }
    }

    /// Whether this event ends the run.
    pub const fn is_terminal(&self) -> bool {
        !matches!(self, Self::Started)
    }

    /// Whether this event may follow `earlier`, the run's distinct events
    /// so far, in the order the contract gives them: a run starts at most
    /// once, exits only once started, fails its install only before it
    /// starts, and reports nothing after an event that ends it.
    pub fn may_follow<'a>(&self, earlier: impl IntoIterator<Item = &'a EventKind>) -> Result<(), OutOfOrder> {
        let (mut started, mut ended) = (false, false);
        for event in earlier {
            started |= matches!(event, Self::Started);
            ended |= event.is_terminal();
        }
        match self {
            _ if ended => Err(OutOfOrder::AfterEnd),
            Self::Started if started => Err(OutOfOrder::StartedTwice),
            Self::Exited { .. } if !started => Err(OutOfOrder::NotStarted),
            Self::InstallFailed { .. } if started => Err(OutOfOrder::FailedAfterStart),
            _ => Ok(()),
        }
    }
}

/// How an event breaks the order of a run's events
/// ([`EventKind::may_follow`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OutOfOrder {
    #[error("an event after the one that ended the run")]
    AfterEnd,
    #[error("`started` a second time")]
    StartedTwice,
    #[error("`exited` before `started`")]
    NotStarted,
    #[error("`install_failed` after `started`")]
    FailedAfterStart,
}

/// `POST /v1/executions/{id}/log`: a chunk of the run's redacted terminal
/// output. `offset` counts bytes already sent, so the server recognises a
/// retried chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LogChunk {
    /// At most 2^63 − 1 with the chunk's length added
    /// ([`crate::log_chunk::MAX_POSITION`]).
    #[schemars(range(max = crate::log_chunk::MAX_POSITION))]
    pub offset: u64,
    /// Base64 (standard alphabet, padded).
    pub data: String,
    /// Bytes the agent had to drop just before this chunk because its
    /// spool bound was exceeded (amendment 6): `offset` is the true one,
    /// and the server accepts it when it equals its stored length plus
    /// `dropped`, recording the gap. At most 2^63 − 1.
    #[serde(default, skip_serializing_if = "is_zero")]
    #[schemars(range(max = crate::log_chunk::MAX_POSITION))]
    pub dropped: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl LogChunk {
    pub fn new(offset: u64, bytes: &[u8]) -> Self {
        Self { offset, data: base64::engine::general_purpose::STANDARD.encode(bytes), dropped: 0 }
    }

    /// A chunk that follows a gap of `dropped` bytes.
    pub fn after_gap(offset: u64, dropped: u64, bytes: &[u8]) -> Self {
        Self { dropped, ..Self::new(offset, bytes) }
    }

    pub fn bytes(&self) -> Result<Vec<u8>, base64::DecodeError> {
        base64::engine::general_purpose::STANDARD.decode(&self.data)
    }
}

/// Body of a `409` answer to a log chunk (amendment 6): the bytes the
/// server holds, so the agent resumes from there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LogReceived {
    pub received: u64,
}

/// Body of an error answer from the reference server (an extension: the
/// contract does not define error bodies, and the agent does not need one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_started_event_carries_a_bounded_install_timing() {
        let timing = BTreeMap::from([("secrets".to_owned(), 3_000), ("critical_path".to_owned(), 7_000)]);
        let started = Event::new("s", EventKind::Started).with_install_timing(timing.clone());
        assert_eq!(started.install_timing(), Some(&timing));
        let exited = Event::new("e", EventKind::Exited { code: 0 }).with_install_timing(timing.clone());
        assert_eq!(exited.install_us, None);
        let forged = Event { install_us: Some(timing), ..Event::new("e", EventKind::Exited { code: 0 }) };
        assert_eq!(forged.install_timing(), None, "a server ignores it on other events");

        let many = (0..=INSTALL_TIMING_MAX).map(|i| (format!("step{i}"), 1)).collect();
        let too_many = Event { install_us: Some(many), ..Event::new("s", EventKind::Started) };
        assert_eq!(too_many.install_timing(), None);
        let long = BTreeMap::from([("x".repeat(INSTALL_TIMING_NAME_MAX + 1), 1)]);
        assert_eq!(Event { install_us: Some(long), ..Event::new("s", EventKind::Started) }.install_timing(), None);
    }

    #[test]
    fn a_run_reports_in_the_contracts_order() {
        let exited = EventKind::Exited { code: 0 };
        let failed = EventKind::InstallFailed { requeueable: true, stage: "secrets".into(), message: "503".into() };
        assert_eq!(EventKind::Started.may_follow(&[]), Ok(()));
        assert_eq!(exited.may_follow(&[EventKind::Started]), Ok(()));
        assert_eq!(EventKind::Cancelled.may_follow(&[]), Ok(()), "cancelled before the start");
        assert_eq!(EventKind::Cancelled.may_follow(&[EventKind::Started]), Ok(()));
        assert_eq!(failed.may_follow(&[]), Ok(()));

        assert_eq!(EventKind::Started.may_follow(&[EventKind::Started]), Err(OutOfOrder::StartedTwice));
        assert_eq!(exited.may_follow(&[]), Err(OutOfOrder::NotStarted));
        assert_eq!(failed.may_follow(&[EventKind::Started]), Err(OutOfOrder::FailedAfterStart));
        for end in [exited.clone(), EventKind::Cancelled, failed.clone()] {
            assert_eq!(EventKind::Cancelled.may_follow([&EventKind::Started, &end]), Err(OutOfOrder::AfterEnd));
        }
    }

    #[test]
    fn only_a_final_event_carries_log_lost_and_only_when_some_was_lost() {
        let exited = || Event::new("e", EventKind::Exited { code: 0 });
        assert_eq!(exited().with_log_lost(0).log_lost, None);
        assert_eq!(exited().with_log_lost(7).log_lost, Some(7));
        assert_eq!(Event::new("e", EventKind::Cancelled).with_log_lost(7).log_lost, Some(7));
        assert_eq!(Event::new("e", EventKind::Started).with_log_lost(7).log_lost, None);
        let failed = EventKind::InstallFailed { requeueable: false, stage: "secrets".into(), message: "x".into() };
        assert_eq!(Event::new("e", failed.clone()).with_log_lost(7).log_lost, None);

        assert_eq!(exited().log_outcome(), Some(0), "a final event without it: nothing lost");
        assert_eq!(exited().with_log_lost(7).log_outcome(), Some(7));
        let stray = Event { log_lost: Some(7), ..Event::new("e", EventKind::Started) };
        assert_eq!(stray.log_outcome(), None, "ignored on other events");
        assert_eq!(Event::new("e", failed).log_outcome(), None);
    }

    #[test]
    fn log_lost_is_on_the_wire_only_when_set() {
        let encoded = |event: &Event| serde_json::to_value(event).expect("an event encodes");
        let plain = Event::new("e", EventKind::Exited { code: 3 });
        assert_eq!(encoded(&plain), serde_json::json!({"event_id": "e", "type": "exited", "code": 3}));
        let lost = plain.with_log_lost(9);
        assert_eq!(encoded(&lost), serde_json::json!({"event_id": "e", "type": "exited", "code": 3, "log_lost": 9}));
        let decoded: Event = serde_json::from_value(encoded(&lost)).expect("decodes");
        assert_eq!(decoded, lost);
        let old: Event = serde_json::from_str(r#"{"event_id":"e","type":"cancelled"}"#).expect("decodes");
        assert_eq!(old.log_lost, None, "an older agent's event decodes");
    }
}
