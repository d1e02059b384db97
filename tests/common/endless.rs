//! A loopback upstream whose answers never end, and what to assert about it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::MockUp;
use super::raw::{Answer, RawUp, Then};

/// A loopback upstream whose answers never end: every POST (and, with `endless_get`, every GET)
/// gets a 200 with a chunked JSON body — or, with `events`, an event stream of that one event
/// (`ROLE` or `CONTENT`) again and again — written until `cap` bytes, then the connection is held
/// in silence. GETs otherwise get a one-model list, so probes pass. `written` is the most any
/// connection got written before the gateway stopped reading (or `cap`); `released` says the
/// gateway let go of an answer's connection (a write failed, or it closed). A [`RawUp`].
pub struct Endless {
    pub addr: std::net::SocketAddr,
    pub released: Arc<AtomicBool>,
    up: RawUp,
}

impl Endless {
    pub fn start(cap: u64, endless_get: bool, events: Option<&'static str>) -> Endless {
        let released = Arc::new(AtomicBool::new(false));
        let r = released.clone();
        let up = RawUp::with_release(
            move |req| {
                if req.method == "GET" && !endless_get {
                    return Answer::models_list();
                }
                let (content_type, first, piece) = if let Some(event) = events {
                    (
                        "text/event-stream",
                        String::new(),
                        event.repeat(0x10000 / event.len()),
                    )
                } else {
                    (
                        "application/json",
                        "6\r\n{\"a\":\"\r\n".to_string(),
                        "x".repeat(0x10000),
                    )
                };
                Answer::Stream {
                    head: format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n{first}"
                    )
                    .into_bytes(),
                    piece: format!("{:x}\r\n{piece}\r\n", piece.len()).into_bytes(),
                    credit: piece.len() as u64,
                    cap,
                    then: Then::Hold,
                }
            },
            move |_| r.store(true, Ordering::Relaxed),
        );
        Endless {
            addr: up.addr,
            released,
            up,
        }
    }

    pub fn written(&self) -> u64 {
        self.up.written()
    }
}

/// `a` (an endless upstream) then `b` in the chain, with `server.max_response_bytes` at 1 MiB
/// and `a`'s `timeouts` as given.
pub fn endless_then(a: &Endless, b: &MockUp, timeouts: &str) -> String {
    super::Cfg::new()
        .top("server: { max_response_bytes: 1048576 }")
        .endpoint(super::ep("a", a, &format!(", timeouts: {timeouts}")))
        .endpoint(super::ep("b", b, ""))
        .chain(&["a", "b"])
        .to_yaml()
}

/// The endless upstream was read past `limit`, but no further than the sockets' buffers take:
/// far from the 256 MiB it would have gone on to send.
pub fn assert_cut_past(up: &Endless, limit: u64) {
    let written = up.written();
    assert!(
        written > limit,
        "only {written} bytes were sent: the limit was not reached"
    );
    assert!(
        written < 64 << 20,
        "{written} bytes were read of the endless answer"
    );
}
