//! `RawUp`: the one hand-written HTTP/1 upstream, for what a `MockUp` script cannot play. It binds
//! 127.0.0.1:0 (the port read back from the listener it keeps), serves each connection on its own
//! thread, reads each request the same way (the head up to `\r\n\r\n`, then exactly its
//! `content-length` body) and hands it to a closure that decides the answer, byte for byte.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use serde_json::Value;

/// One request as it came: its connection (numbered from 0 in accept order), its number on that
/// connection (from 0), the head as sent, and the body's raw bytes.
#[derive(Clone, Debug)]
pub struct Request {
    pub conn: u64,
    pub nth: u64,
    pub method: String,
    pub path: String,
    pub head: String,
    pub body: Vec<u8>,
    pub at: Instant,
}

impl Request {
    /// The body as JSON (null when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

/// What a stream does once it has been written up to its cap.
pub enum Then {
    /// Silence, the connection held until the peer lets go of it (then `released`).
    Hold,
    /// The connection closes.
    Close,
    /// The connection's next request is read.
    Next,
    /// These bytes end the answer (a failed write is a release); then the next request.
    Finish(Vec<u8>),
}

/// What the server does with one request.
pub enum Answer {
    /// Writes these bytes, then reads the connection's next request.
    Write(Vec<u8>),
    /// Writes these bytes, then closes the connection.
    WriteClose(Vec<u8>),
    /// Closes the connection without a word.
    Close,
    /// Says nothing: reads until the peer closes the connection (then `released`).
    Hold,
    /// Writes `head`, then `piece` again and again, each counting `credit` bytes towards `cap`
    /// (and towards [`RawUp::written`]), until the cap or a failed write (then `released`).
    Stream {
        head: Vec<u8>,
        piece: Vec<u8>,
        credit: u64,
        cap: u64,
        then: Then,
    },
    /// Waits until [`RawUp::open_gate`], then answers.
    Gated(Box<Answer>),
}

impl Answer {
    /// A whole answer: status line, `content-type` and `content-length`, then the body.
    pub fn full(status: &str, content_type: &str, body: &str) -> Answer {
        Answer::Write(
            format!(
                "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )
    }

    /// The one-model list (`m`) a probe's GET gets.
    pub fn models_list() -> Answer {
        Answer::full(
            "200 OK",
            "application/json",
            r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#,
        )
    }
}

type Handler = dyn Fn(&Request) -> Answer + Send + Sync;

struct Shared {
    handler: Box<Handler>,
    on_release: Box<dyn Fn(Instant) + Send + Sync>,
    requests: Mutex<Vec<Request>>,
    accepted: AtomicU64,
    written: Arc<AtomicU64>,
    released: AtomicBool,
    gate: (Mutex<bool>, Condvar),
}

/// The raw upstream; its threads end with the test process (a held connection ends when the
/// gateway lets go of it).
pub struct RawUp {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

impl RawUp {
    /// Serves every request with `handler`.
    pub fn start(handler: impl Fn(&Request) -> Answer + Send + Sync + 'static) -> RawUp {
        RawUp::with_release(handler, |_| {})
    }

    /// As [`RawUp::start`], and `on_release` is told when a held or streamed connection is let
    /// go of by the peer.
    pub fn with_release(
        handler: impl Fn(&Request) -> Answer + Send + Sync + 'static,
        on_release: impl Fn(Instant) + Send + Sync + 'static,
    ) -> RawUp {
        RawUp::serve(Some(Box::new(handler)), Box::new(on_release))
    }

    /// Accepts connections and never reads or writes a byte on them (a stalled TLS handshake);
    /// [`RawUp::accepted`] counts them.
    pub fn mute() -> RawUp {
        RawUp::serve(None, Box::new(|_| {}))
    }

    fn serve(
        handler: Option<Box<Handler>>,
        on_release: Box<dyn Fn(Instant) + Send + Sync>,
    ) -> RawUp {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mute = handler.is_none();
        let shared = Arc::new(Shared {
            handler: handler.unwrap_or_else(|| Box::new(|_| Answer::Hold)),
            on_release,
            requests: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
            written: Arc::new(AtomicU64::new(0)),
            released: AtomicBool::new(false),
            gate: (Mutex::new(false), Condvar::new()),
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming() {
                let Ok(s) = conn else { return };
                let id = sh.accepted.fetch_add(1, Ordering::SeqCst);
                if mute {
                    held.push(s);
                    continue;
                }
                let sh = sh.clone();
                std::thread::spawn(move || connection(&sh, s, id));
            }
        });
        RawUp { addr, shared }
    }

    /// `http://ADDR/v1`, as [`super::MockUp::base`].
    pub fn base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request so far, in arrival order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.requests.lock().unwrap().clone()
    }

    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// The most any one streamed answer got credited as written.
    pub fn written(&self) -> u64 {
        self.shared.written.load(Ordering::SeqCst)
    }

    /// The counter behind [`RawUp::written`], to hand out.
    pub fn written_counter(&self) -> Arc<AtomicU64> {
        self.shared.written.clone()
    }

    /// The peer let go of a held or streamed answer (it closed, or a write failed).
    pub fn released(&self) -> bool {
        self.shared.released.load(Ordering::SeqCst)
    }

    /// Lets every [`Answer::Gated`] answer go, now and from now on.
    pub fn open_gate(&self) {
        *self.shared.gate.0.lock().unwrap() = true;
        self.shared.gate.1.notify_all();
    }
}

fn release(sh: &Shared) {
    sh.released.store(true, Ordering::SeqCst);
    (sh.on_release)(Instant::now());
}

fn connection(sh: &Shared, s: TcpStream, conn: u64) {
    let Ok(mut w) = s.try_clone() else { return };
    let mut r = BufReader::new(s);
    for nth in 0.. {
        // One request: its head, then as many body bytes as it declares.
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            match r.read_until(b'\n', &mut head) {
                Ok(n) if n > 0 => {}
                _ => return,
            }
        }
        let head = String::from_utf8_lossy(&head).to_string();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        let mut body = vec![0u8; length];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let mut words = head.split_whitespace();
        let req = Request {
            conn,
            nth,
            method: words.next().unwrap_or("").to_string(),
            path: words.next().unwrap_or("").to_string(),
            head: head.clone(),
            body,
            at: Instant::now(),
        };
        sh.requests.lock().unwrap().push(req.clone());
        let mut answer = (sh.handler)(&req);
        while let Answer::Gated(inner) = answer {
            let mut open = sh.gate.0.lock().unwrap();
            while !*open {
                open = sh.gate.1.wait(open).unwrap();
            }
            answer = *inner;
        }
        match answer {
            Answer::Write(bytes) => {
                if w.write_all(&bytes).is_err() {
                    return;
                }
            }
            Answer::WriteClose(bytes) => {
                let _ = w.write_all(&bytes);
                return;
            }
            Answer::Close => return,
            Answer::Hold => return hold(sh, &mut r),
            Answer::Stream {
                head,
                piece,
                credit,
                cap,
                then,
            } => {
                let _ = w.write_all(&head);
                let mut sent = 0u64;
                while sent < cap {
                    if w.write_all(&piece).is_err() {
                        return release(sh);
                    }
                    sent += credit;
                    sh.written.fetch_max(sent, Ordering::SeqCst);
                }
                match then {
                    Then::Hold => return hold(sh, &mut r),
                    Then::Close => return,
                    Then::Next => {}
                    Then::Finish(tail) => {
                        if w.write_all(&tail).is_err() {
                            return release(sh);
                        }
                    }
                }
            }
            Answer::Gated(_) => unreachable!(),
        }
    }
}

/// Silence: reads until the peer closes the connection.
fn hold(sh: &Shared, r: &mut BufReader<TcpStream>) {
    let mut buf = [0u8; 4096];
    loop {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => return release(sh),
            Ok(_) => {}
        }
    }
}
