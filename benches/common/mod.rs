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
