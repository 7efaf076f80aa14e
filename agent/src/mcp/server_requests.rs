//! The books of a server's requests handed to clients: which session each
//! went to, under which id, and what becomes of it when the client answers,
//! the server cancels it, the session ends or the process goes away. No IO:
//! the connection carries out what these answer.
//!
//! A server's request reaches its client under an id of the bridge's own,
//! as a client's request reaches the server: the server's ids are its own
//! numbering, they start again with each process and may equal a client's
//! own request ids, so a client's answer is matched by the bridge's id and
//! only from the session the request went to.
//!
//! Each entry holds a `ticket`: the room its cancellation takes in the
//! session's stream, reserved when the request was handed, so that a client
//! is always told of a request the server gave up (its handler would
//! otherwise wait forever). Settled otherwise, the ticket is dropped.

use std::collections::HashMap;

use serde_json::Value;

/// One server request waiting for its client's answer.
#[derive(Debug)]
struct Outstanding<T> {
    /// The id the server gave it, restored on the answer.
    server_id: Value,
    session: String,
    ticket: T,
}

/// What a client's answer is to the books.
#[derive(Debug, PartialEq)]
pub(super) enum Answered {
    /// The answer to a waiting request: forward it under the server's id.
    Forward(Value),
    /// No such request waits (it was answered, cancelled, or its process
    /// is gone): the answer is ignored.
    Unknown,
    /// The request went to another session: the answer is ignored.
    OtherSession,
}

/// The server requests waiting for clients' answers, at most `limit`.
#[derive(Debug)]
pub(super) struct ServerRequests<T> {
    limit: usize,
    entries: HashMap<u64, Outstanding<T>>,
}

impl<T> ServerRequests<T> {
    pub(super) fn new(limit: usize) -> Self {
        Self { limit, entries: HashMap::new() }
    }

    /// Records a request about to be sent to `session` under `bridge_id`,
    /// with its cancellation's `ticket`; false (and nothing recorded) when
    /// `limit` requests already wait.
    pub(super) fn admit(&mut self, bridge_id: u64, server_id: Value, session: &str, ticket: T) -> bool {
        if self.entries.len() >= self.limit {
            return false;
        }
        self.entries.insert(bridge_id, Outstanding { server_id, session: session.to_owned(), ticket });
        true
    }

    /// A client's answer, under the id it was given (`id`), from `session`.
    pub(super) fn answer(&mut self, id: &Value, session: Option<&str>) -> Answered {
        let Some(bridge_id) = id.as_u64() else { return Answered::Unknown };
        match self.entries.get(&bridge_id) {
            None => Answered::Unknown,
            Some(entry) if Some(entry.session.as_str()) != session => Answered::OtherSession,
            Some(_) => {
                self.entries.remove(&bridge_id).map_or(Answered::Unknown, |entry| Answered::Forward(entry.server_id))
            }
        }
    }

    /// The server cancelled its request `server_id` (it gave up waiting):
    /// the bridge id and the ticket to tell its client with, once.
    pub(super) fn cancelled(&mut self, server_id: &Value) -> Option<(u64, T)> {
        let bridge_id = self.entries.iter().find(|(_, entry)| &entry.server_id == server_id).map(|(id, _)| *id)?;
        self.entries.remove(&bridge_id).map(|entry| (bridge_id, entry.ticket))
    }

    /// A session ended: the server ids of its requests, which the server
    /// is answered with an error for.
    pub(super) fn session_ended(&mut self, session: &str) -> Vec<Value> {
        let ids: Vec<u64> =
            self.entries.iter().filter(|(_, entry)| entry.session == session).map(|(id, _)| *id).collect();
        ids.into_iter().filter_map(|id| self.entries.remove(&id)).map(|entry| entry.server_id).collect()
    }

    /// The process is gone: every waiting request, as the bridge id and
    /// the ticket to tell its client it was cancelled with.
    pub(super) fn drain(&mut self) -> Vec<(u64, T)> {
        self.entries.drain().map(|(id, entry)| (id, entry.ticket)).collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn an_answer_is_forwarded_once_under_the_servers_id_and_only_from_its_session() {
        let mut books = ServerRequests::new(4);
        assert!(books.admit(7, json!(0), "a", ()));
        assert_eq!(books.answer(&json!(7), Some("b")), Answered::OtherSession, "another session cannot answer it");
        assert_eq!(books.answer(&json!(7), None), Answered::OtherSession, "nor a sessionless client");
        assert_eq!(books.answer(&json!("7"), Some("a")), Answered::Unknown, "the bridge's ids are numbers");
        assert_eq!(books.answer(&json!(7), Some("a")), Answered::Forward(json!(0)));
        assert_eq!(books.answer(&json!(7), Some("a")), Answered::Unknown, "a second answer is ignored");
        assert_eq!(books.len(), 0);
    }

    #[test]
    fn at_most_limit_requests_wait() {
        let mut books = ServerRequests::new(2);
        assert!(books.admit(1, json!("x"), "a", ()));
        assert!(books.admit(2, json!("y"), "a", ()));
        assert!(!books.admit(3, json!("z"), "b", ()), "full");
        assert_eq!(books.answer(&json!(2), Some("a")), Answered::Forward(json!("y")));
        assert!(books.admit(3, json!("z"), "b", ()), "room again");
    }

    #[test]
    fn a_servers_cancellation_names_the_request_by_its_own_id() {
        let mut books = ServerRequests::new(4);
        books.admit(5, json!(1), "a", "ticket 5");
        books.admit(6, json!(2), "b", "ticket 6");
        assert_eq!(books.cancelled(&json!(2)), Some((6, "ticket 6")));
        assert_eq!(books.cancelled(&json!(2)), None, "once");
        assert_eq!(books.answer(&json!(6), Some("b")), Answered::Unknown, "a late answer is ignored");
        assert_eq!(books.answer(&json!(5), Some("a")), Answered::Forward(json!(1)));
    }

    #[test]
    fn an_ended_session_and_a_gone_process_leave_nothing_waiting() {
        let mut books = ServerRequests::new(4);
        books.admit(1, json!(10), "a", "ticket 1");
        books.admit(2, json!(11), "b", "ticket 2");
        books.admit(3, json!(12), "a", "ticket 3");
        let mut ended = books.session_ended("a");
        ended.sort_by_key(|id| id.as_u64());
        assert_eq!(ended, [json!(10), json!(12)]);
        assert_eq!(books.drain(), [(2, "ticket 2")]);
        assert_eq!(books.len(), 0);
    }
}
