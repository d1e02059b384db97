//! The Docker Engine API, read bounded: the engine's answers are trusted no more than an
//! upstream's.
//!
//! bollard's own transports read an answer whole, however long, and its event decoder parses a
//! line that has not ended yet again on every read. An engine that answers without end (a bug, a
//! proxy in front of it, a compromised host) would have grown the gateway until the kernel killed
//! it — the gateway the cause of the outage. So every connection to the engine is opened here:
//!
//! - [`docker`] gives bollard a transport of its own: one connection a request (the engine is
//!   local; a unix socket costs microseconds), whose reads fail past [`ANSWER_LIMIT`] bytes;
//! - [`call`] is a raw JSON call on the same kind of connection (service specs round-trip as raw
//!   JSON, see `discovery`);
//! - [`events`] follows `/events` itself, one line at a time, each line at most
//!   [`EVENT_LINE_LIMIT`] bytes ([`Lines`]).
//!
//! `DOCKER_HOST` is read as bollard reads it without TLS: `unix://` (the default,
//! `/var/run/docker.sock`), `tcp://` or `http://`.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The most of one engine answer read, framing included: a list of a few thousand services or
/// containers is well under it.
pub const ANSWER_LIMIT: u64 = 16 * 1024 * 1024;

/// The longest event line read; an event is about a kilobyte (labels included).
pub const EVENT_LINE_LIMIT: usize = 1024 * 1024;

/// Where the engine listens.
pub fn host() -> String {
    std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into())
}

/// A unix socket or a TCP connection (tokio-util's `Either` is both `AsyncRead` and
/// `AsyncWrite` over either).
type Stream = tokio_util::either::Either<tokio::net::UnixStream, tokio::net::TcpStream>;

/// A connection to the engine whose reads fail once more than `left` bytes came in. Writes go
/// straight through.
struct Capped {
    stream: Stream,
    left: u64,
}

impl AsyncRead for Capped {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = polled {
            let n = (buf.filled().len() - before) as u64;
            match this.left.checked_sub(n) {
                Some(left) => this.left = left,
                None => return Poll::Ready(Err(too_long())),
            }
        }
        polled
    }
}

fn too_long() -> io::Error {
    io::Error::other(format!(
        "the engine's answer is longer than {ANSWER_LIMIT} bytes"
    ))
}

impl AsyncWrite for Capped {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// Opens a connection to the engine for one request; `limit` bounds what it may read in all.
async fn connect(limit: u64) -> io::Result<TokioIo<Capped>> {
    let host = host();
    let stream = if let Some(path) = host.strip_prefix("unix://") {
        Stream::Left(
            tokio::net::UnixStream::connect(path)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?,
        )
    } else if let Some(addr) = host
        .strip_prefix("tcp://")
        .or_else(|| host.strip_prefix("http://"))
    {
        let addr = addr.trim_end_matches('/');
        Stream::Right(
            tokio::net::TcpStream::connect(addr)
                .await
                .map_err(|e| io::Error::new(e.kind(), format!("{addr}: {e}")))?,
        )
    } else {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("unsupported DOCKER_HOST scheme (unix://, tcp:// or http://): {host}"),
        ));
    };
    Ok(TokioIo::new(Capped {
        stream,
        left: limit,
    }))
}

/// Sends `req` on a connection of its own and returns the answer's head; the connection closes
/// once the body has been read (or dropped).
async fn send<B>(
    req: hyper::Request<B>,
    limit: u64,
) -> Result<hyper::Response<hyper::body::Incoming>, Box<dyn std::error::Error + Send + Sync>>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let io = connect(limit).await?;
    let (mut tx, conn) = hyper::client::conn::http1::handshake(io).await?;
    // Ends when the answer is read or dropped: `tx` goes with this function.
    tokio::spawn(conn);
    Ok(tx.send_request(req).await?)
}

/// The request as the engine should see it: origin-form and `Host: docker` (bollard builds an
/// absolute URI from the address it was given).
fn origin_form<B>(req: hyper::Request<B>) -> Result<hyper::Request<B>, http::Error> {
    let (mut parts, body) = req.into_parts();
    let pq = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();
    parts.uri = pq.parse()?;
    parts
        .headers
        .insert(http::header::HOST, http::HeaderValue::from_static("docker"));
    Ok(hyper::Request::from_parts(parts, body))
}

/// bollard over [`send`]: each call its own connection, its answer read to at most
/// [`ANSWER_LIMIT`] bytes (past it the call fails with a body error naming the limit).
pub fn docker() -> Result<bollard::Docker, bollard::errors::Error> {
    bollard::Docker::connect_with_custom_transport(
        |req: bollard::BollardRequest| async move {
            let req = origin_form(req)?;
            send(req, ANSWER_LIMIT)
                .await
                .map_err(|err| bollard::errors::Error::IOError {
                    err: io::Error::other(err),
                })
        },
        Some("http://docker"),
        // Every call is bounded by `docker.timeout` around it.
        120,
        bollard::API_DEFAULT_VERSION,
    )
}

/// A raw Engine API call: `body` as JSON, the answer parsed as JSON (`Null` when empty). A
/// status other than 2xx is an error with the engine's message (clipped).
pub async fn call(method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "docker")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            body.map(|b| b.to_string()).unwrap_or_default(),
        )))
        .map_err(|e| e.to_string())?;
    let resp = send(req, ANSWER_LIMIT)
        .await
        .map_err(|e| crate::upstream::error_chain(&*e))?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| crate::upstream::error_chain(&e))?
        .to_bytes();
    if !status.is_success() {
        Err(format!(
            "{status}: {}",
            clip(&String::from_utf8_lossy(&bytes))
        ))
    } else if bytes.is_empty() {
        Ok(Value::Null)
    } else {
        serde_json::from_slice(&bytes).map_err(|e| e.to_string())
    }
}

/// The most of an engine's message kept in `/status`, a log line or an `endpoint_events` row.
pub const MESSAGE_LIMIT: usize = 500;

/// `s` cut to [`MESSAGE_LIMIT`] characters, marked when cut.
pub fn clip(s: &str) -> String {
    match s.char_indices().nth(MESSAGE_LIMIT) {
        None => s.to_string(),
        Some((at, _)) => format!("{}… ({} bytes in all)", &s[..at], s.len()),
    }
}

/// An event the watcher wakes for: its action and the container's id.
#[derive(Debug, Deserialize, PartialEq)]
pub struct Event {
    #[serde(rename = "Action")]
    pub action: Option<String>,
    #[serde(rename = "Actor")]
    pub actor: Option<Actor>,
}

#[derive(Debug, Deserialize, PartialEq)]
pub struct Actor {
    #[serde(rename = "ID")]
    pub id: Option<String>,
}

/// Opens the engine's event stream for `filters` (the Engine API's JSON filter map) and
/// returns a stream of its events (lines that are not one are skipped). It ends with an error
/// when the connection fails or closes, or a line passes [`EVENT_LINE_LIMIT`].
pub async fn events(
    filters: &Value,
) -> Result<impl futures_util::Stream<Item = Result<Event, String>> + use<>, String> {
    let path = format!("/events?filters={}", percent_encode(&filters.to_string()));
    let req = hyper::Request::builder()
        .uri(path)
        .header("host", "docker")
        .body(http_body_util::Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = send(req, u64::MAX)
        .await
        .map_err(|e| crate::upstream::error_chain(&*e))?;
    if !resp.status().is_success() {
        return Err(format!("/events answered {}", resp.status()));
    }
    let body = resp.into_body();
    let lines = Lines::new(EVENT_LINE_LIMIT);
    Ok(futures_util::stream::unfold(
        (
            body,
            lines,
            std::collections::VecDeque::<Vec<u8>>::new(),
            false,
        ),
        |(mut body, mut lines, mut ready, mut done)| async move {
            loop {
                if let Some(line) = ready.pop_front() {
                    // A line that is not an event (not JSON, another shape) is skipped.
                    let item = serde_json::from_slice::<Event>(&line).ok();
                    if let Some(ev) = item {
                        return Some((Ok(ev), (body, lines, ready, done)));
                    }
                    continue;
                }
                if done {
                    return None;
                }
                let err = match body.frame().await {
                    None => "the engine closed its event stream".to_string(),
                    Some(Err(e)) => crate::upstream::error_chain(&e),
                    Some(Ok(frame)) => {
                        let Ok(data) = frame.into_data() else {
                            continue;
                        };
                        match lines.push(&data) {
                            Ok(got) => {
                                ready.extend(got);
                                continue;
                            }
                            Err(e) => e,
                        }
                    }
                };
                done = true;
                return Some((Err(err), (body, lines, ready, done)));
            }
        },
    ))
}

/// Splits a byte stream into lines (without their `\n`, blank lines dropped), refusing a line
/// longer than its limit — what is held is never more than the limit.
#[derive(Debug)]
pub struct Lines {
    partial: Vec<u8>,
    limit: usize,
}

impl Lines {
    pub fn new(limit: usize) -> Lines {
        Lines {
            partial: Vec::new(),
            limit,
        }
    }

    /// The lines `chunk` completes, or an error when the line in progress passes the limit.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let mut out = Vec::new();
        let mut rest = chunk;
        while let Some(at) = memchr::memchr(b'\n', rest) {
            self.take(&rest[..at])?;
            let line = std::mem::take(&mut self.partial);
            if !line.iter().all(u8::is_ascii_whitespace) {
                out.push(line);
            }
            rest = &rest[at + 1..];
        }
        self.take(rest)?;
        Ok(out)
    }

    fn take(&mut self, bytes: &[u8]) -> Result<(), String> {
        if self.partial.len() + bytes.len() > self.limit {
            self.partial = Vec::new();
            return Err(format!(
                "an event line from the engine is longer than {} bytes",
                self.limit
            ));
        }
        self.partial.extend_from_slice(bytes);
        Ok(())
    }
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
pub fn percent_encode(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lines_are_split_across_chunks_and_blank_lines_dropped() {
        let mut l = Lines::new(64);
        assert_eq!(l.push(b"{\"a\"").unwrap(), Vec::<Vec<u8>>::new());
        assert_eq!(
            l.push(b":1}\n\n{\"b\":2}\r\n{").unwrap(),
            vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}\r".to_vec()]
        );
        assert_eq!(l.push(b"}\n").unwrap(), vec![b"{}".to_vec()]);
    }

    #[test]
    fn a_line_past_the_limit_is_refused_across_chunks() {
        let mut l = Lines::new(8);
        assert!(l.push(b"12345").is_ok());
        let e = l.push(b"6789").unwrap_err();
        assert!(e.contains("longer than 8 bytes"), "{e}");
        // Exactly the limit is a line.
        let mut l = Lines::new(8);
        assert_eq!(l.push(b"12345678\n").unwrap(), vec![b"12345678".to_vec()]);
    }

    #[test]
    fn events_parse_what_the_watcher_needs_and_skip_the_rest() {
        let ev: Event = serde_json::from_slice(
            br#"{"status":"die","id":"abc","Type":"container","Action":"die","Actor":{"ID":"abc","Attributes":{"autohedge.endpoint":"x"}},"time":1}"#,
        )
        .unwrap();
        assert_eq!(ev.action.as_deref(), Some("die"));
        assert_eq!(ev.actor.and_then(|a| a.id).as_deref(), Some("abc"));
    }

    #[test]
    fn messages_are_clipped_on_a_character_boundary() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(MESSAGE_LIMIT + 10);
        let c = clip(&long);
        assert!(c.starts_with(&"é".repeat(MESSAGE_LIMIT)));
        assert!(
            c.ends_with(&format!("({} bytes in all)", long.len())),
            "{c}"
        );
    }

    #[test]
    fn origin_form_drops_the_scheme_and_host() {
        let req = hyper::Request::builder()
            .uri("http://docker/v1.47/containers/json?all=true")
            .body(())
            .unwrap();
        let req = origin_form(req).unwrap();
        assert_eq!(req.uri().to_string(), "/v1.47/containers/json?all=true");
        assert_eq!(req.headers()["host"], "docker");
    }

    proptest! {
        /// However the stream is cut into chunks, the lines are those of the whole; nothing
        /// held ever passes the limit, and a line past it is an error, never a panic.
        #[test]
        fn chunking_does_not_change_the_lines(
            text in proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'a'), Just(b' ')], 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..10),
            limit in 1usize..40,
        ) {
            let whole: Result<Vec<Vec<u8>>, ()> = {
                let mut out = Vec::new();
                let mut ok = true;
                let pieces: Vec<&[u8]> = text.split(|b| *b == b'\n').collect();
                let n = pieces.len();
                for (i, p) in pieces.into_iter().enumerate() {
                    if p.len() > limit {
                        ok = false;
                        break;
                    }
                    // The last piece has no `\n` after it: not a line yet.
                    if i + 1 < n && !p.iter().all(u8::is_ascii_whitespace) {
                        out.push(p.to_vec());
                    }
                }
                if ok { Ok(out) } else { Err(()) }
            };
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(text.len())).collect();
            cuts.sort();
            let mut l = Lines::new(limit);
            let mut got = Vec::new();
            let mut failed = false;
            let mut from = 0;
            for to in cuts.into_iter().chain([text.len()]) {
                match l.push(&text[from..to]) {
                    Ok(lines) => got.extend(lines),
                    Err(_) => { failed = true; break; }
                }
                prop_assert!(l.partial.len() <= limit);
                from = to;
            }
            match whole {
                Ok(lines) => { prop_assert!(!failed); prop_assert_eq!(got, lines); }
                Err(()) => prop_assert!(failed),
            }
        }
    }
}
