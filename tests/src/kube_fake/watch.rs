//! Watches as the real API server streams them: one JSON event per line
//! (`ADDED`, `MODIFIED`, `DELETED`, `BOOKMARK`, `ERROR`) on a chunked
//! `application/json` response, replayed from the history after the
//! requested version, then live.
//!
//! A version older than the kept history gets one `ERROR` event with a 410
//! `Expired` Status (`too old resource version: X (Y)`) and the end of the
//! stream: a 200 response, not an HTTP 410, exactly as the real server
//! answers a watch — kube's watcher then re-lists.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Shared;
use super::error::ApiError;
use super::routes::{Params, flag, param};
use super::selector::Selector;
use super::store::{ChangeKind, ResourceType};

/// How often a watch that allows bookmarks gets one.
const BOOKMARK_EVERY: Duration = Duration::from_secs(1);
/// The longest a watch runs without a `timeoutSeconds` (the real server
/// picks 5 to 10 minutes at random).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

fn line(kind: &str, object: &Value) -> Bytes {
    let mut text = json!({ "type": kind, "object": object }).to_string();
    text.push('\n');
    Bytes::from(text)
}

/// One watch request: what it filters on and how it streams.
#[derive(Debug)]
struct Watch {
    rt: Arc<ResourceType>,
    namespace: Option<String>,
    selector: Selector,
    /// The version to resume from; None: from now.
    requested: Option<u64>,
    /// Synthetic ADDED events for the current objects first.
    synthetic_added: bool,
    /// A bookmark marking the end of those (`sendInitialEvents`).
    initial_end_bookmark: bool,
    bookmarks: bool,
    timeout: Duration,
}

impl Watch {
    fn in_scope(&self, rt: &Arc<ResourceType>, namespace: &str) -> bool {
        &self.rt == rt && self.namespace.as_deref().is_none_or(|ns| ns == namespace)
    }

    fn bookmark(&self, rv: u64, initial_end: bool) -> Value {
        let mut meta = json!({ "resourceVersion": rv.to_string() });
        if initial_end {
            meta["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
        }
        json!({ "kind": self.rt.kind, "apiVersion": self.rt.api_version(), "metadata": meta })
    }
}

/// Starts a watch: the response now, its events from a task that ends with
/// the stream's timeout, the client going away, `expire_watches`, or the
/// fake's shutdown.
pub fn serve(
    shared: Arc<Shared>,
    rt: Arc<ResourceType>,
    namespace: Option<String>,
    q: &Params,
) -> Result<Response, ApiError> {
    let selector = Selector::parse(param(q, "labelSelector"), param(q, "fieldSelector"))?;
    let bookmarks = flag(q, "allowWatchBookmarks");
    let initial_events = flag(q, "sendInitialEvents");
    let timeout = match param(q, "timeoutSeconds") {
        Some(t) => Duration::from_secs(t.parse().map_err(|_| ApiError::BadRequest(format!("timeoutSeconds: {t}")))?),
        None => DEFAULT_TIMEOUT,
    };
    let requested = match param(q, "resourceVersion") {
        None | Some("") | Some("0") => None,
        Some(v) => Some(v.parse::<u64>().map_err(|_| ApiError::BadRequest(format!("resourceVersion: {v}")))?),
    };
    let watch = Watch {
        rt,
        namespace,
        selector,
        requested,
        synthetic_added: initial_events || requested.is_none(),
        initial_end_bookmark: initial_events,
        bookmarks,
        timeout,
    };
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    tokio::spawn(run(shared, watch, tx));
    let body = Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    }));
    Ok((StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body).into_response())
}

async fn run(shared: Arc<Shared>, watch: Watch, tx: mpsc::Sender<Bytes>) {
    let store = shared.store.clone();
    let mut shutdown = shared.shutdown.clone();
    let mut changed = store.subscribe();
    let deadline = tokio::time::sleep(watch.timeout);
    tokio::pin!(deadline);
    let mut ticker = tokio::time::interval(BOOKMARK_EVERY);
    ticker.reset();

    // Where the stream starts, and the epoch it belongs to.
    let (mut last, epoch) = match watch.requested {
        Some(rv) => {
            let (_, epoch) = store.current();
            (rv, epoch)
        }
        None => {
            let (items, rv, epoch) = store.snapshot(&watch.rt, watch.namespace.as_deref());
            if watch.synthetic_added {
                for obj in items.iter().filter(|o| watch.selector.matches(o)) {
                    if tx.send(line("ADDED", obj)).await.is_err() {
                        return;
                    }
                }
            }
            if watch.initial_end_bookmark && tx.send(line("BOOKMARK", &watch.bookmark(rv, true))).await.is_err() {
                return;
            }
            (rv, epoch)
        }
    };

    loop {
        if store.current().1 != epoch {
            // expire_watches: the stream ends; the client's next watch from
            // its last version gets 410.
            return;
        }
        let since = match store.since(last) {
            Ok(since) => since,
            Err(expired) => {
                let _ = tx.send(line("ERROR", &expired.status())).await;
                return;
            }
        };
        if since.epoch != epoch {
            return;
        }
        for change in since.changes {
            last = change.rv;
            if !watch.in_scope(&change.key.rt, &change.key.namespace) {
                continue;
            }
            let now_matches = change.kind != ChangeKind::Deleted && watch.selector.matches(&change.object);
            let was_matching = change.old.as_ref().is_some_and(|o| watch.selector.matches(o));
            let kind = match (change.kind, was_matching, now_matches) {
                (ChangeKind::Deleted, true, _) => "DELETED",
                (_, false, true) => "ADDED",
                (_, true, true) => "MODIFIED",
                // Stopped matching the selector: gone, for this watch.
                (ChangeKind::Modified, true, false) => "DELETED",
                _ => continue,
            };
            if tx.send(line(kind, &change.object)).await.is_err() {
                return;
            }
        }
        last = last.max(since.current);

        tokio::select! {
            _ = changed.changed() => {}
            _ = ticker.tick(), if watch.bookmarks => {
                // Every change up to `last` has been sent, so `last` is a
                // version the client may resume from.
                if tx.send(line("BOOKMARK", &watch.bookmark(last, false))).await.is_err() {
                    return;
                }
            }
            () = &mut deadline => return,
            () = super::stopped(&mut shutdown) => return,
            () = tx.closed() => return,
        }
    }
}
