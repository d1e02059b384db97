//! A `redis-server` of our own (Debian's package; tests/run-all.sh installs it) for the suites
//! that share one: loopback, a free port, persistence off, killed when dropped.

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` of our own: loopback, a free port, no persistence. Killed when dropped.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
}

impl Redis {
    /// On a free port: one another process takes between our pick and Redis's bind is picked
    /// again (Redis exits when it cannot bind), so suites running side by side never collide.
    pub fn start() -> Redis {
        for _ in 0..10 {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            if let Some(r) = Redis::try_start_on(port) {
                return r;
            }
        }
        panic!("redis-server found no free port in ten tries");
    }

    /// On `port` (a restart where the gateway knows the address): waits for it to be free.
    pub fn start_on(port: u16) -> Redis {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(r) = Redis::try_start_on(port) {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "redis-server could not bind {port}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `None` when the server exits before it answers (the port was taken).
    fn try_start_on(port: u16) -> Option<Redis> {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server (Debian's redis-server package; tests/run-all.sh installs it)");
        let mut r = Redis {
            port,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while r.ping().as_deref() != Some("+PONG") {
            if let Some(c) = r.child.as_mut()
                && c.try_wait().ok().flatten().is_some()
            {
                r.child = None;
                return None;
            }
            assert!(Instant::now() < deadline, "redis-server did not answer");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(r)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// One command in Redis's inline protocol; the answer as text.
    pub fn answer(&self, line: &str) -> Option<String> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(format!("{line}\r\n").as_bytes()).ok()?;
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).to_string())
    }

    /// The answer's first line.
    pub fn cmd(&self, line: &str) -> Option<String> {
        let text = self.answer(line)?;
        Some(text.lines().next().unwrap_or("").to_string())
    }

    /// A bulk-string answer's value (`None` for a nil one).
    pub fn value(&self, line: &str) -> Option<String> {
        let text = self.answer(line)?;
        let mut lines = text.lines();
        match lines.next()? {
            "$-1" => None,
            l if l.starts_with('$') => lines.next().map(str::to_string),
            l => Some(l.to_string()),
        }
    }

    pub fn ping(&self) -> Option<String> {
        self.cmd("PING")
    }

    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().unwrap().id();
        assert!(super::signal(pid, sig), "kill -{sig} {pid}");
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A frozen server would not die of SIGKILL's sibling signals; SIGKILL always works.
            super::signal(c.id(), "CONT");
        }
        self.kill();
    }
}
