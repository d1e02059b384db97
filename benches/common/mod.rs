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

/// The address `child` prints (`… listening on [http://]ADDR`); the rest of its output is read
/// and dropped.
pub fn listen_line(child: &mut Child) -> SocketAddr {
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let addr = loop {
        let line = lines.next().expect("child printed its address").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.trim().trim_start_matches("http://").parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    addr
}

/// The gateway binary, which is also the mock upstream.
pub const GATEWAY: &str = env!("CARGO_BIN_EXE_autohedge");

/// The gateway measured: this build's, or the one `AUTOHEDGE_BENCH_GATEWAY` names (another
/// build to compare with, or `target/dist/autohedge`, the fat-LTO build the image ships).
pub fn gateway_bin() -> std::path::PathBuf {
    std::env::var_os("AUTOHEDGE_BENCH_GATEWAY")
        .map(Into::into)
        .unwrap_or_else(|| GATEWAY.into())
}

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
    let mut child = Command::new(gateway_bin())
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

/// This bench's own binary run with `--role=ROLE` (and `extra`), and the address it listens on.
pub fn spawn_role(role: &str, extra: &[String]) -> (Child, SocketAddr) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg(format!("--role={role}"))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr = listen_line(&mut child);
    (child, addr)
}

/// The floor: accept, forward the request to `target` with a pooled client, stream the
/// response back. No parsing, no policy: the least any Rust proxy pays on this machine.
pub async fn floor_proxy(target: String) {
    use http_body_util::{BodyExt, Full};
    use hyper::body::{Bytes, Incoming};
    use hyper::{Request, Response};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use std::sync::Arc;

    let listener = autohedge::front::server::bind("127.0.0.1:0").await.unwrap();
    println!("listening on {}", listener.local_addr().unwrap());
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    let client: Client<HttpConnector, Incoming> = Client::builder(TokioExecutor::new()).build(conn);
    let target: Arc<str> = target.into();
    loop {
        let (s, _) = listener.accept().await.unwrap();
        let _ = s.set_nodelay(true);
        let client = client.clone();
        let target = target.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let client = client.clone();
                let target = target.clone();
                async move {
                    let (mut parts, body) = req.into_parts();
                    let pq = parts
                        .uri
                        .path_and_query()
                        .map(|p| p.as_str())
                        .unwrap_or("/");
                    parts.uri = format!("http://{target}{pq}").parse().unwrap();
                    let resp = client.request(Request::from_parts(parts, body)).await;
                    Ok::<_, std::convert::Infallible>(match resp {
                        Ok(r) => r.map(|b| b.boxed()),
                        Err(_) => Response::builder()
                            .status(502)
                            .body(Full::new(Bytes::new()).map_err(|e| match e {}).boxed())
                            .unwrap(),
                    })
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .await;
        });
    }
}

/// CPU seconds (user + system) process `pid` has used.
pub fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

/// A process's peak resident memory, MiB.
pub fn peak_rss_mb(pid: u32) -> f64 {
    status_mb(pid, "VmHWM:")
}

/// A process's resident memory now, MiB.
pub fn rss_now_mb(pid: u32) -> f64 {
    status_mb(pid, "VmRSS:")
}

fn status_mb(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}
