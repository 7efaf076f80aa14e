//! Reading a stdio MCP server's standard output: newline-delimited JSON-RPC
//! messages, framed by rmcp's own codec, with every kind of bad input
//! turned into a value the bridge can log and step over.
//!
//! rmcp's [`JsonRpcMessageCodec`] does the framing (line splitting, the
//! size bound, a leading BOM, `\r\n`) and the JSON parsing, decoding into
//! raw [`Value`]s so that nothing the server says is reshaped on its way to
//! the client. This module drives the decoder itself rather than through a
//! `FramedRead`, because a framed stream ends at the first decode error,
//! and one line of garbage must not cut the bridge off from the server.
//!
//! An oversized message is discarded without being held in memory. So that
//! the request it answered fails at once instead of hanging, its top-level
//! `id` is looked for in its first and last few bytes, where JSON-RPC
//! libraries put it (`{"jsonrpc":"2.0","id":7,…}` or `{…,"id":7}`).

use std::io;

use rmcp::transport::async_rw::{JsonRpcMessageCodec, JsonRpcMessageCodecError};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::bytes::{Buf, BytesMut};
use tokio_util::codec::Decoder;

/// Bytes kept from each end of an oversized message to find its `id`.
const EDGE_BYTES: usize = 4096;

/// One unit of a server's output.
#[derive(Debug, PartialEq)]
pub(super) enum Frame {
    /// A JSON object: a request, notification or response.
    Message(serde_json::Map<String, Value>),
    /// A line that is not a JSON object.
    Garbage,
    /// A line longer than the bound, discarded; `id` is its top-level `id`
    /// where it could be found.
    Oversized { bytes: usize, id: Option<Value> },
}

/// A server's standard output as [`Frame`]s.
pub(super) struct Frames<R> {
    read: R,
    buf: BytesMut,
    max: usize,
    codec: JsonRpcMessageCodec<Value>,
    eof: bool,
}

impl<R: AsyncRead + Unpin> Frames<R> {
    /// Frames of at most `max` bytes (newline excluded).
    pub(super) fn new(read: R, max: usize) -> Self {
        Self {
            read,
            buf: BytesMut::with_capacity(8192),
            max,
            codec: JsonRpcMessageCodec::new_with_max_length(max),
            eof: false,
        }
    }

    /// The next frame; `None` at the end of the output (or when it cannot
    /// be read).
    pub(super) async fn next(&mut self) -> io::Result<Option<Frame>> {
        loop {
            // The codec logs a line it cannot parse, content included, at
            // debug: what a server writes stays out of the agent's log.
            let decoded = tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
                if self.eof { self.codec.decode_eof(&mut self.buf) } else { self.codec.decode(&mut self.buf) }
            });
            match decoded {
                Ok(Some(Value::Object(message))) => return Ok(Some(Frame::Message(message))),
                Ok(Some(_)) | Err(JsonRpcMessageCodecError::Serde(_)) => return Ok(Some(Frame::Garbage)),
                Err(JsonRpcMessageCodecError::MaxLineLengthExceeded) => return self.skip_oversized().await.map(Some),
                Err(JsonRpcMessageCodecError::Io(error)) => return Err(error),
                Err(error) => return Err(io::Error::other(error)),
                Ok(None) if self.eof => return Ok(None),
                Ok(None) => {}
            }
            if self.read.read_buf(&mut self.buf).await? == 0 {
                self.eof = true;
            }
        }
    }

    /// Called when the codec refused a line for its length: the buffer
    /// holds its first `max` bytes or more. Reads on to the line's end,
    /// keeping only its two edges, and starts the codec afresh after it
    /// (the codec's own discarding would hide the tail).
    async fn skip_oversized(&mut self) -> io::Result<Frame> {
        let head = self.buf[..EDGE_BYTES.min(self.buf.len())].to_vec();
        let mut tail: Vec<u8> = Vec::new();
        let mut bytes = 0;
        loop {
            let newline = self.buf.iter().position(|b| *b == b'\n');
            let end = newline.unwrap_or(self.buf.len());
            keep_tail(&mut tail, &self.buf[..end]);
            bytes += end;
            if let Some(newline) = newline {
                self.buf.advance(newline + 1);
                break;
            }
            self.buf.clear();
            if self.read.read_buf(&mut self.buf).await? == 0 {
                self.eof = true;
                break;
            }
        }
        self.codec = JsonRpcMessageCodec::new_with_max_length(self.max);
        if tail.last() == Some(&b'\r') {
            tail.pop();
        }
        Ok(Frame::Oversized { bytes, id: leading_id(&head).or_else(|| trailing_id(&tail)) })
    }
}

/// Appends `bytes` to `tail`, keeping only the last [`EDGE_BYTES`].
fn keep_tail(tail: &mut Vec<u8>, bytes: &[u8]) {
    let keep = bytes.len().min(EDGE_BYTES);
    tail.extend_from_slice(&bytes[bytes.len() - keep..]);
    let excess = tail.len().saturating_sub(EDGE_BYTES);
    tail.drain(..excess);
}

fn skip_ws(bytes: &[u8], mut at: usize) -> usize {
    while bytes.get(at).is_some_and(u8::is_ascii_whitespace) {
        at += 1;
    }
    at
}

/// One JSON value at `at`, and where it ends.
fn value_at(bytes: &[u8], at: usize) -> Option<(Value, usize)> {
    let mut values = serde_json::Deserializer::from_slice(bytes.get(at..)?).into_iter::<Value>();
    let value = values.next()?.ok()?;
    Some((value, at + values.byte_offset()))
}

fn is_scalar_id(value: &Value) -> bool {
    matches!(value, Value::Number(_) | Value::String(_))
}

/// The `id` among the top-level members that precede the first nested
/// value of a message that starts with `head`.
fn leading_id(head: &[u8]) -> Option<Value> {
    let mut at = skip_ws(head, 0);
    if head.get(at) != Some(&b'{') {
        return None;
    }
    at += 1;
    loop {
        let (key, after_key) = value_at(head, skip_ws(head, at))?;
        at = skip_ws(head, after_key);
        if head.get(at) != Some(&b':') {
            return None;
        }
        at = skip_ws(head, at + 1);
        if matches!(head.get(at), Some(b'{' | b'[')) {
            return None;
        }
        let (value, after_value) = value_at(head, at)?;
        if after_value >= head.len() {
            // The value may be cut short by the end of the head.
            return None;
        }
        if key == "id" {
            return is_scalar_id(&value).then_some(value);
        }
        at = skip_ws(head, after_value);
        if head.get(at) != Some(&b',') {
            return None;
        }
        at += 1;
    }
}

/// The `id` of a message that ends with `tail` when `id` is its last
/// member: `…,"id":7}`. The single closing brace after a scalar proves the
/// member is top-level.
fn trailing_id(tail: &[u8]) -> Option<Value> {
    let key = b"\"id\"";
    let mut search_end = tail.len();
    while let Some(start) = tail[..search_end].windows(key.len()).rposition(|window| window == key) {
        search_end = start;
        let before = tail[..start].iter().rev().find(|b| !b.is_ascii_whitespace());
        if !matches!(before, Some(b',' | b'{')) {
            continue;
        }
        let colon = skip_ws(tail, start + key.len());
        if tail.get(colon) != Some(&b':') {
            continue;
        }
        let Some((value, after)) = value_at(tail, skip_ws(tail, colon + 1)) else { continue };
        let close = skip_ws(tail, after);
        if is_scalar_id(&value) && tail.get(close) == Some(&b'}') && skip_ws(tail, close + 1) == tail.len() {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    async fn frames(input: &[u8], max: usize) -> Vec<Frame> {
        let mut frames = Frames::new(input, max);
        let mut all = Vec::new();
        while let Some(frame) = frames.next().await.expect("an in-memory read cannot fail") {
            all.push(frame);
        }
        all
    }

    fn message(value: Value) -> Frame {
        let Value::Object(map) = value else { panic!("not an object") };
        Frame::Message(map)
    }

    #[tokio::test]
    async fn garbage_lines_are_stepped_over() {
        let input = b"{\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\nnot json\n42\n\n{\"jsonrpc\":\"2.0\",\"method\":\"x\"}\r\n{\"tail\":true}";
        assert_eq!(
            frames(input, 1024).await,
            [
                message(json!({"jsonrpc": "2.0", "id": 1, "result": {}})),
                Frame::Garbage,
                Frame::Garbage,
                Frame::Garbage,
                message(json!({"jsonrpc": "2.0", "method": "x"})),
                message(json!({"tail": true})),
            ]
        );
    }

    #[tokio::test]
    async fn an_oversized_line_is_skipped_and_its_id_found_at_either_end() {
        let big = "x".repeat(200);
        let leading = format!("{{\"jsonrpc\": \"2.0\", \"id\": 7, \"result\": {{\"text\": \"{big}\", \"id\": 99}}}}\n");
        let trailing =
            format!("{{\"result\":{{\"text\":\"{big}\",\"id\":98}},\"jsonrpc\":\"2.0\",\"id\":\"s-8\"}}\r\n");
        let nested_last = format!("{{\"result\":{{\"text\":\"{big}\",\"id\":97}}}}\n");
        let input = format!("{leading}{trailing}{nested_last}{{\"id\":9}}\n");
        let got = frames(input.as_bytes(), 100).await;
        assert_eq!(
            got,
            [
                Frame::Oversized { bytes: leading.len() - 1, id: Some(json!(7)) },
                Frame::Oversized { bytes: trailing.len() - 1, id: Some(json!("s-8")) },
                Frame::Oversized { bytes: nested_last.len() - 1, id: None },
                message(json!({"id": 9})),
            ]
        );
    }

    #[tokio::test]
    async fn an_oversized_line_without_an_end_finishes_the_output() {
        let input = format!("{{\"id\":3,\"result\":\"{}", "y".repeat(50_000));
        assert_eq!(frames(input.as_bytes(), 1000).await, [Frame::Oversized { bytes: input.len(), id: Some(json!(3)) }]);
    }
}
