//! The front door, the HTTP server itself, against the real binary over raw HTTP/1 and HTTP/2:
//! header, body and send timeouts, HTTP/2 prior knowledge (idle GOAWAY, unanswered PINGs, no
//! window), load shedding, the accept queue while paused, `Host` refused against DNS rebinding,
//! drain and shutdown (grace, cut, restarts in turn), and a 40 s soak of steady traffic.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Waits (at most 10 s) for the gateway to close `s` without answering: when it did, or what
/// it did instead.
fn wait_closed(mut s: std::net::TcpStream) -> Result<std::time::Instant, String> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let t0 = std::time::Instant::now();
    let mut buf = [0u8; 256];
    match s.read(&mut buf) {
        Ok(0) => Ok(std::time::Instant::now()),
        Ok(n) => Err(format!(
            "answered: {:?}",
            String::from_utf8_lossy(&buf[..n])
        )),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(std::time::Instant::now()),
        Err(e) => Err(format!("still open after {:?} ({e})", t0.elapsed())),
    }
}

/// Reads one HTTP/1.1 response with a `content-length` body from `s`: its head and body.
fn read_response(s: &mut std::net::TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let len: usize = text[..end]
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .expect("a content-length");
            if got.len() >= end + 4 + len {
                return text;
            }
        }
        match s.read(&mut buf) {
            Ok(0) => panic!("closed before a whole response: {text}"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("no whole response within the read timeout ({e}): {text}"),
        }
    }
}

/// A bare HTTP/2 client on a std socket, its frames written and read by hand, so that a test
/// decides what the peer does — whether it answers PINGs, say (every client library does).
struct RawH2 {
    s: std::net::TcpStream,
}

impl RawH2 {
    const HEADERS: u8 = 1;
    const DATA: u8 = 0;
    const SETTINGS: u8 = 4;
    const PING: u8 = 6;
    const GOAWAY: u8 = 7;

    /// Connects and sends the preface with an empty SETTINGS frame.
    fn connect(addr: std::net::SocketAddr) -> RawH2 {
        Self::connect_with(addr, &[])
    }

    /// The same with these settings (identifier, value).
    fn connect_with(addr: std::net::SocketAddr, settings: &[(u16, u32)]) -> RawH2 {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
        let mut c = RawH2 { s };
        let payload: Vec<u8> = settings
            .iter()
            .flat_map(|(id, v)| [&id.to_be_bytes()[..], &v.to_be_bytes()[..]].concat())
            .collect();
        c.send(Self::SETTINGS, 0, 0, &payload).unwrap();
        c
    }

    fn send(&mut self, ty: u8, flags: u8, stream: u32, payload: &[u8]) -> std::io::Result<()> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, ty, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        self.s.write_all(&f)
    }

    /// `POST /v1/chat/completions` for `model` on stream 1 (`stream: true` when `stream`): its
    /// HEADERS, then the body in one DATA frame that ends the stream.
    fn chat(&mut self, model: &str, stream: bool) {
        let head = hpack(
            &[POST, HTTP],
            &[
                (4, "/v1/chat/completions"),
                (1, "x"),
                (31, "application/json"),
            ],
        );
        self.send(Self::HEADERS, 0x4, 1, &head).unwrap(); // END_HEADERS
        let body = format!(
            r#"{{"model":"{model}","stream":{stream},"messages":[{{"role":"user","content":"x"}}]}}"#
        );
        self.send(Self::DATA, 0x1, 1, body.as_bytes()).unwrap(); // END_STREAM
    }

    /// Acknowledges a SETTINGS frame, and a PING when `answer_pings`, as a live peer does. True
    /// when the frame was a PING (answered or not).
    fn control(&mut self, ty: u8, flags: u8, payload: &[u8], answer_pings: bool) -> bool {
        let ack = flags & 1 != 0;
        match ty {
            Self::SETTINGS if !ack => {
                let _ = self.send(Self::SETTINGS, 1, 0, &[]);
                false
            }
            Self::PING if !ack => {
                if answer_pings {
                    let _ = self.send(Self::PING, 1, 0, payload);
                }
                true
            }
            _ => false,
        }
    }

    /// The next frame; `None` once the gateway closed the connection; an error when nothing came
    /// for 10 s.
    fn next(&mut self) -> Result<Option<Frame>, String> {
        let mut head = [0u8; 9];
        let closed = |e: &std::io::Error| {
            matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            )
        };
        match self.s.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if closed(&e) => return Ok(None),
            Err(e) => return Err(format!("nothing for 10 s, still open ({e})")),
        }
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let mut payload = vec![0u8; len];
        match self.s.read_exact(&mut payload) {
            Ok(()) => {}
            Err(e) if closed(&e) => return Ok(None),
            Err(e) => return Err(format!("a frame cut short ({e})")),
        }
        let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        Ok(Some((head[3], head[4], id, payload)))
    }
}

/// One frame: type, flags, stream id, payload.
type Frame = (u8, u8, u32, Vec<u8>);

/// An HPACK header block: `indexed` static-table entries (`:method GET` is 0x82), then literal
/// fields without indexing, each named by its static-table index.
fn hpack(indexed: &[u8], literals: &[(u8, &str)]) -> Vec<u8> {
    let mut b = indexed.to_vec();
    for (name, value) in literals {
        assert!(*name < 15 + 127 && value.len() < 127);
        // The name's index in a 4-bit prefix (RFC 7541, 5.1): 15 and up continue in a byte.
        if *name < 15 {
            b.push(*name);
        } else {
            b.extend_from_slice(&[15, name - 15]);
        }
        b.push(value.len() as u8);
        b.extend_from_slice(value.as_bytes());
    }
    b
}

/// `:method GET` (2), `:method POST` (3), `:scheme http` (6) in HPACK's static table; `:status
/// 200` is entry 8. `:authority` is name 1, `:path` name 4 and `content-type` name 31.
const GET: u8 = 0x82;

const POST: u8 = 0x83;

const HTTP: u8 = 0x86;

const STATUS_200: u8 = 0x88;

async fn cut_at_the_grace(c: reqwest::Client) {
    let a = MockUp::openai("name: a\nrules: [{when: {stream: false}, delay: 30s}, {when: {stream: true}, stall_after: 1}]").await;
    let mut gw = Gw::start(&format!(
        "server: {{ shutdown_grace: 500ms }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\", timeouts: {{ first_token: 60s, total: 60s }} }}\n",
        a.base()
    ));
    let slow = tokio::spawn({
        let req = c
            .post(gw.url("/v1/chat/completions"))
            .header("x-request-id", "cut-slow")
            .json(&json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}));
        async move { req.send().await.map(|r| r.status().as_u16()) }
    });
    let stream = c
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "cut-stream")
        .json(
            &json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200, "the stream committed");
    let ok = eventually(Duration::from_secs(5), || async { a.requests().await == 2 }).await;
    assert!(ok, "both requests reached the upstream");
    let reader = tokio::spawn(async move { stream.text().await.unwrap_or_default() });
    gw.stop();
    assert_eq!(
        slow.await.unwrap().ok(),
        Some(503),
        "the slow request got an answer"
    );
    let text = reader.await.unwrap();
    assert!(text.contains("\"code\":\"shutdown\""), "{text}");
    let got = audit_rows(
        &gw,
        "SELECT request_id, status, error_class FROM requests ORDER BY request_id",
    );
    assert_eq!(
        got,
        vec![
            vec![json!("cut-slow"), json!(503), json!("shutdown")],
            vec![json!("cut-stream"), json!(200), json!("shutdown")],
        ]
    );
}

/// How many of `n` connections to `addr`, opened at once, the kernel completes within `within`
/// (a connection completes when it enters the listener's accept queue, accepted or not).
async fn connects(
    addr: std::net::SocketAddr,
    n: usize,
    within: Duration,
) -> Vec<tokio::net::TcpStream> {
    let tries = (0..n).map(|_| tokio::time::timeout(within, tokio::net::TcpStream::connect(addr)));
    futures_util::future::join_all(tries)
        .await
        .into_iter()
        .filter_map(|r| r.ok().and_then(Result::ok))
        .collect()
}

/// A content chunk.
const CONTENT: &str = "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x \"}}]}\n\n";

/// `a` (an endless upstream) alone, its `timeouts.total` 60 s, with this `server` section.
fn endless_only(a: &Endless, server: &str) -> String {
    Cfg::new()
        .top(&format!("server: {server}"))
        .endpoint(ep("a", a, ", timeouts: { total: 60s }"))
        .to_yaml()
}

async fn with_host(gw: &Gw, host: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("host", host)
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn slow_clients_are_cut_off() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 300ms, body_timeout: 300ms }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    // Headers complete, body promised but never sent: 408 in OpenAI's shape.
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"mo")
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("body_timeout") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"code\":\"body_timeout\""), "{text}");

    // Headers never completed: the connection is closed.
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n")
        .unwrap();
    // A read timeout is not a close: it must fail the test, not pass as 0 bytes.
    let n = match s.read(&mut buf) {
        Ok(n) => n,
        Err(e) => panic!("the half-sent headers were not closed on within 10 s: {e}"),
    };
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(n == 0 || head.starts_with("HTTP/1.1 408"), "closed: {head}");
    assert_eq!(a.requests().await, 0);
    assert_eq!(gw.chat("a", "x").await.status(), 200, "others are served");
}

#[tokio::test]
async fn a_client_that_connects_and_sends_nothing_is_cut_off_at_the_header_timeout() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 500ms }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    // Ready first (a new gateway answers /health 503 `starting` until its first probe round).
    gw.ready().await;
    // The gateway serves on a connection of the same kind, opened at the same moment.
    let mut served = std::net::TcpStream::connect(gw.addr).unwrap();
    let opened = std::time::Instant::now();
    let silent = std::net::TcpStream::connect(gw.addr).unwrap();
    // The first bytes of HTTP/2's preface: the gateway cannot yet tell the protocol.
    let mut partial = std::net::TcpStream::connect(gw.addr).unwrap();
    partial.write_all(b"PRI * HTTP/2.0\r\n").unwrap();
    served
        .write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
        .unwrap();
    let mut got = String::new();
    served.read_to_string(&mut got).unwrap();
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    // Held open until the timeout (so it is the timeout that closes them), then closed: a
    // connection that never sends a request must not hold a socket and a task for ever.
    for (what, s) in [
        ("nothing sent", silent),
        ("part of the h2 preface", partial),
    ] {
        let closed = wait_closed(s).unwrap_or_else(|e| panic!("{what}: {e}"));
        let took = closed - opened;
        assert!(
            took >= Duration::from_millis(200),
            "{what}: closed after {took:?}, before the header timeout"
        );
    }
    assert_eq!(gw.chat("a", "x").await.status(), 200, "others are served");
    assert_no_panic(&gw);
}

/// Each HTTP/1 connection's header-read timer is made once and moved on from request to request
/// (`front::timer`): the timer armed while the connection waited for its second request fires
/// while it waits for its third, and must not cut it then, only at the third's own deadline.
#[tokio::test]
async fn a_keep_alive_connection_gets_the_whole_header_timeout_for_each_request() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 3s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    gw.ready().await;
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let get = b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n";
    s.write_all(get).unwrap();
    assert!(read_response(&mut s).starts_with("HTTP/1.1 200"));
    // The connection now waits for its second request, its timer armed 3 s on; the second
    // comes a second later (two seconds of margin for a busy machine).
    std::thread::sleep(Duration::from_secs(1));
    // Before the second request leaves: the gateway can begin waiting for the third only
    // after this, so the third's own deadline is at least 3 s from here. The timer armed for
    // the second fires less than 2 s from here (3 s from the first answer, a second ago).
    let sent = std::time::Instant::now();
    s.write_all(get).unwrap();
    assert!(
        read_response(&mut s).starts_with("HTTP/1.1 200"),
        "the second request, within its timeout, is served"
    );
    // A third head begun and never finished: the timer armed for the second request fires
    // within two seconds of `sent`; the connection may be closed only at the third's deadline.
    s.write_all(b"GET /health HTTP/1.1\r\nhost: loc").unwrap();
    let closed = wait_closed(s).expect("the unfinished head is cut off at the header timeout");
    let took = closed - sent;
    assert!(
        took >= Duration::from_secs(3),
        "closed {took:?} after the second request: before the third head's own 3 s"
    );
    assert_eq!(gw.chat("a", "x").await.status(), 200, "others are served");
    assert_no_panic(&gw);
}

/// A keep-alive connection idle past `front::idle::PARK_AFTER` (1 s) is parked — hyper's
/// connection and its buffers dropped, the socket kept — and its next request is served as
/// any other: one sent whole, one whose head comes in pieces across a park (its bytes served in
/// order), and two pipelined in one write. The park is seen in `/metrics`. (Two workers: the
/// test's raw socket blocks one, the in-process upstream runs on the other.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_parked_and_serves_what_comes_next() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 30s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    gw.ready().await;
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let body = r#"{"model":"a","messages":[{"role":"user","content":"hi"}]}"#;
    let chat = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(chat.as_bytes()).unwrap();
    assert!(read_response(&mut s).starts_with("HTTP/1.1 200"));
    let parks_before = gw.metric("autohedge_http1_parks_total").await;
    std::thread::sleep(Duration::from_millis(1_600));
    // Parked: counted, the connection still open.
    assert!(
        gw.metric("autohedge_http1_connections_parked").await >= 1.0,
        "the idle connection is parked"
    );
    assert!(gw.metric("autohedge_http1_parks_total").await > parks_before);
    s.write_all(chat.as_bytes()).unwrap();
    let second = read_response(&mut s);
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    assert!(second.contains("Hello from a"), "{second}");
    assert!(!second.to_ascii_lowercase().contains("connection: close"));

    // A head in two pieces with a park between them (its first bytes read before the park).
    std::thread::sleep(Duration::from_millis(1_600));
    let (head, rest) = chat.split_at(40);
    s.write_all(head.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(1_600));
    s.write_all(rest.as_bytes()).unwrap();
    let third = read_response(&mut s);
    assert!(third.starts_with("HTTP/1.1 200"), "{third}");
    assert!(third.contains("Hello from a"), "{third}");

    // Two requests in one write after a park: both answered, in order.
    std::thread::sleep(Duration::from_millis(1_600));
    let get = "GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n";
    s.write_all(format!("{chat}{get}").as_bytes()).unwrap();
    let fourth = read_response(&mut s);
    assert!(fourth.contains("Hello from a"), "{fourth}");
    assert_eq!(
        a.requests().await,
        4,
        "every chat reached the upstream once"
    );
    // The second response may have come in the same read as the first: read until it shows.
    let mut both = fourth;
    let mut buf = [0u8; 4096];
    while both.matches("HTTP/1.1 200").count() < 2 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the pipelined second answer");
        both.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert_no_panic(&gw);
}

/// A head trickled in across parks keeps the deadline it began under: parks never give a slow
/// client a fresh `server.header_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_trickled_across_parks_is_cut_off_at_its_own_header_timeout() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 3s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    gw.ready().await;
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .unwrap();
    assert!(read_response(&mut s).starts_with("HTTP/1.1 200"));
    // The wait for the next head begins about now; a byte every 400 ms from here.
    let began = Instant::now();
    let parks_before = gw.metric("autohedge_http1_parks_total").await;
    let head =
        b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut cut = None;
    for b in head.iter() {
        std::thread::sleep(Duration::from_millis(400));
        if s.write_all(&[*b]).is_err() {
            cut = Some(began.elapsed());
            break;
        }
        if began.elapsed() > Duration::from_secs(12) {
            break;
        }
    }
    // The trickle outlived several park points (every second of waiting).
    assert!(
        gw.metric("autohedge_http1_parks_total").await >= parks_before + 1.0,
        "the connection parked as its head trickled in"
    );
    let cut = cut.unwrap_or_else(|| {
        let mut probe = s.try_clone().unwrap();
        let _ = probe.write_all(b"a");
        wait_closed(s).expect("closed at its header timeout");
        began.elapsed()
    });
    assert!(
        cut < Duration::from_secs(8),
        "a trickled head is cut off near its 3 s deadline, not kept alive by parks ({cut:?})"
    );
    assert_eq!(gw.chat("a", "x").await.status(), 200, "others are served");
    assert_no_panic(&gw);
}

/// A parked connection's next head ends by the deadline its wait began under: a client that
/// lets the connection park and then trickles a head gets no fresh `server.header_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_trickled_after_a_park_is_cut_off_at_the_wait_s_own_deadline() {
    let gw = Gw::start(
        "server: { header_timeout: 4s }\nmodels:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\n",
    );
    gw.ready().await;
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .unwrap();
    assert!(read_response(&mut s).starts_with("HTTP/1.1 200"));
    let answered = Instant::now();
    let parks_before = gw.metric("autohedge_http1_parks_total").await;
    // Parked after a second of waiting; then a head trickled a byte every 400 ms.
    std::thread::sleep(Duration::from_millis(2_500));
    assert!(gw.metric("autohedge_http1_parks_total").await > parks_before);
    let mut cut = None;
    for b in b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-slow: aaaaaaaaaaaaaaaaaaaaaaaa" {
        if s.write_all(&[*b]).is_err() {
            cut = Some(answered.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(400));
    }
    let cut = cut.unwrap_or_else(|| answered.elapsed());
    // The wait's deadline is 4 s after the answer; a fresh one from the wake would be 6.5 s.
    assert!(
        cut < Duration::from_millis(6_000),
        "cut off by the wait's own deadline, not a fresh one from the wake ({cut:?})"
    );
    assert_no_panic(&gw);
}

/// A client that asks for a stream and then reads nothing is let go after `server.send_timeout`
/// without progress, and so is the upstream connection behind it: before, the gateway waited to
/// write for ever, holding the client's connection, the request and the upstream's stream (the
/// backend still at work) for as long as the client liked.
#[tokio::test]
async fn a_client_that_reads_nothing_is_let_go_after_the_send_timeout() {
    let a = Endless::start(256 << 20, false, Some(CONTENT));
    let gw = Gw::start(&endless_only(&a, "{ send_timeout: 1s }"));
    let mut s = std::net::TcpStream::connect(gw.addr).unwrap();
    let body = r#"{"model":"a","stream":true,"messages":[{"role":"user","content":"x"}]}"#;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // The stream flows until every buffer between the upstream and this client is full.
    assert!(
        eventually(Duration::from_secs(10), || async { a.written() > 1 << 20 }).await,
        "the stream started: {} bytes",
        a.written()
    );
    // Nothing read: the gateway's writes wait, past the send timeout.
    assert!(
        eventually(Duration::from_secs(10), || async {
            a.released.load(std::sync::atomic::Ordering::Relaxed)
        })
        .await,
        "the upstream's stream is still held ({} bytes written)",
        a.written()
    );
    // What the buffers held comes out, then the end: the connection was closed, the stream
    // never finished.
    let read = tokio::task::spawn_blocking(move || {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        let mut tail = Vec::new();
        loop {
            match s.read(&mut buf) {
                Ok(0) => return Ok((total, String::from_utf8_lossy(&tail).into_owned())),
                Ok(n) => {
                    total += n as u64;
                    tail = buf[..n].to_vec();
                    if total > 128 << 20 {
                        return Err(format!("still streaming after {total} bytes"));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    return Ok((total, String::new()));
                }
                Err(e) => return Err(format!("still open after {total} bytes ({e})")),
            }
        }
    })
    .await
    .unwrap();
    let (total, tail) = read.expect("the gateway closed the connection");
    assert!(total > 0, "the stream's start reached the client");
    assert!(!tail.contains("[DONE]"), "the stream finished: {tail}");
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.log().contains("server.send_timeout")
        })
        .await,
        "the cut is logged with its reason:\n{}",
        gw.log()
    );
    // Recorded as what it was, a client that left mid-stream: nothing against the upstream.
    let sql = "SELECT status, endpoint, error_class FROM requests";
    assert!(
        eventually(Duration::from_secs(5), || async {
            audit_rows(&gw, sql) == vec![vec![json!(200), json!("a"), json!("client_closed")]]
        })
        .await,
        "{:?}",
        audit_rows(&gw, sql)
    );
    assert_no_panic(&gw);
}

#[tokio::test]
async fn http2_with_prior_knowledge_is_served_beside_http1() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let body = json!({"model": "a", "messages": [{"role": "user", "content": "x"}]});
    let r = h2
        .post(gw.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion", "{v}");
    assert_eq!(a.requests().await, 1, "it reached the upstream");
    let r = gw.chat("a", "x").await;
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(r.status(), 200);
    assert_eq!(a.requests().await, 2);
}

#[tokio::test]
async fn an_idle_http2_connection_is_closed_at_the_header_timeout() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 1s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    gw.ready().await;
    let addr = gw.addr;
    // A live client: it acknowledges SETTINGS and answers every PING, so only idleness can
    // close its connection.
    let seen = tokio::task::spawn_blocking(move || -> Result<_, String> {
        let mut c = RawH2::connect(addr);
        // The idle time is measured from before the request: the client reading its answer
        // late cannot make a close at the deadline look early.
        let sent = std::time::Instant::now();
        c.send(
            RawH2::HEADERS,
            0x5, // END_HEADERS | END_STREAM
            1,
            &hpack(&[GET, HTTP], &[(4, "/health"), (1, "x")]),
        )
        .unwrap();
        let (mut status, mut answered, mut goaway, mut pings) = (None, None, false, 0);
        while let Some((ty, flags, id, payload)) = c.next()? {
            match ty {
                RawH2::HEADERS if id == 1 => status = payload.first().copied(),
                RawH2::DATA if id == 1 && flags & 1 != 0 => {
                    answered = Some(std::time::Instant::now())
                }
                RawH2::GOAWAY => goaway = true,
                _ => pings += c.control(ty, flags, &payload, true) as u32,
            }
        }
        Ok((
            status,
            answered,
            goaway,
            pings,
            sent,
            std::time::Instant::now(),
        ))
    })
    .await
    .unwrap();
    let (status, answered, goaway, pings, sent, closed) =
        seen.expect("the idle connection is closed");
    assert_eq!(
        status,
        Some(STATUS_200),
        "the request was served over HTTP/2"
    );
    let answered = answered.expect("the response's body ended");
    assert!(goaway, "the close is announced with GOAWAY");
    // The answer came before the idle time began, so the connection lived at least the whole
    // header_timeout (1 s) after the request was sent.
    let lived = closed - sent;
    assert!(
        lived >= Duration::from_millis(1000),
        "closed {lived:?} after the request, before the idle deadline"
    );
    println!(
        "closed {:?} after the last response; {pings} PING(s) answered",
        closed - answered
    );
    assert_eq!(gw.chat("a", "x").await.status(), 200, "others are served");
    assert_no_panic(&gw);
}

#[tokio::test]
async fn an_http2_peer_that_stops_answering_pings_is_let_go() {
    // The upstream answers after 30 s: the request's stream stays open, so it is not idleness
    // that ends the connection.
    let a = MockUp::openai("name: a\nrules: [{delay: 30s}]").await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 1s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let addr = gw.addr;
    let t0 = std::time::Instant::now();
    let seen = tokio::task::spawn_blocking(move || -> Result<_, String> {
        let mut c = RawH2::connect(addr);
        c.chat("a", false);
        let mut pings = 0;
        while let Some((ty, flags, id, payload)) = c.next()? {
            match ty {
                RawH2::HEADERS if id == 1 => {
                    let mut more = String::new();
                    while let Ok(Some((RawH2::DATA, _, 1, data))) = c.next() {
                        more.push_str(&String::from_utf8_lossy(&data));
                    }
                    return Err(format!("answered: {payload:02x?} {more}"));
                }
                // PINGs never answered: the peer has gone silent.
                _ => pings += c.control(ty, flags, &payload, false) as u32,
            }
        }
        Ok(pings)
    })
    .await
    .unwrap();
    let pings = seen.expect("the silent peer's connection is closed");
    assert_eq!(a.requests().await, 1, "the request reached the upstream");
    assert!(pings >= 1, "the gateway sent a PING first");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(1500),
        "closed after {took:?}: before a PING could go unanswered"
    );
    assert_no_panic(&gw);
}

/// An HTTP/2 client that asks for a stream and then grants it no flow-control window (no
/// `WINDOW_UPDATE`) — while answering every PING, so neither keep-alive nor idleness ends it — is
/// let go after `server.send_timeout`, with the upstream's stream behind it.
#[tokio::test]
async fn an_http2_client_that_grants_no_window_is_let_go_after_the_send_timeout() {
    let a = Endless::start(256 << 20, false, Some(CONTENT));
    let gw = Gw::start(&endless_only(
        &a,
        "{ send_timeout: 1s, header_timeout: 60s }",
    ));
    let addr = gw.addr;
    let t0 = std::time::Instant::now();
    let client = tokio::task::spawn_blocking(move || -> Result<_, String> {
        // SETTINGS_INITIAL_WINDOW_SIZE (4): 100 bytes a stream, never raised.
        let mut c = RawH2::connect_with(addr, &[(4, 100)]);
        c.chat("a", true);
        let (mut status, mut data) = (None, 0usize);
        while let Some((ty, flags, id, payload)) = c.next()? {
            match ty {
                RawH2::HEADERS if id == 1 => status = payload.first().copied(),
                RawH2::DATA if id == 1 => data += payload.len(),
                _ => {
                    c.control(ty, flags, &payload, true);
                }
            }
        }
        Ok((status, data))
    });
    let (status, data) = client.await.unwrap().expect("the connection is closed");
    assert_eq!(status, Some(STATUS_200), "the stream began");
    assert!(data > 0 && data <= 100, "{data} bytes: the window held");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "closed after {took:?}, before the send timeout"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            a.released.load(std::sync::atomic::Ordering::Relaxed)
        })
        .await,
        "the upstream's stream is still held"
    );
    assert_no_panic(&gw);
}

#[tokio::test]
async fn http2_streams_outlive_the_idle_deadline_and_the_client_reconnects_after_it() {
    let a = MockUp::openai(
        "name: a\nreply: \"one two three four five six seven eight\"\nchunk_delay: 300ms",
    )
    .await;
    let gw = Gw::start(&format!(
        "server: {{ header_timeout: 1s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let body =
        json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "x"}]});
    let t0 = std::time::Instant::now();
    let r = h2
        .post(gw.url("/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
    let text = stream_text(&sse_events(r).await);
    assert_eq!(text, "one two three four five six seven eight");
    assert!(
        t0.elapsed() > Duration::from_secs(2),
        "the stream ran past the 1 s idle deadline ({:?})",
        t0.elapsed()
    );
    // Idle past the deadline: the gateway closes the connection, and the client's next request
    // goes on a new one, unharmed.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let r = h2
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(a.requests().await, 2);
    assert_no_panic(&gw);
}

#[tokio::test]
async fn over_capacity_is_shed_at_once_with_retry_after() {
    // The first request holds the only place for 5 s, far longer than the second takes to
    // arrive, even on a busy machine (the second must come while the first is in flight).
    let a = MockUp::openai("rules: [{delay: 5s}]").await;
    let gw = Gw::start(&format!(
        "server: {{ max_concurrent_requests: 1 }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let url = gw.url("/v1/chat/completions");
    let body = json!({"model": "a", "messages": [{"role": "user", "content": "x"}]});
    let first = tokio::spawn({
        let (url, body) = (url.clone(), body.clone());
        async move {
            reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        }
    });
    let ok = eventually(Duration::from_secs(30), || async {
        a.requests().await == 1
    })
    .await;
    assert!(ok, "the first request is in flight");
    let r = reqwest::Client::new()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(header(&r, "retry-after"), "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(
        a.requests().await,
        1,
        "the shed request never reached the upstream"
    );
    assert_eq!(gw.chat("a", "x").await.status(), 200, "capacity is back");
}

/// A burst of new connections while the gateway is not accepting (stopped here, as a host pause,
/// a CPU-throttled container or a stalled machine would) waits in the kernel's accept queue and
/// is served when the gateway runs again, instead of having its SYNs dropped past the standard
/// 128 and each client waiting a second for its SYN to be sent again.
#[tokio::test]
async fn a_burst_of_connections_while_the_gateway_is_paused_waits_in_the_accept_queue() {
    const BURST: usize = 300;
    let up = MockUp::openai("").await;
    let gw = Gw::start(&chain_cfg(&[("a", &up)], ""));
    assert_eq!(gw.chat("chat", "hi").await.status(), 200);

    // The method can see a short queue: a listener with the standard library's backlog that
    // accepts nothing completes only about 128 of the burst.
    let short = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let completed = connects(
        short.local_addr().unwrap(),
        BURST,
        Duration::from_millis(500),
    )
    .await;
    assert!(
        completed.len() < BURST / 2,
        "a 128-deep queue completed {} of {BURST}",
        completed.len()
    );
    drop(completed);

    let chat = json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]});
    // SIGCONT when dropped, so a failing assertion never leaves the gateway stopped.
    let resume = Paused::new(gw.pid());
    // It is really stopped: a request gets no answer.
    let stopped = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&chat)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(stopped.is_err(), "a stopped gateway answered");
    // A generous wait, so a slow machine cannot fail it: with a queue too short, the SYNs past
    // it would go unanswered for as long as the gateway stays stopped.
    let mut socks = connects(gw.addr, BURST, Duration::from_secs(10)).await;
    assert_eq!(
        socks.len(),
        BURST,
        "connections completed while the gateway was stopped"
    );
    let body = chat.to_string();
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    for s in &mut socks {
        tokio::io::AsyncWriteExt::write_all(s, req.as_bytes())
            .await
            .unwrap();
    }
    drop(resume);
    // Every one is served once the gateway runs again.
    let answers = futures_util::future::join_all(socks.into_iter().map(|mut s| async move {
        let mut out = Vec::new();
        tokio::time::timeout(
            Duration::from_secs(30),
            tokio::io::AsyncReadExt::read_to_end(&mut s, &mut out),
        )
        .await
        .expect("answered within 30 s")
        .unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }))
    .await;
    let ok = answers
        .iter()
        .filter(|a| a.starts_with("HTTP/1.1 200"))
        .count();
    assert_eq!(ok, BURST, "first answer: {:.200}", answers[0]);
    assert_no_panic(&gw);
}

/// DNS rebinding against `/v1/*`: on a loopback listener a request whose `Host` is a domain name
/// (a web page's, pointed at 127.0.0.1) gets 403 `host_not_allowed` and reaches no upstream;
/// `localhost` and IP literals pass. `server.allowed_hosts` replaces the default; on a listener
/// that is not loopback there is no check unless it is set. `max_concurrent_requests` defaults to
/// 4096.
#[tokio::test]
async fn a_rebound_host_name_cannot_use_a_loopback_gateway() {
    let a = MockUp::openai("name: a").await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    );
    let gw = Gw::start(&cfg);
    let port = gw.addr.port();
    let (status, body) = with_host(&gw, &format!("localhost:{port}")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(with_host(&gw, &format!("[::1]:{port}")).await.0, 200);
    assert_eq!(a.requests().await, 2);
    let (status, body) = with_host(&gw, &format!("rebind.attacker.example:{port}")).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "host_not_allowed", "{body}");
    assert_eq!(a.requests().await, 2, "nothing reached the upstream");
    let r = reqwest::Client::new()
        .get(gw.url("/v1/models"))
        .header("host", "rebind.attacker.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let st = gw.status().await;
    assert_eq!(st["server"]["max_concurrent_requests"], 4096, "{st}");

    // allowed_hosts set: exactly those names (and `.name` for the names under it).
    let gw = Gw::start(&format!(
        "server: {{ allowed_hosts: [gw.internal, .corp.example] }}\n{cfg}"
    ));
    assert_eq!(with_host(&gw, "gw.internal").await.0, 200);
    assert_eq!(with_host(&gw, "GW.Internal:8000").await.0, 200);
    assert_eq!(with_host(&gw, "ai.corp.example").await.0, 200);
    assert_eq!(with_host(&gw, "localhost").await.0, 403);
    assert_eq!(with_host(&gw, "corp.example.attacker.example").await.0, 403);

    // Not loopback: no check unless set.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        format!("{cfg}auth: {{ keys: [{{ name: t, key: sk-tenant-0000000000 }}] }}\n"),
    )
    .unwrap();
    let gw = Gw::start_listening(dir.path(), &path, &[], "0.0.0.0:0");
    let r = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/v1/chat/completions",
            gw.addr.port()
        ))
        .header("host", "gateway.example")
        .bearer_auth("sk-tenant-0000000000")
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// A drain that drops nothing: on SIGTERM a gateway answers `/health` 503 `draining` at once,
/// keeps serving for `server.drain_delay` with `Connection: close` on every answer, then stops
/// accepting and finishes what is in flight. Two gateways behind a balancer that follows
/// `/health` (every 100 ms, as a load balancer or Swarm's mesh does) and a client that retries a
/// refused connection twice (the OpenAI SDK's default), each gateway restarted in turn under
/// load: not one request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_restarted_in_turn_under_load_drop_nothing() {
    use std::sync::{Arc, Mutex};
    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        "server: {{ drain_delay: 2s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\nhealth: {{ probe_interval: 1h }}\n",
        up.base()
    );
    let mut gws = [Gw::start(&cfg), Gw::start(&cfg)];
    for g in &gws {
        g.ready().await;
    }
    // The balancer's view: each member's address and whether its last /health was 200.
    let members: Arc<Mutex<Vec<(SocketAddr, bool)>>> =
        Arc::new(Mutex::new(gws.iter().map(|g| (g.addr, true)).collect()));
    let stop = CancellationToken::new();
    let checker = {
        let (members, stop) = (members.clone(), stop.clone());
        tokio::spawn(async move {
            let c = reqwest::Client::new();
            while !stop.is_cancelled() {
                let list: Vec<SocketAddr> = members.lock().unwrap().iter().map(|m| m.0).collect();
                for addr in list {
                    let ok = c
                        .get(format!("http://{addr}/health"))
                        .timeout(Duration::from_millis(500))
                        .send()
                        .await
                        .is_ok_and(|r| r.status() == 200);
                    for m in members.lock().unwrap().iter_mut() {
                        if m.0 == addr {
                            m.1 = ok;
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let failed = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();
    for w in 0..4usize {
        let (members, stop, sent, failed) =
            (members.clone(), stop.clone(), sent.clone(), failed.clone());
        workers.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            let mut turn = w;
            while !stop.is_cancelled() {
                let mut last = String::new();
                let mut ok = false;
                for _attempt in 0..3 {
                    turn += 1;
                    let addr = {
                        let m = members.lock().unwrap();
                        let healthy: Vec<SocketAddr> =
                            m.iter().filter(|m| m.1).map(|m| m.0).collect();
                        let pool = if healthy.is_empty() {
                            m.iter().map(|m| m.0).collect()
                        } else {
                            healthy
                        };
                        pool[turn % pool.len()]
                    };
                    match c
                        .post(format!("http://{addr}/v1/chat/completions"))
                        .json(
                            &json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
                        )
                        .send()
                        .await
                    {
                        Ok(r) if r.status() == 200 => {
                            ok = r.text().await.is_ok();
                            if ok {
                                break;
                            }
                        }
                        // The SDK retries 408, 409, 429 and 5xx too: the count says which.
                        Ok(r) => last = format!("{}", r.status()),
                        Err(e) => {
                            last = format!("{e}");
                            // Only a connection that was never made is retried here; the SDK
                            // retries any connection error after a short backoff.
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                }
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !ok {
                    failed.lock().unwrap().push(last);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, gw) in gws.iter_mut().enumerate() {
        let before = sent.load(std::sync::atomic::Ordering::Relaxed);
        gw.term();
        // Draining: /health says so as soon as the signal is handled (the signal arrives on
        // its own time: polled), and a request is still served, with `Connection: close`.
        let draining = eventually(Duration::from_secs(5), || async {
            match reqwest::get(gw.url("/health")).await {
                Ok(h) if h.status() == 503 => h
                    .json::<Value>()
                    .await
                    .is_ok_and(|v| v["status"] == "draining"),
                _ => false,
            }
        })
        .await;
        assert!(draining, "gateway {i}: /health never said draining");
        let r = gw.chat("a", "still serving").await;
        assert_eq!(r.status(), 200, "served while draining");
        assert_eq!(header(&r, "connection"), "close");
        let exited = tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(20)));
        assert!(exited, "gateway {i} stopped cleanly");
        let old = gw.addr;
        *gw = Gw::start(&cfg);
        gw.ready().await;
        for m in members.lock().unwrap().iter_mut() {
            if m.0 == old {
                *m = (gw.addr, true);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            sent.load(std::sync::atomic::Ordering::Relaxed) > before + 20,
            "traffic went on while gateway {i} restarted"
        );
    }
    stop.cancel();
    for w in workers {
        w.await.unwrap();
    }
    checker.await.unwrap();
    let failed = failed.lock().unwrap().clone();
    let total = sent.load(std::sync::atomic::Ordering::Relaxed);
    assert!(total > 100, "{total} requests sent");
    assert!(
        failed.is_empty(),
        "{} of {total} failed: {failed:?}",
        failed.len()
    );
}

#[tokio::test]
async fn a_silent_connection_does_not_hold_up_shutdown() {
    let a = MockUp::openai("name: a").await;
    // Both far longer than `Gw::stop` waits (20 s): were the silent connection waited for, the
    // stop would fail.
    let mut gw = Gw::start(&format!(
        "server: {{ header_timeout: 60s, shutdown_grace: 40s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let silent = std::net::TcpStream::connect(gw.addr).unwrap();
    assert_eq!(gw.chat("a", "x").await.status(), 200, "it serves meanwhile");
    assert_eq!(a.requests().await, 1);
    gw.stop();
    wait_closed(silent).expect("the silent connection is closed at shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_shutdown_an_http2_connection_finishes_its_stream_then_is_sent_goaway() {
    let a = MockUp::openai("name: a\nrules: [{delay: 1s}]").await;
    // Both far longer than `Gw::stop` waits (20 s): neither may be what closes the connection.
    let mut gw = Gw::start(&format!(
        "server: {{ header_timeout: 60s, shutdown_grace: 40s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    let addr = gw.addr;
    let client = tokio::task::spawn_blocking(move || -> Result<_, String> {
        let mut c = RawH2::connect(addr);
        c.chat("a", false);
        let (mut status, mut ended, mut goaway) = (None, false, false);
        while let Some((ty, flags, id, payload)) = c.next()? {
            match ty {
                RawH2::HEADERS if id == 1 => status = payload.first().copied(),
                RawH2::DATA if id == 1 && flags & 1 != 0 => ended = true,
                RawH2::GOAWAY => goaway = true,
                _ => {
                    c.control(ty, flags, &payload, true);
                }
            }
        }
        Ok((status, ended, goaway))
    });
    assert!(
        eventually(Duration::from_secs(5), || async { a.requests().await == 1 }).await,
        "the request reached the upstream"
    );
    // SIGTERM while the request is in flight.
    tokio::task::block_in_place(|| gw.stop());
    let (status, ended, goaway) = client
        .await
        .unwrap()
        .expect("the connection is closed at shutdown");
    assert_eq!(status, Some(STATUS_200), "the stream in flight was served");
    assert!(ended, "its body ended");
    assert!(goaway, "the close is announced with GOAWAY");
}

#[tokio::test]
async fn shutdown_cuts_requests_at_the_grace_and_records_them() {
    cut_at_the_grace(reqwest::Client::new()).await;
}

/// HTTP/2 streams run in tasks of their own, not inside their connection's task: the hard stop
/// reaches them by another path (`front::stop`).
#[tokio::test]
async fn shutdown_cuts_http2_requests_at_the_grace_too() {
    let c = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    cut_at_the_grace(c).await;
}

#[tokio::test]
async fn keeps_serving_past_the_shutdown_grace() {
    // Regression: the drain bound once wrapped the whole server, which stopped accepting after
    // `shutdown_grace` of uptime.
    let a = MockUp::openai("name: a").await;
    let mut gw = Gw::start(&format!(
        "server: {{ shutdown_grace: 1s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    ));
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        gw.chat("a", "x").await.status(),
        200,
        "still serving after shutdown_grace"
    );
    // (`stop` fails the test if SIGTERM does not end the process.)
    gw.stop();
}

/// A bounded soak: a minute-scale run past every periodic timer of the first minute (the 10 s
/// stats snapshot, the 30 s default shutdown grace) with steady loopback traffic: every request
/// must succeed, memory must stay flat, and the audit trail must hold every request.
#[tokio::test]
async fn soak_forty_seconds_of_steady_traffic() {
    let a = MockUp::openai("rules: [{status: 503, when: {every: 10}}]").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&two(&a, &b, ""));
    let pid = gw.pid();
    let rss = move || rss_kb(pid);
    let c = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    let (mut sent, mut rss_after_warmup) = (0u64, 0u64);
    // Forty seconds, and past the warm-up sample however slow the machine (a count, not a
    // throughput: a busy machine makes the run longer, never red).
    while Instant::now() < deadline || sent <= 300 {
        let stream = sent % 3 == 0;
        let r = c
            .post(gw.url("/v1/chat/completions"))
            .json(&json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "soak"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(
            r.status(),
            200,
            "request {sent} failed at {:?}",
            Instant::now()
        );
        let _ = r.bytes().await.unwrap();
        sent += 1;
        if sent == 300 {
            rss_after_warmup = rss();
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let rss_end = rss();
    // What matters is that traffic ran past the warm-up sample (the loop sees to it) and every
    // request succeeded and was recorded.
    assert!(sent > 300, "{sent}");
    assert!(rss_after_warmup > 0, "could not read the gateway's RSS");
    assert!(
        rss_end < rss_after_warmup + 20_000,
        "RSS grew from {rss_after_warmup} kB to {rss_end} kB"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let n: i64 = one(&conn, "SELECT COUNT(*) FROM requests");
    assert_eq!(n as u64, sent);
}

/// A second SIGTERM ends the drain: with `server.drain_delay: 300s`, the first SIGTERM starts
/// the drain (`/health` 503 `draining`, requests still served with `Connection: close`, the
/// process running), and a second one makes the gateway stop at once instead of serving on for
/// the rest of the five minutes.
///
/// docs/configuration.md (`server.drain_delay`): "After SIGTERM, how long the gateway keeps
/// accepting and serving before it stops accepting: `/health` answers 503 `draining` at once
/// (load balancers and Swarm take it out of rotation), every HTTP/1 answer carries `Connection:
/// close` and HTTP/2 connections get GOAWAY. A second SIGTERM ends the delay."
/// docs/operations.md (`autohedge serve`): "SIGTERM/SIGINT start the drain: `/health` answers
/// 503 `draining` … for `server.drain_delay` (5 s) while the gateway still serves, then it stops
/// accepting and finishes in-flight requests … a second signal ends the delay."
///
/// Fails if: `cancel_on_signals` (src/cli.rs) stops listening for a second SIGTERM during the
/// drain delay (only the `sleep(delay)` arm left in its `select!`), so the process serves on
/// for the whole 300 s; or if the first SIGTERM no longer starts the drain (no `draining`).
///
/// The one time bound here is the promise itself: the process exits within 30 s of the second
/// signal, a tenth of the 300 s drain it would otherwise serve out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_ends_the_drain_delay() {
    use serde_json::Value;
    use std::time::Duration;

    let up = MockUp::openai("name: a").await;
    let cfg = format!(
        "server: {{ drain_delay: 300s }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\" }}\nhealth: {{ probe_interval: 1h }}\n",
        up.base()
    );
    let mut gw = Gw::start(&cfg);
    gw.ready().await;
    let r = gw.chat("a", "before").await;
    assert_eq!(r.status(), 200);
    assert_eq!(up.requests().await, 1, "served before any signal");

    // The first SIGTERM: the drain begins (the signal is handled on its own time: polled).
    gw.term();
    let draining = eventually(Duration::from_secs(10), || async {
        match reqwest::get(gw.url("/health")).await {
            Ok(h) if h.status() == 503 => h
                .json::<Value>()
                .await
                .is_ok_and(|v| v["status"] == "draining"),
            _ => false,
        }
    })
    .await;
    assert!(
        draining,
        "/health never said draining after the first SIGTERM"
    );
    // Draining, not stopping: still served, with `Connection: close`, and the process runs.
    let r = gw.chat("a", "while draining").await;
    assert_eq!(r.status(), 200, "served while draining");
    assert_eq!(header(&r, "connection"), "close");
    assert_eq!(up.requests().await, 2);
    assert!(
        !tokio::task::block_in_place(|| gw.wait_exit(Duration::ZERO)),
        "the first SIGTERM alone must not stop a gateway whose drain_delay is 300 s"
    );

    // The second SIGTERM ends the delay: a clean exit, long before the 300 s are over.
    gw.term();
    let exited = tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(30)));
    assert!(
        exited,
        "the gateway did not exit cleanly within 30 s of the second SIGTERM (drain_delay 300 s)\n{}",
        gw.log()
    );
    assert!(
        gw.log().contains("second SIGTERM"),
        "the gateway's log says why it closed early"
    );
}
