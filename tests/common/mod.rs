//! Test harness: starts the real `autohedge` binary on port 0 against in-process mock upstreams
//! (real HTTP servers on 127.0.0.1) and talks to it over HTTP.

#![allow(dead_code)]

pub mod cfg;
pub mod clusters;
pub mod endless;
pub mod engine;
pub mod otlp;
pub mod pg_server;
pub mod raw;
pub mod redis_server;
pub mod tenants;
pub mod trail;
pub mod util;
pub mod vllm;

#[allow(unused_imports)]
pub use cfg::*;
#[allow(unused_imports)]
pub use clusters::*;
#[allow(unused_imports)]
pub use endless::*;
#[allow(unused_imports)]
pub use raw::{Answer, RawUp, Request, Then};
#[allow(unused_imports)]
pub use tenants::*;
#[allow(unused_imports)]
pub use trail::*;
#[allow(unused_imports)]
pub use util::*;
#[allow(unused_imports)]
pub use vllm::*;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use autohedge::demo::mock::{self, Flavor};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

pub const BIN: &str = env!("CARGO_BIN_EXE_autohedge");

/// An environment value that removes the variable instead (see [`Gw::start_with_env`]).
pub const UNSET: &str = "\u{0}unset";

/// An in-process mock upstream; stops when dropped.
pub struct MockUp {
    pub addr: SocketAddr,
    cancel: CancellationToken,
}

impl MockUp {
    pub async fn start(flavor: Flavor, script: &str) -> MockUp {
        let cancel = CancellationToken::new();
        let (addr, _) = autohedge::cli::spawn_mock(
            flavor,
            mock::parse_script(script).expect("mock script"),
            cancel.clone(),
        )
        .await
        .expect("mock starts");
        MockUp { addr, cancel }
    }

    pub async fn openai(script: &str) -> MockUp {
        Self::start(Flavor::Openai, script).await
    }

    pub fn base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub async fn stats(&self) -> Value {
        reqwest::get(format!("http://{}/__mock/stats", self.addr))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn requests(&self) -> u64 {
        self.stats().await["requests"].as_u64().unwrap()
    }

    pub async fn set_script(&self, script: &str) {
        let r = reqwest::Client::new()
            .post(format!("http://{}/__mock/script", self.addr))
            .body(script.to_string())
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
    }
}

impl Drop for MockUp {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A port nothing listens on: bound (so no one else can take it while the test runs) but never
/// listening, so connecting to it is refused at once. Not bind-then-release, which races with
/// every other test picking ports.
pub struct DeadPort {
    addr: SocketAddr,
    _sock: tokio::net::TcpSocket,
}

impl std::ops::Deref for DeadPort {
    type Target = SocketAddr;
    fn deref(&self) -> &SocketAddr {
        &self.addr
    }
}

impl std::fmt::Display for DeadPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.addr.fmt(f)
    }
}

pub fn dead_addr() -> DeadPort {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = sock.local_addr().unwrap();
    DeadPort { addr, _sock: sock }
}

/// The real gateway binary.
pub struct Gw {
    pub addr: SocketAddr,
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    child: Option<Child>,
    _tmp: Option<tempfile::TempDir>,
}

impl Gw {
    pub fn start(config: &str) -> Gw {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let mut gw = Gw::start_in(&dir, config, &[]);
        gw._tmp = Some(tmp);
        gw
    }

    pub fn start_with_env(config: &str, env: &[(&str, &str)]) -> Gw {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let mut gw = Gw::start_in(&dir, config, env);
        gw._tmp = Some(tmp);
        gw
    }

    /// Starts as `shell` says, a `sh -c` script run before the gateway replaces it (`exec`):
    /// `ulimit -Sn 256`, say. A temporary directory as [`Gw::start`].
    pub fn start_after_shell(config: &str, shell: &str) -> Gw {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let config_path = dir.join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        let script = format!("{shell} && exec \"$0\" \"$@\"");
        let mut gw = Gw::spawn(
            &dir,
            &config_path,
            &[],
            "127.0.0.1:0",
            &["sh", "-c", &script],
        );
        gw._tmp = Some(tmp);
        gw
    }

    /// Starts in `dir` (config.yaml, data/, gateway.log there).
    pub fn start_in(dir: &Path, config: &str, env: &[(&str, &str)]) -> Gw {
        let config_path = dir.join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        Gw::start_at(dir, &config_path, env)
    }

    /// Starts with the config at `config_path` as it is (a symlink, say); data and log in `dir`.
    pub fn start_at(dir: &Path, config_path: &Path, env: &[(&str, &str)]) -> Gw {
        Gw::start_listening(dir, config_path, env, "127.0.0.1:0")
    }

    /// The same on `listen` (`0.0.0.0:0` to be reached from a non-loopback address).
    pub fn start_listening(
        dir: &Path,
        config_path: &Path,
        env: &[(&str, &str)],
        listen: &str,
    ) -> Gw {
        Gw::spawn(dir, config_path, env, listen, &[])
    }

    /// The gateway binary run by `prefix` (its first word the program, the binary and its
    /// arguments after it), or on its own when `prefix` is empty.
    fn spawn(
        dir: &Path,
        config_path: &Path,
        env: &[(&str, &str)],
        listen: &str,
        prefix: &[&str],
    ) -> Gw {
        let config_path = config_path.to_path_buf();
        let log_path = dir.join("gateway.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let mut cmd = match prefix.split_first() {
            None => Command::new(BIN),
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(BIN);
                c
            }
        };
        cmd.args(["serve", "--listen", listen, "--config"])
            .arg(&config_path)
            .arg("--data-dir")
            .arg(dir.join("data"))
            .env("RUST_LOG", "debug")
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(log);
        for (k, v) in env {
            // `UNSET` removes a variable the harness sets (NO_COLOR, RUST_LOG).
            if *v == UNSET {
                cmd.env_remove(k);
            } else {
                cmd.env(k, v);
            }
        }
        let mut child = cmd.spawn().expect("gateway starts");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(rest) = line.strip_prefix("autohedge listening on http://") {
                        break rest.trim().parse().unwrap();
                    }
                }
                _ => {
                    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                    panic!("gateway exited before listening:\n{log}");
                }
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Gw {
            addr,
            dir: dir.to_path_buf(),
            config_path,
            log_path,
            child: Some(child),
            _tmp: None,
        }
    }

    /// The gateway process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The audit database's bytes — the file and its write-ahead log — as text, for showing
    /// that a value is stored nowhere in it.
    pub fn db_text(&self) -> String {
        let mut db = Vec::new();
        for f in ["autohedge.db", "autohedge.db-wal"] {
            db.extend(std::fs::read(self.data_dir().join(f)).unwrap_or_default());
        }
        String::from_utf8_lossy(&db).into_owned()
    }

    pub fn db(&self) -> PathBuf {
        self.data_dir().join("autohedge.db")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub async fn chat(&self, model: &str, content: &str) -> reqwest::Response {
        self.post(
            "/v1/chat/completions",
            json!({"model": model, "messages": [{"role": "user", "content": content}]}),
        )
        .await
    }

    /// `POST /v1/chat/completions` with our own `x-request-id`, to find the request's audit row.
    pub async fn chat_id(&self, id: &str, body: Value) -> reqwest::Response {
        reqwest::Client::new()
            .post(self.url("/v1/chat/completions"))
            .header("x-request-id", id)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    pub async fn post(&self, path: &str, body: Value) -> reqwest::Response {
        reqwest::Client::new()
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// Waits (at most 10 s) until the gateway is ready: `/health` answers 200, not 503
    /// `starting` (its first probe round and discovery scan are done).
    pub async fn ready(&self) {
        let url = self.url("/health");
        let ok = eventually(Duration::from_secs(10), || {
            let url = url.clone();
            async move { reqwest::get(url).await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
        assert!(ok, "the gateway did not become ready within 10 s");
    }

    pub async fn status(&self) -> Value {
        reqwest::get(self.url("/status"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// `/metrics` as text.
    pub async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// One unlabelled `/metrics` value (0 when absent).
    pub async fn metric(&self, name: &str) -> f64 {
        self.metrics()
            .await
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// One SIGHUP: the gateway reloads its config.
    pub fn hup(&self) {
        assert!(signal(self.pid(), "HUP"), "kill -HUP {}", self.pid());
    }

    /// One SIGTERM: the gateway drains (`server.drain_delay`) before it stops accepting.
    pub fn term(&self) {
        if let Some(child) = &self.child {
            signal(child.id(), "TERM");
        }
    }

    /// Waits (at most `within`) for the process to exit; true when it exited cleanly.
    pub fn wait_exit(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while let Some(child) = self.child.as_mut() {
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    return status.success();
                }
                _ if Instant::now() > deadline => return false,
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        false
    }

    /// SIGTERM and wait for a clean exit (the audit queue drained). A second SIGTERM once the
    /// gateway has taken the first skips `server.drain_delay` (tests that drain say so with
    /// [`Gw::term`]).
    pub fn stop(&mut self) {
        const TAKEN: &str = "signalled to stop: draining";
        if let Some(mut child) = self.child.take() {
            // The log is appended to by every gateway started in this directory.
            let before = self.log().matches(TAKEN).count();
            signal(child.id(), "TERM");
            // Two signals before the gateway takes the first are one: wait until its log says
            // it took it (or it is gone). Without the line (a log level that hides it), the
            // second goes after the wait, as it would have gone at once.
            let deadline = Instant::now() + Duration::from_secs(5);
            while self.log().matches(TAKEN).count() == before
                && !matches!(child.try_wait(), Ok(Some(_)))
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !matches!(child.try_wait(), Ok(Some(_))) {
                signal(child.id(), "TERM");
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => {
                        assert!(status.success(), "gateway exited with {status}");
                        return;
                    }
                    _ if Instant::now() > deadline => {
                        let _ = child.kill();
                        panic!("gateway did not stop within 20s after SIGTERM");
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }
}

/// Sends `sig` (a name without the dash: "TERM", "HUP", "INT", "STOP", "CONT", "KILL") to
/// `pid`; true when it was delivered. The one `kill` command in tests/.
pub fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success())
}

/// A process stopped (SIGSTOP) for as long as this lives: SIGCONT when dropped, so a failing
/// assertion never leaves it stopped.
pub struct Paused(u32);

impl Paused {
    pub fn new(pid: u32) -> Paused {
        assert!(signal(pid, "STOP"), "kill -STOP {pid}");
        Paused(pid)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

/// A child process killed (and reaped) when dropped, however the test ends.
pub struct KillOnDrop(pub Child);

impl std::ops::Deref for KillOnDrop {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Gw {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn header(r: &reqwest::Response, name: &str) -> String {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// Polls `f` until it returns true or `within` passes.
pub async fn eventually<F, Fut>(within: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Reads an SSE response into its `data:` payloads.
pub async fn sse_events(r: reqwest::Response) -> Vec<String> {
    let text = r.text().await.unwrap();
    let mut p = autohedge::wire::sse::SseParser::new();
    p.push(text.as_bytes())
        .unwrap()
        .into_iter()
        .map(|e| e.data)
        .collect()
}

/// The streamed text content of chat chunks.
pub fn stream_text(events: &[String]) -> String {
    events
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .collect()
}

/// One value from the audit database (first column of the first row).
pub fn one<T: rusqlite::types::FromSql>(conn: &rusqlite::Connection, sql: &str) -> T {
    conn.query_row(sql, [], |r| r.get(0))
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// A process's resident memory in kB (0 when it cannot be read).
pub fn rss_kb(pid: u32) -> u64 {
    status_kb(pid, "VmRSS:")
}

/// The peak resident memory of process `pid` (`VmHWM`), in KB.
pub fn peak_kb(pid: u32) -> u64 {
    status_kb(pid, "VmHWM:")
}

/// A KB figure of `/proc/PID/status`.
fn status_kb(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Rows of the gateway's audit database as JSON values.
pub fn audit_rows(gw: &Gw, sql: &str) -> Vec<Vec<Value>> {
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let mut stmt = conn.prepare(sql).unwrap();
    let n = stmt.column_count();
    stmt.query_map([], |r| {
        Ok((0..n)
            .map(|i| match r.get_ref(i).unwrap() {
                rusqlite::types::ValueRef::Null => Value::Null,
                rusqlite::types::ValueRef::Integer(v) => json!(v),
                rusqlite::types::ValueRef::Real(v) => json!(v),
                rusqlite::types::ValueRef::Text(t) => json!(String::from_utf8_lossy(t)),
                rusqlite::types::ValueRef::Blob(_) => Value::Null,
            })
            .collect())
    })
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// What [`scripted_webhook`] received: (path, arrival, JSON body) per POST.
pub type Webhooked = std::sync::Arc<std::sync::Mutex<Vec<(String, std::time::Instant, Value)>>>;

/// A webhook that answers as scripted, per path: for the nth POST to a path its nth entry
/// (`"drop"` closes the connection with no answer, a number is that status), 200 past the
/// script. Records each POST's path, arrival and JSON body (null when it is not JSON).
pub async fn scripted_webhook(
    scripts: &[(&'static str, Vec<&'static str>)],
) -> (std::net::SocketAddr, Webhooked) {
    let got: Webhooked = Default::default();
    let scripts: Vec<(&'static str, Vec<&'static str>)> = scripts.to_vec();
    let seen = got.clone();
    // One request a connection (`connection: close`).
    let up = RawUp::start(move |req| {
        let nth = {
            let mut g = seen.lock().unwrap();
            let nth = g.iter().filter(|(p, _, _)| *p == req.path).count();
            g.push((req.path.clone(), std::time::Instant::now(), req.json()));
            nth
        };
        let answer = scripts
            .iter()
            .find(|(p, _)| *p == req.path)
            .and_then(|(_, script)| script.get(nth).copied())
            .unwrap_or("200");
        if answer == "drop" {
            return Answer::Close;
        }
        Answer::WriteClose(
            format!("HTTP/1.1 {answer} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .into_bytes(),
        )
    });
    let addr = up.addr;
    (addr, got)
}

/// The month as the gateway names it (`YYYY-MM`, UTC), from this machine's clock.
pub fn month_now() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let days = now / 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}")
}
