//! The contract's HTTP calls: checked, answered (or failed as the test
//! asked) and recorded. Events and log chunks are taken by the protocol's
//! rules and checked against them; what breaks a rule is a violation.

use standby_protocol::log_chunk::{self, Verdict};
use standby_protocol::{Endpoint, Event, EventKind, LogChunk, LogReceived};
use tokio::time::Instant;

use super::records::{ExecutionRecord, HttpCallRecord};
use super::setup::ServerError;
use super::state::{Inner, Scope};

/// An HTTP request, reduced to what the server looks at.
#[derive(Debug)]
pub(crate) struct HttpRequest<'a> {
    pub endpoint: Endpoint,
    pub method: &'a str,
    pub path: &'a str,
    pub execution_id: Option<&'a str>,
    pub attachment: Option<&'a str>,
    pub headers: &'a axum::http::HeaderMap,
    pub body: &'a [u8],
}

/// An HTTP answer before it becomes an axum response.
#[derive(Debug)]
pub(crate) struct HttpAnswer {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub retry_after: Option<u64>,
}

impl HttpAnswer {
    pub(crate) fn json(status: u16, value: &impl serde::Serialize) -> Self {
        let body = serde_json::to_vec(value).unwrap_or_default();
        Self { status, content_type: "application/json", body, retry_after: None }
    }

    pub(crate) fn bytes(body: Vec<u8>) -> Self {
        Self { status: 200, content_type: "application/octet-stream", body, retry_after: None }
    }

    pub(crate) fn error(status: u16, message: &str) -> Self {
        Self::json(status, &standby_protocol::ErrorBody { error: message.to_owned() })
    }

    pub(crate) fn retry_after(self, seconds: Option<u64>) -> Self {
        Self { retry_after: seconds, ..self }
    }
}

impl Inner {
    /// Answers one HTTP call and records it.
    pub(crate) fn http(&mut self, request: &HttpRequest<'_>, started: Instant) -> HttpAnswer {
        let scope = request.execution_id.map_or(Scope::Spec, |id| Scope::Execution(id, request.endpoint));
        let (holder, checked) = self.check(request.headers, scope);
        let answer = match checked {
            Err(refused) => refused,
            Ok(()) => self.faults.fail(request.endpoint).unwrap_or_else(|| self.answer(request)),
        };
        let event_id = (request.endpoint == Endpoint::Events)
            .then(|| serde_json::from_slice::<serde_json::Value>(request.body).ok())
            .flatten()
            .and_then(|body| Some(body.get("event_id")?.as_str()?.to_owned()));
        self.records.http_calls.push(HttpCallRecord {
            endpoint: request.endpoint,
            method: request.method.to_owned(),
            path: request.path.to_owned(),
            execution_id: request.execution_id.map(str::to_owned),
            credential: holder.map(|holder| holder.kind()),
            status: answer.status,
            started,
            ended: Instant::now(),
            event_id,
        });
        answer
    }

    fn answer(&mut self, request: &HttpRequest<'_>) -> HttpAnswer {
        let Some(execution_id) = request.execution_id else {
            return match &self.spec {
                Some(spec) => HttpAnswer::json(200, spec),
                None => HttpAnswer::error(404, "no spec configured"),
            };
        };
        match request.endpoint {
            Endpoint::Events => self.event(execution_id, request.body),
            Endpoint::Log => self.log_chunk(execution_id, request.body),
            endpoint => match self.executions.get(execution_id) {
                Some(execution) => execution.setup.answer(execution_id, endpoint, request.attachment),
                None => HttpAnswer::error(404, "no such execution"),
            },
        }
    }

    /// Records a distinct event (a retry keeps its `event_id`), checking
    /// it against the contract's order and against delivery: a run starts
    /// only once its delivery was confirmed.
    fn event(&mut self, execution_id: &str, body: &[u8]) -> HttpAnswer {
        let event: Event = match serde_json::from_slice(body) {
            Ok(event) => event,
            Err(error) => {
                let body = String::from_utf8_lossy(body);
                self.violation(format!("malformed event for {execution_id} ({error}): {body}"));
                return HttpAnswer::error(400, "malformed event");
            }
        };
        let Some(record) = self.records.executions.get_mut(execution_id) else {
            return HttpAnswer::error(404, "no such execution");
        };
        record.event_posts += 1;
        let mut problems = Vec::new();
        match record.events.iter().find(|known| known.event_id == event.event_id) {
            Some(known) if *known != event => problems.push(format!(
                "event_id {:?} of {execution_id} reused for a different event: {known:?} then {event:?}",
                event.event_id
            )),
            Some(_) => {}
            None => {
                if event.kind == EventKind::Started && record.confirmed_at.is_none() {
                    problems.push(format!("{execution_id} started before its delivery was confirmed"));
                }
                if let Err(error) = event.kind.may_follow(record.events.iter().map(|known| &known.kind)) {
                    problems.push(format!("{execution_id} reported {} out of order: {error}", event.kind.name()));
                }
                record.events.push(event);
            }
        }
        self.records.violations.extend(problems);
        HttpAnswer::json(202, &serde_json::json!({}))
    }

    /// Takes a chunk by the ledger rule ([`log_chunk::accept`]): appended
    /// after any declared gap, a retry acknowledged without storing its
    /// bytes twice, anything else answered `409` with `{"received": n}`.
    /// A conflict is a violation unless the test made the server forget
    /// part of the log; so is a retry whose bytes differ from those held.
    fn log_chunk(&mut self, execution_id: &str, body: &[u8]) -> HttpAnswer {
        let chunk = serde_json::from_slice::<LogChunk>(body)
            .map_err(|error| error.to_string())
            .and_then(|chunk| Ok((chunk.bytes().map_err(|error| error.to_string())?, chunk)));
        let (bytes, LogChunk { offset, dropped, .. }) = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                self.violation(format!("malformed log chunk for {execution_id}: {error}"));
                return HttpAnswer::error(400, "malformed log chunk");
            }
        };
        if let Err(field) = log_chunk::in_range(offset, dropped, bytes.len() as u64) {
            self.violation(format!("log chunk of {execution_id} past the largest stream position ({field})"));
            return HttpAnswer::error(400, field);
        }
        let Some(record) = self.records.executions.get_mut(execution_id) else {
            return HttpAnswer::error(404, "no such execution");
        };
        let received = record.log_received;
        let verdict = log_chunk::accept(received, offset, dropped, bytes.len() as u64);
        let problem = match verdict {
            Verdict::Conflict if record.log_forgotten => None,
            Verdict::Conflict => Some(format!(
                "log chunk of {execution_id} at offset {offset} (dropped {dropped}) does not follow the {received} bytes received"
            )),
            _ if rewrites(record, offset, &bytes) => {
                Some(format!("log chunk of {execution_id} at offset {offset} rewrites bytes already received"))
            }
            _ => None,
        };
        if let Verdict::Append { gap, end, .. } = verdict {
            if gap > 0 {
                record.log_gaps.push((received, gap));
            }
            record.log.extend_from_slice(verdict.fresh(&bytes));
            record.log_received = end;
        }
        let answer = if verdict == Verdict::Conflict {
            HttpAnswer::json(409, &LogReceived { received })
        } else {
            record.log_posts += 1;
            record.log_chunks.push((offset, bytes.len()));
            HttpAnswer::json(200, &serde_json::json!({ "offset": record.log_received }))
        };
        self.records.violations.extend(problem);
        answer
    }

    /// Forgets all but the first `keep` bytes of an execution's log, as a
    /// server restored from an older snapshot would.
    pub(crate) fn forget_log(&mut self, execution_id: &str, keep: u64) -> Result<(), ServerError> {
        let record = self.execution_record(execution_id)?;
        let keep = keep.min(record.log_received);
        record.log_gaps.retain(|(at, _)| *at < keep);
        let in_gaps: u64 = record.log_gaps.iter().map(|(at, dropped)| (*dropped).min(keep - at)).sum();
        record.log.truncate(usize::try_from(keep - in_gaps).unwrap_or(usize::MAX));
        record.log_received = keep;
        record.log_forgotten = true;
        Ok(())
    }
}

/// Whether a chunk at `offset` carries other bytes than those held for the
/// offsets it shares with them. Held bytes since the last gap map one to
/// one onto the end of the stream; a chunk reaching back before that gap
/// is not compared.
fn rewrites(record: &ExecutionRecord, offset: u64, bytes: &[u8]) -> bool {
    let gap_end = record.log_gaps.last().map_or(0, |(at, dropped)| at + dropped);
    let Ok(back) = usize::try_from(record.log_received.saturating_sub(offset)) else {
        return false;
    };
    let shared = back.min(bytes.len());
    let held = record.log.len().checked_sub(back).and_then(|start| record.log.get(start..start + shared));
    offset >= gap_end && held.is_some_and(|held| held != &bytes[..shared])
}
