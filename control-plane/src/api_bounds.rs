//! What one API request (the agent's or a user's) may carry and one answer
//! may hold, as pure functions: the control socket's buffers and message
//! size (the server's and the follower relay's), the bounds of an event,
//! the paging parameters of the lists, and the view of a stored log with
//! its gap markers (`docs/operations.md`, "Per-run bounds";
//! `docs/protocol.md`, "The log endpoint").

use axum::extract::ws::WebSocketUpgrade;
use standby_protocol::{Event, EventKind};

/// Agents send heartbeats of under a hundred bytes: a small read buffer per
/// socket keeps thousands of idle standbys cheap.
const READ_BUFFER: usize = 4 * 1024;
/// Anything an agent may legally send is far below this; more fails the
/// connection instead of making the server hold it.
const MAX_MESSAGE: usize = 64 * 1024;
/// A peer that stops reading cannot make the server buffer more than this.
const MAX_WRITE_BUFFER: usize = 256 * 1024;

/// An agent's socket as the server holds it: the buffers and bounds above.
/// A follower holds the sockets of its agents the same way
/// (`cluster::link`).
pub(crate) fn agent_socket(upgrade: WebSocketUpgrade) -> WebSocketUpgrade {
    upgrade
        .read_buffer_size(READ_BUFFER)
        .write_buffer_size(0)
        .max_write_buffer_size(MAX_WRITE_BUFFER)
        .max_message_size(MAX_MESSAGE)
        .max_frame_size(MAX_MESSAGE)
}

/// Largest body of `POST /v1/executions/{id}/events`.
pub const EVENT_BODY_MAX: usize = 64 * 1024;
/// Largest body of `POST /v1/executions/{id}/log`: the agent sends at most
/// 64 KiB of output per chunk (`MAX_BATCH` in `agent/src/logship.rs`), 88
/// KiB as base64 in JSON; other agents get room for 768 KiB.
pub const LOG_BODY_MAX: usize = 1024 * 1024;
/// Longest `event_id`: agents send a UUID or a short counter.
pub const EVENT_ID_MAX: usize = 128;
/// Longest `stage` of an `install_failed` event: a word.
pub const STAGE_MAX: usize = 128;
/// `message` of an `install_failed` event is cut to this many bytes: it is
/// the run's `error`, shown in every list of runs.
pub const MESSAGE_MAX: usize = 4096;

/// Runs, sandboxes or events per page unless `limit` says otherwise.
pub const PAGE_DEFAULT: usize = 100;
/// Most items per page.
pub const PAGE_MAX: usize = 1000;

/// A field of a request out of bounds, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfBounds {
    pub field: &'static str,
    pub problem: String,
}

/// Checks an event's fields: an `event_id` or `stage` over its bound is
/// refused; an `install_failed` message over [`MESSAGE_MAX`] is cut (at a
/// character boundary, marked), since refusing it would lose the reason a
/// run failed.
pub fn bound_event(mut event: Event) -> Result<Event, OutOfBounds> {
    if event.event_id.is_empty() || event.event_id.len() > EVENT_ID_MAX {
        return Err(OutOfBounds { field: "event_id", problem: format!("must be 1 to {EVENT_ID_MAX} bytes") });
    }
    if let EventKind::InstallFailed { stage, message, .. } = &mut event.kind {
        if stage.len() > STAGE_MAX {
            return Err(OutOfBounds { field: "stage", problem: format!("must be at most {STAGE_MAX} bytes") });
        }
        if message.len() > MESSAGE_MAX {
            const CUT: &str = " [truncated]";
            let mut end = MESSAGE_MAX - CUT.len();
            while !message.is_char_boundary(end) {
                end -= 1;
            }
            message.truncate(end);
            message.push_str(CUT);
        }
    }
    Ok(event)
}

/// `limit` of a list: [`PAGE_DEFAULT`] when absent, at most [`PAGE_MAX`].
pub fn page_limit(raw: Option<&str>) -> Result<usize, OutOfBounds> {
    let Some(raw) = raw else { return Ok(PAGE_DEFAULT) };
    match raw.parse::<usize>() {
        Ok(limit) if (1..=PAGE_MAX).contains(&limit) => Ok(limit),
        _ => Err(OutOfBounds { field: "limit", problem: format!("must be a number from 1 to {PAGE_MAX}") }),
    }
}

/// Most digits of a cursor's position: 18 always fit an `i64`.
const CURSOR_AT_DIGITS: usize = 18;
/// Longest id in a cursor: ids are minted far shorter.
const CURSOR_ID_MAX: usize = 128;

/// What [`parse_cursor`] accepts, as the OpenAPI document states it:
/// every string this matches names a position, so a client (or a fuzzer)
/// holding a schema-valid cursor is never refused.
pub const CURSOR_PATTERN: &str = "^[0-9]{1,18}:[A-Za-z0-9_-]{0,128}$";

/// The cursor after an item with sort key `(at, id)`: `<at>:<id>`, URL-safe
/// as it stands. Clients treat it as opaque; it is plain so that the
/// document's pattern ([`CURSOR_PATTERN`]) can say exactly which strings
/// are cursors.
pub fn cursor(at: i64, id: &str) -> String {
    format!("{at}:{id}")
}

/// The sort key a [`cursor`] names: exactly the strings [`CURSOR_PATTERN`]
/// matches.
pub fn parse_cursor(raw: &str) -> Result<(i64, String), OutOfBounds> {
    let bad = || OutOfBounds { field: "cursor", problem: "is not a cursor this server gave".into() };
    let (at, id) = raw.split_once(':').ok_or_else(bad)?;
    let id_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-');
    if at.is_empty() || at.len() > CURSOR_AT_DIGITS || !at.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    if id.len() > CURSOR_ID_MAX || !id.chars().all(id_char) {
        return Err(bad());
    }
    Ok((at.parse().map_err(|_| bad())?, id.to_owned()))
}

/// The line shown where the agent dropped `bytes` of output.
pub fn gap_marker(bytes: u64) -> String {
    format!("\n[standby: {bytes} bytes of output were dropped by the agent here]\n")
}

/// The line a log that reached its cap ends with.
pub fn cap_marker(bytes: u64) -> String {
    format!("\n[standby: the log reached its cap: {bytes} more bytes of output were dropped]\n")
}

/// Renders a range of a stored log, page by page of stored pieces, never
/// holding more than one page: the bytes held, a [`gap_marker`] where the
/// agent declared a gap, and a [`cap_marker`] at the end when bytes past
/// the last piece were dropped. Positions are stream offsets (what the
/// agent counted); markers take no room in them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogView {
    position: u64,
    to: u64,
    over_cap: u64,
}

impl LogView {
    /// The range `[from, to)` of a log whose ledger counted `over_cap`
    /// bytes past its cap.
    pub fn new(from: u64, to: u64, over_cap: u64) -> Self {
        Self { position: from.min(to), to, over_cap }
    }

    /// Where the next page of pieces starts.
    pub fn position(&self) -> u64 {
        self.position
    }

    pub fn done(&self) -> bool {
        self.position >= self.to
    }

    /// The bytes of a page of pieces (in order, as [`crate::store::Store::log_pieces`]
    /// gives them from [`Self::position`]).
    pub fn feed(&mut self, pieces: &[(u64, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (start, data) in pieces {
            let end = start + data.len() as u64;
            if self.done() {
                break;
            }
            if end <= self.position {
                continue;
            }
            if *start > self.position {
                let gap_end = (*start).min(self.to);
                out.extend(gap_marker(gap_end - self.position).into_bytes());
                self.position = gap_end;
                if self.done() {
                    break;
                }
            }
            let from = usize::try_from(self.position - start).unwrap_or(usize::MAX);
            let until = usize::try_from(end.min(self.to) - start).unwrap_or(usize::MAX);
            out.extend_from_slice(&data[from..until]);
            self.position = start + until as u64;
        }
        out
    }

    /// No piece is left: the marker of what the range holds past the last
    /// one, if anything.
    pub fn finish(&mut self) -> Vec<u8> {
        if self.done() {
            return Vec::new();
        }
        let missing = self.to - self.position;
        self.position = self.to;
        if self.over_cap > 0 { cap_marker(missing) } else { gap_marker(missing) }.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use standby_protocol::{Cause, Stage};

    use super::*;

    fn render(view: &mut LogView, pieces: &[(u64, &[u8])]) -> String {
        let pieces: Vec<(u64, Vec<u8>)> = pieces.iter().map(|(start, data)| (*start, data.to_vec())).collect();
        let mut out = Vec::new();
        // One piece per page, as a store page of one row would give them.
        while !view.done() {
            let page: Vec<_> = pieces
                .iter()
                .filter(|(start, data)| start + data.len() as u64 > view.position())
                .take(1)
                .cloned()
                .collect();
            if page.is_empty() {
                out.extend(view.finish());
            } else {
                out.extend(view.feed(&page));
            }
        }
        String::from_utf8(out).expect("text")
    }

    #[test]
    fn a_range_of_a_log_is_its_bytes() {
        let pieces: &[(u64, &[u8])] = &[(0, b"hello "), (6, b"world"), (11, b"!\n")];
        assert_eq!(render(&mut LogView::new(0, 13, 0), pieces), "hello world!\n");
        assert_eq!(render(&mut LogView::new(3, 8, 0), pieces), "lo wo");
        assert_eq!(render(&mut LogView::new(6, 11, 0), pieces), "world");
        assert_eq!(render(&mut LogView::new(13, 13, 0), pieces), "");
        assert_eq!(render(&mut LogView::new(20, 13, 0), pieces), "", "a range past the end is empty");
    }

    #[test]
    fn gaps_and_the_cap_are_marked() {
        let pieces: &[(u64, &[u8])] = &[(0, b"abc"), (10, b"def")];
        assert_eq!(render(&mut LogView::new(0, 13, 0), pieces), format!("abc{}def", gap_marker(7)));
        assert_eq!(render(&mut LogView::new(5, 11, 0), pieces), format!("{}d", gap_marker(5)));
        assert_eq!(render(&mut LogView::new(0, 20, 7), pieces), format!("abc{}def{}", gap_marker(7), cap_marker(7)));
    }

    #[test]
    fn events_are_bounded() {
        let event = |id: &str, message: &str| {
            Event::new(id, EventKind::install_failed(Stage::Secrets, Cause::Network, message))
        };
        assert_eq!(bound_event(event(&"x".repeat(129), "m")).map_err(|e| e.field), Err("event_id"));
        assert_eq!(bound_event(event("", "m")).map_err(|e| e.field), Err("event_id"));
        let long = "é".repeat(MESSAGE_MAX);
        let EventKind::InstallFailed { message, .. } = bound_event(event("e1", &long)).expect("cut").kind else {
            panic!("the kind is kept");
        };
        assert!(message.len() <= MESSAGE_MAX && message.ends_with(" [truncated]"), "{}", message.len());
        assert_eq!(bound_event(event("e1", "short")).expect("kept"), event("e1", "short"));
    }

    #[test]
    fn paging_parameters() {
        assert_eq!(page_limit(None), Ok(PAGE_DEFAULT));
        assert_eq!(page_limit(Some("1000")), Ok(1000));
        for bad in ["0", "1001", "x", "-1"] {
            assert_eq!(page_limit(Some(bad)).map_err(|e| e.field), Err("limit"), "{bad}");
        }
        assert_eq!(parse_cursor(&cursor(1_700_000, "exe_a1")), Ok((1_700_000, "exe_a1".into())));
        assert_eq!(parse_cursor(&cursor(7, "")), Ok((7, String::new())));
        assert_eq!(parse_cursor(&format!("{}:x", "9".repeat(18))), Ok((999_999_999_999_999_999, "x".into())));
        let long_id = format!("1:{}", "a".repeat(129));
        for bad in ["", "!!", ":", "1", "-1:x", "+1:x", "1:a:b", "1:a b", &format!("{}:x", "9".repeat(19)), &long_id] {
            assert_eq!(parse_cursor(bad).map_err(|e| e.field), Err("cursor"), "{bad}");
        }
    }
}
