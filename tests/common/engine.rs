//! A Docker Engine on a unix socket (or loopback TCP) that answers as a test scripts it,
//! hostile answers included.

use std::io::{Read, Write};
use std::time::Duration;

/// What the fake Docker engine answers a path with.
#[derive(Clone)]
pub enum EngineAnswer {
    /// A body of this status (`application/json`).
    Body(u16, String),
    /// A 200 whose chunked body is `start`, then `fill` bytes without end — up to 256 MiB,
    /// then the connection is held in silence.
    Endless { start: &'static str, fill: u8 },
    /// No answer; the connection held.
    Silent,
    /// `Body`, after a wait (an engine slow to answer, as at a node's start).
    Delayed(Duration, u16, String),
    /// `Body`, once the test opens the gate ([`open_gate`]): an engine slow to answer for as
    /// long as the test needs, however slow the machine.
    Gated(Gate, u16, String),
    /// A 200 whose chunked body is `line` again and again, one every `every`, for 30 s.
    Repeat { line: &'static str, every: Duration },
    /// A 200 whose chunked body is each line the test sends through the [`Feed`] (to every
    /// connection open at the time), held open between them: the engine's event stream, with
    /// events when the test says.
    Feed(Feed),
}

/// The test's end of [`EngineAnswer::Feed`].
#[derive(Clone, Default)]
pub struct Feed(std::sync::Arc<std::sync::Mutex<Vec<std::sync::mpsc::Sender<String>>>>);

impl Feed {
    /// Sends `line` (one JSON event; a newline is added) to every open connection; how many
    /// took it.
    pub fn send(&self, line: &str) -> usize {
        let mut open = self.0.lock().unwrap();
        open.retain(|tx| tx.send(format!("{line}\n")).is_ok());
        open.len()
    }

    /// Connections open now (the gateway follows the stream once this is at least one).
    pub fn open(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Holds [`EngineAnswer::Gated`] answers until opened.
pub type Gate = std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>;

/// Lets every answer held by `gate` go (and those that come later).
pub fn open_gate(gate: &Gate) {
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
}

/// A Docker Engine on a unix socket, as hostile as a test wants: each path (the first key it
/// contains) gets its [`EngineAnswer`], each connection one answer. Counts, by key, the
/// connections and the most written on one of them.
pub struct FakeEngine {
    _dir: tempfile::TempDir,
    pub host: String,
    answers: std::sync::Arc<std::sync::Mutex<Vec<(&'static str, EngineAnswer)>>>,
    seen: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<&'static str, (u64, u64)>>>,
}

impl FakeEngine {
    /// A reachable engine that is no swarm manager, lists no container and sends no event.
    pub fn start() -> FakeEngine {
        FakeEngine::start_on(false)
    }

    /// Listening on `tcp` (127.0.0.1) or on a unix socket.
    pub fn start_on(tcp: bool) -> FakeEngine {
        let dir = tempfile::tempdir().unwrap();
        let answers = std::sync::Arc::new(std::sync::Mutex::new(vec![
            ("/_ping", EngineAnswer::Body(200, "OK".into())),
            (
                "/services",
                EngineAnswer::Body(
                    503,
                    r#"{"message":"This node is not a swarm manager."}"#.into(),
                ),
            ),
            ("/containers/json", EngineAnswer::Body(200, "[]".into())),
            ("/events", EngineAnswer::Silent),
        ]));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
        let (a, s) = (answers.clone(), seen.clone());
        let host = if tcp {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let host = format!("tcp://{}", listener.local_addr().unwrap());
            std::thread::spawn(move || {
                for c in listener.incoming().flatten() {
                    let (a, s) = (a.clone(), s.clone());
                    std::thread::spawn(move || FakeEngine::serve(c, a, s));
                }
            });
            host
        } else {
            let sock = dir.path().join("docker.sock");
            let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
            std::thread::spawn(move || {
                for c in listener.incoming().flatten() {
                    let (a, s) = (a.clone(), s.clone());
                    std::thread::spawn(move || FakeEngine::serve(c, a, s));
                }
            });
            format!("unix://{}", sock.display())
        };
        FakeEngine {
            _dir: dir,
            host,
            answers,
            seen,
        }
    }

    pub fn set(&self, key: &'static str, answer: EngineAnswer) {
        let mut a = self.answers.lock().unwrap();
        a.retain(|(k, _)| *k != key);
        a.insert(0, (key, answer));
    }

    /// (connections, most bytes written on one) for `key`.
    pub fn seen(&self, key: &str) -> (u64, u64) {
        self.seen
            .lock()
            .unwrap()
            .get(key)
            .copied()
            .unwrap_or((0, 0))
    }

    #[allow(clippy::type_complexity)]
    fn serve(
        mut c: impl Read + Write,
        answers: std::sync::Arc<std::sync::Mutex<Vec<(&'static str, EngineAnswer)>>>,
        seen: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<&'static str, (u64, u64)>>>,
    ) {
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let head = String::from_utf8_lossy(&head).to_string();
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        let found = answers
            .lock()
            .unwrap()
            .iter()
            .find(|(k, _)| path.contains(k))
            .cloned();
        let Some((key, answer)) = found else {
            let body = r#"{"message":"page not found"}"#;
            let _ = write!(
                c,
                "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            return;
        };
        let note = |written: u64| {
            let mut s = seen.lock().unwrap();
            let e = s.entry(key).or_insert((0, 0));
            if written == 0 {
                e.0 += 1;
            }
            e.1 = e.1.max(written);
        };
        note(0);
        match answer {
            EngineAnswer::Body(status, body) => {
                let _ = write!(
                    c,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
            EngineAnswer::Silent => std::thread::sleep(Duration::from_secs(60)),
            EngineAnswer::Gated(gate, status, body) => {
                let mut open = gate.0.lock().unwrap();
                while !*open {
                    open = gate.1.wait(open).unwrap();
                }
                drop(open);
                let _ = write!(
                    c,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
            EngineAnswer::Delayed(wait, status, body) => {
                std::thread::sleep(wait);
                let _ = write!(
                    c,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
            EngineAnswer::Repeat { line, every } => {
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                );
                let until = std::time::Instant::now() + Duration::from_secs(30);
                let mut written = 0u64;
                while std::time::Instant::now() < until {
                    if write!(c, "{:x}\r\n{line}\r\n", line.len()).is_err() {
                        break;
                    }
                    written += line.len() as u64;
                    note(written);
                    std::thread::sleep(every);
                }
            }
            EngineAnswer::Feed(feed) => {
                if write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                .and_then(|_| c.flush())
                .is_err()
                {
                    return;
                }
                let (tx, rx) = std::sync::mpsc::channel::<String>();
                feed.0.lock().unwrap().push(tx);
                let mut written = 0u64;
                // Held for at most a minute without an event; a failed write (the gateway let
                // go) drops the receiver, and the next send forgets this connection.
                while let Ok(line) = rx.recv_timeout(Duration::from_secs(60)) {
                    if write!(c, "{:x}\r\n{line}\r\n", line.len())
                        .and_then(|_| c.flush())
                        .is_err()
                    {
                        break;
                    }
                    written += line.len() as u64;
                    note(written);
                }
            }
            EngineAnswer::Endless { start, fill } => {
                const CAP: u64 = 256 << 20;
                let _ = write!(
                    c,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{start}\r\n",
                    start.len()
                );
                let chunk = vec![fill; 64 * 1024];
                let mut written = 0u64;
                // Counts every byte the kernel took, not whole chunks: the gateway lets go in
                // the middle of one, and that chunk's bytes up to there were read.
                'answer: while written < CAP {
                    if write!(c, "{:x}\r\n", chunk.len()).is_err() {
                        break;
                    }
                    let mut rest = &chunk[..];
                    while !rest.is_empty() {
                        match c.write(rest) {
                            Ok(0) | Err(_) => break 'answer,
                            Ok(n) => {
                                written += n as u64;
                                note(written);
                                rest = &rest[n..];
                            }
                        }
                    }
                    if c.write_all(b"\r\n").is_err() {
                        break;
                    }
                }
                std::thread::sleep(Duration::from_secs(60));
            }
        }
    }
}

/// The Engine API's answer for one replicated Swarm service `svc1` named `name`, labelled as
/// endpoint `endpoint` on `port`, with `extra` labels (`autohedge.manage`, a stack).
pub fn service(name: &str, endpoint: &str, port: u16, extra: &[(&str, &str)]) -> serde_json::Value {
    service_with_id("svc1", name, endpoint, port, extra)
}

/// The same with its own id.
pub fn service_with_id(
    id: &str,
    name: &str,
    endpoint: &str,
    port: u16,
    extra: &[(&str, &str)],
) -> serde_json::Value {
    let mut labels =
        serde_json::json!({"autohedge.endpoint": endpoint, "autohedge.port": port.to_string()});
    for (k, v) in extra {
        labels[*k] = serde_json::json!(v);
    }
    serde_json::json!({
        "ID": id,
        "Version": {"Index": 1},
        "Spec": {"Name": name, "Labels": labels, "Mode": {"Replicated": {"Replicas": 1}}},
    })
}

/// The task list with one task `task1` of service `svc1` in `state` (Swarm's word: `running`,
/// `starting`, `failed`…), reachable at 127.0.0.1 on the network `backend`.
pub fn tasks(state: &str) -> EngineAnswer {
    EngineAnswer::Body(
        200,
        serde_json::json!([{
            "ID": "task1",
            "ServiceID": "svc1",
            "DesiredState": "running",
            "Status": {"State": state},
            "NetworksAttachments": [{"Network": {"Spec": {"Name": "backend"}}, "Addresses": ["127.0.0.1/8"]}],
        }])
        .to_string(),
    )
}
