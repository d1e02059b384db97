//! What the benches share: the processes they start (the gateway binary, its mock upstream),
//! ended when dropped, and the address each prints.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

/// A child process, sent SIGTERM and waited for when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(self.0.id().to_string())
                .stderr(Stdio::null())
                .status();
        }
        let _ = self.0.wait();
    }
}

/// The address `child` prints (`… listening on http://ADDR`); the rest of its output is read
/// and dropped.
pub fn listen_line(child: &mut Child) -> SocketAddr {
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let addr = loop {
        let line = lines.next().expect("child printed its address").unwrap();
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.trim().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    addr
}

/// The gateway binary, which is also the mock upstream.
pub const GATEWAY: &str = env!("CARGO_BIN_EXE_autohedge");

/// A mock upstream (`autohedge mock-upstream`) running `script`, written to `dir/{name}.yaml`.
pub fn mock(dir: &std::path::Path, name: &str, script: &str) -> (Proc, SocketAddr) {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, script).unwrap();
    let mut child = Command::new(GATEWAY)
        .args(["mock-upstream", "--listen", "127.0.0.1:0", "--script"])
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = listen_line(&mut child);
    (Proc(child), addr)
}

/// The gateway serving `config` (written to `dir/config.yaml`, its data in `dir/data`), with
/// `env` set.
pub fn gateway(dir: &std::path::Path, config: &str, env: &[(&str, &str)]) -> (Proc, SocketAddr) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.yaml"), config).unwrap();
    let mut child = Command::new(GATEWAY)
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(dir.join("config.yaml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr = listen_line(&mut child);
    (Proc(child), addr)
}
