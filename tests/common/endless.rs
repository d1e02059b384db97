//! A loopback upstream whose answers never end, and what to assert about it.

use std::io::{Read, Write};
use std::time::Duration;

use super::MockUp;

/// A loopback upstream whose answers never end: every POST (and, with `endless_get`, every GET)
/// gets a 200 with a chunked JSON body — or, with `events`, an event stream of that one event
/// (`ROLE` or `CONTENT`) again and again — written until `cap` bytes, then the connection is held
/// in silence. GETs otherwise get a one-model list, so probes pass. `written` is the most any
/// connection got written before the gateway stopped reading (or `cap`); `released` says the
/// gateway let go of an answer's connection (a write failed, or it closed).
pub struct Endless {
    pub addr: std::net::SocketAddr,
    pub written: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pub released: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Endless {
    pub fn start(cap: u64, endless_get: bool, events: Option<&'static str>) -> Endless {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let written = std::sync::Arc::new(AtomicU64::new(0));
        let released = std::sync::Arc::new(AtomicBool::new(false));
        let (w, r) = (written.clone(), released.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { return };
                let (w, r) = (w.clone(), r.clone());
                std::thread::spawn(move || {
                    loop {
                        // One request: its head, then as many body bytes as it declares.
                        let mut head = Vec::new();
                        let mut byte = [0u8; 1];
                        while !head.ends_with(b"\r\n\r\n") {
                            match s.read(&mut byte) {
                                Ok(1) => head.push(byte[0]),
                                _ => return,
                            }
                        }
                        let head = String::from_utf8_lossy(&head).to_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        let mut body = vec![0u8; length];
                        if s.read_exact(&mut body).is_err() {
                            return;
                        }
                        if head.starts_with("get") && !endless_get {
                            let list = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
                            let _ = write!(
                                s,
                                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{list}",
                                list.len()
                            );
                            continue;
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
                        let _ = write!(
                            s,
                            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n{first}"
                        );
                        let chunk = format!("{:x}\r\n{piece}\r\n", piece.len());
                        let mut sent = 0u64;
                        while sent < cap {
                            if s.write_all(chunk.as_bytes()).is_err() {
                                r.store(true, Ordering::Relaxed);
                                return;
                            }
                            sent += piece.len() as u64;
                            w.fetch_max(sent, Ordering::Relaxed);
                        }
                        // Silence, the connection held until the gateway lets go of it.
                        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                        if matches!(s.read(&mut byte), Ok(0)) {
                            r.store(true, Ordering::Relaxed);
                        }
                        return;
                    }
                });
            }
        });
        Endless {
            addr,
            written,
            released,
        }
    }

    pub fn written(&self) -> u64 {
        self.written.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// `a` (an endless upstream) then `b` in the chain, with `server.max_response_bytes` at 1 MiB
/// and `a`'s `timeouts` as given.
pub fn endless_then(a: &Endless, b: &MockUp, timeouts: &str) -> String {
    format!(
        "server: {{ max_response_bytes: 1048576 }}\nmodels:\n  a: {{ type: openai, base_url: \"http://{}/v1\", timeouts: {timeouts} }}\n  b: {{ type: openai, base_url: \"{}\" }}\nrouting_policy:\n  fallback_chain: [a, b]\n",
        a.addr,
        b.base()
    )
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
