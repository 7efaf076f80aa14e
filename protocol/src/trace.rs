//! W3C Trace Context in the assignment (contract 1.3): the server's trace
//! of a run's way to its start, which the agent's install spans join.
//!
//! The field is advisory. An agent that does not know it ignores it, and
//! one given a malformed value ignores that value: a run never fails over
//! tracing. So the assignment's `trace_context` decodes leniently (a value
//! of the wrong shape is absent), and [`TraceContext::parent`] is the one
//! rule of what a well-formed `traceparent` is, used by both halves.

use schemars::JsonSchema;
use serde::{Deserialize, Deserializer, Serialize};

/// The W3C Trace Context carried by an assignment: the `traceparent` and
/// `tracestate` headers' values, as the W3C recommendation spells them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TraceContext {
    /// `00-<32 hex trace id>-<16 hex parent span id>-<2 hex flags>`,
    /// lowercase; the parent is the server's span the agent's spans are
    /// children of.
    #[schemars(regex(pattern = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}"))]
    pub traceparent: String,
    /// Vendor entries, passed on unchanged to the agent's spans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
}

/// What a well-formed `traceparent` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    /// The trace flags (`01`: sampled).
    pub flags: u8,
}

/// Why a `traceparent` is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("traceparent is not `version-traceid-parentid-flags` in lowercase hex")]
    Shape,
    #[error("traceparent version ff is invalid")]
    Version,
    #[error("traceparent has an all-zero trace id or parent id")]
    Zero,
}

/// Longest `tracestate` kept (the recommendation's bound).
pub const TRACESTATE_MAX: usize = 512;
/// Most `tracestate` list members kept.
pub const TRACESTATE_MEMBERS_MAX: usize = 32;

impl TraceContext {
    /// The context of a span: version `00`, sampled.
    pub fn new(parent: TraceParent, tracestate: Option<String>) -> Self {
        Self { traceparent: parent.to_string(), tracestate }
    }

    /// The parent this context names, if its `traceparent` is well formed.
    pub fn parent(&self) -> Result<TraceParent, TraceError> {
        TraceParent::parse(&self.traceparent)
    }

    /// The `tracestate` if it is one the recommendation allows (at most
    /// [`TRACESTATE_MAX`] characters, [`TRACESTATE_MEMBERS_MAX`] members,
    /// each `key=value` of printable ASCII); `None` otherwise: a bad
    /// `tracestate` is dropped, the `traceparent` is still used.
    pub fn valid_tracestate(&self) -> Option<&str> {
        let state = self.tracestate.as_deref()?;
        let members: Vec<&str> = state.split(',').map(str::trim).filter(|m| !m.is_empty()).collect();
        let well_formed = state.len() <= TRACESTATE_MAX
            && !members.is_empty()
            && members.len() <= TRACESTATE_MEMBERS_MAX
            && members.iter().all(|member| {
                member.split_once('=').is_some_and(|(key, value)| {
                    !key.is_empty()
                        && key.len() <= 256
                        && key.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-*/@".contains(&b))
                        && !value.is_empty()
                        && value.len() <= 256
                        && value.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b',' && b != b'=')
                })
            });
        well_formed.then_some(state)
    }
}

impl TraceParent {
    /// Parses a `traceparent` value. A version other than `00` is read as
    /// `00` is (its first four fields), as the recommendation asks of a
    /// parser that meets a newer version; `ff` is invalid.
    pub fn parse(text: &str) -> Result<Self, TraceError> {
        let bytes = text.as_bytes();
        let dashes_at = |at: usize| bytes.get(at) == Some(&b'-');
        if bytes.len() < 55 || !dashes_at(2) || !dashes_at(35) || !dashes_at(52) {
            return Err(TraceError::Shape);
        }
        let version = hex::<1>(&text[0..2]).ok_or(TraceError::Shape)?[0];
        if version == 0xff {
            return Err(TraceError::Version);
        }
        if (version == 0 && bytes.len() != 55) || (version != 0 && bytes.len() > 55 && !dashes_at(55)) {
            return Err(TraceError::Shape);
        }
        let trace_id = hex::<16>(&text[3..35]).ok_or(TraceError::Shape)?;
        let parent_id = hex::<8>(&text[36..52]).ok_or(TraceError::Shape)?;
        let flags = hex::<1>(&text[53..55]).ok_or(TraceError::Shape)?[0];
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return Err(TraceError::Zero);
        }
        Ok(Self { trace_id, parent_id, flags })
    }
}

impl std::fmt::Display for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "00-")?;
        self.trace_id.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, "-")?;
        self.parent_id.iter().try_for_each(|b| write!(f, "{b:02x}"))?;
        write!(f, "-{:02x}", self.flags)
    }
}

/// `N` bytes from `2N` lowercase hex digits.
fn hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let bytes = text.as_bytes();
    if bytes.len() != 2 * N {
        return None;
    }
    let mut out = [0; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// `deserialize_with` of the assignment's `trace_context`: a value of any
/// other shape is taken as absent, so it can never fail the assignment.
pub(crate) fn lenient<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<TraceContext>, D::Error> {
    let value = serde_json::Value::deserialize(deserializer)?;
    Ok(serde_json::from_value(value).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_and_prints_the_recommendations_example() {
        let parent = TraceParent::parse(GOOD).expect("well formed");
        assert_eq!(parent.trace_id[0], 0x4b);
        assert_eq!(parent.parent_id[7], 0xb7);
        assert_eq!(parent.flags, 1);
        assert_eq!(parent.to_string(), GOOD);
    }

    #[test]
    fn malformed_values_are_refused() {
        let cases = [
            ("", TraceError::Shape),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7", TraceError::Shape),
            ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", TraceError::Shape),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", TraceError::Shape),
            ("00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", TraceError::Shape),
            ("00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", TraceError::Shape),
            ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", TraceError::Version),
            ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", TraceError::Zero),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", TraceError::Zero),
            ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\u{e9}", TraceError::Shape),
        ];
        for (text, error) in cases {
            assert_eq!(TraceParent::parse(text), Err(error), "{text:?}");
        }
    }

    #[test]
    fn a_newer_version_is_read_as_00() {
        let newer = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-adds";
        assert_eq!(TraceParent::parse(newer).map(|p| p.flags), Ok(1));
        let glued = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x";
        assert_eq!(TraceParent::parse(glued), Err(TraceError::Shape));
    }

    #[test]
    fn a_bad_tracestate_is_dropped_alone() {
        let with = |state: &str| TraceContext { traceparent: GOOD.into(), tracestate: Some(state.into()) };
        assert!(with("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE").valid_tracestate().is_some());
        for bad in ["", "novalue", "Upper=1", "a=b=c", &"k=v,".repeat(40), &format!("k={}", "v".repeat(600))] {
            let context = with(bad);
            assert_eq!(context.valid_tracestate(), None, "{bad:?}");
            assert!(context.parent().is_ok());
        }
    }

    #[test]
    fn a_context_of_the_wrong_shape_decodes_as_absent() {
        #[derive(Deserialize)]
        struct Holder {
            #[serde(default, deserialize_with = "lenient")]
            trace_context: Option<TraceContext>,
        }
        for text in [r#"{"trace_context": 7}"#, r#"{"trace_context": {"tracestate": "a=b"}}"#, r#"{}"#] {
            let holder: Holder = serde_json::from_str(text).expect("never fails");
            assert_eq!(holder.trace_context, None, "{text}");
        }
    }
}
