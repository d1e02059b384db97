//! Connections held open (issue #47), the gateway beside the floor (a bare hyper pass-through
//! proxy, this binary re-executed with `--role=proxy`) in one run, both in front of the same mock
//! upstream (`autohedge mock-upstream`):
//!
//! - **idle**: `AUTOHEDGE_BENCH_IDLE` (10,000) keep-alive client connections, each after one
//!   request, on a process warmed by as many requests on 16 connections: the resident memory
//!   each adds, and a minute (`AUTOHEDGE_BENCH_SETTLE`, seconds) after they close, how far above
//!   its idle size the process stays. Every 100th connection sends a second request once all
//!   are open, so they are shown to be open, not closed.
//! - **slow**: `AUTOHEDGE_BENCH_SLOW` (2,000) concurrent streams whose upstream writes one chunk
//!   a second (started spread over a second, as streams arrive): the peak resident memory, and
//!   the p99 of other (short) requests sent at 100 a second meanwhile, against the same
//!   requests' p99 before the streams.
//! - **gaps**: 200 concurrent streams whose upstream writes a chunk every 20 ms (started spread
//!   over 20 ms): the p99 of the time between chunks as the client reads them, directly,
//!   through the floor and through the gateway (rounds rotating the order), and what each proxy
//!   adds to the direct figure.
//!
//! Run: `cargo bench --bench connections` (about five minutes). Without `--bench` (the tests'
//! smoke run) every count is small and nothing is judged.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::{Proc, gateway, mock, peak_rss_mb, rss_now_mb, spawn_role};
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const SHORT: &str = r#"{"model":"up","messages":[{"role":"user","content":"Say hello."}]}"#;

fn smoke() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

fn env_or(name: &str, full: usize, smoke_value: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke() { smoke_value } else { full })
}

fn judged(ok: bool) -> &'static str {
    match (smoke(), ok) {
        (true, _) => "smoke run: not judged",
        (false, true) => "met",
        (false, false) => "NOT met",
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    pct(&v, 99.0)
}

/// A process measured here: its name, pid and address.
struct Target {
    name: &'static str,
    pid: u32,
    addr: SocketAddr,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--role=proxy") {
        let target = args
            .iter()
            .find_map(|a| a.strip_prefix("--target="))
            .expect("--target")
            .to_string();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(common::floor_proxy(target));
        return;
    }
    let dir = std::env::temp_dir().join(format!("autohedge-connections-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The gateway (idle keep-alive connections held for 10 minutes, not the default 10 s) and the
/// floor, both in front of `up`; ended when the returned processes are dropped.
fn targets(dir: &std::path::Path, up: SocketAddr, name: &str) -> (Vec<Proc>, Vec<Target>) {
    let (floor, floor_addr) = spawn_role("proxy", &[format!("--target={up}")]);
    let config = format!(
        "server: {{ header_timeout: 10m }}\nmodels:\n  up: {{ type: openai, base_url: \"http://{up}/v1\" }}\n"
    );
    let (gw, gw_addr) = gateway(&dir.join(name), &config, &[]);
    let targets = vec![
        Target {
            name: "floor",
            pid: floor.id(),
            addr: floor_addr,
        },
        Target {
            name: "gateway",
            pid: gw.0.id(),
            addr: gw_addr,
        },
    ];
    (vec![Proc(floor), gw], targets)
}

async fn run(dir: &std::path::Path) {
    let (_fast, fast) = mock(dir, "fast", "name: fast\n");
    println!(
        "connections bench ({}): the floor (a bare hyper proxy) and the gateway, each its own process, in front of one mock upstream",
        if smoke() {
            "smoke run: small counts, nothing judged"
        } else {
            "full run"
        }
    );
    // `AUTOHEDGE_BENCH_PART=idle|slow|gaps` runs one part alone.
    let part = std::env::var("AUTOHEDGE_BENCH_PART").unwrap_or_default();
    let runs = |name: &str| part.is_empty() || part == name;
    if runs("idle") {
        idle(dir, fast).await;
    }
    if runs("slow") {
        slow(dir).await;
    }
    if runs("gaps") {
        gaps(dir).await;
    }
}

// ---- idle keep-alive connections ----

/// One HTTP/1.1 request on `s` and its whole response read: the status.
async fn roundtrip(s: &mut TcpStream, host: SocketAddr, body: &str) -> std::io::Result<u16> {
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let body = &buf[end + 4..];
        let done = if let Some(len) = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
        {
            body.len() >= len
        } else {
            body.ends_with(b"0\r\n\r\n")
        };
        if done {
            return Ok(status);
        }
    }
}

async fn idle(dir: &std::path::Path, up: SocketAddr) {
    let n = env_or("AUTOHEDGE_BENCH_IDLE", 10_000, 200);
    let settle = env_or("AUTOHEDGE_BENCH_SETTLE", 60, 3);
    let (children, targets) = targets(dir, up, "idle");
    println!("\n## {n} idle keep-alive connections, each after one request (a short chat)");
    let mut gateway_each = f64::NAN;
    let mut gateway_back = f64::NAN;
    for t in &targets {
        // Warm: as many requests as there will be connections, on 16 keep-alive connections
        // (what serving them grows — the audit trail's page cache, metrics, the timeline — is
        // then grown before the idle size is taken); then the idle size.
        let warm: Vec<_> = (0..16)
            .map(|_| {
                let addr = t.addr;
                tokio::spawn(async move {
                    let mut s = TcpStream::connect(addr).await.unwrap();
                    for _ in 0..n.div_ceil(16) {
                        assert_eq!(roundtrip(&mut s, addr, SHORT).await.unwrap(), 200);
                    }
                })
            })
            .collect();
        for w in warm {
            w.await.unwrap();
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        let before = rss_now_mb(t.pid);
        let opened = Instant::now();
        let conns: Vec<TcpStream> = futures_util::stream::iter(0..n)
            .map(|_| async move {
                let mut s = TcpStream::connect(t.addr).await.unwrap();
                let status = roundtrip(&mut s, t.addr, SHORT).await.unwrap();
                assert_eq!(status, 200, "{}: a request on a new connection", t.name);
                s
            })
            .buffer_unordered(200)
            .collect()
            .await;
        let open_secs = opened.elapsed().as_secs_f64();
        // Idle connections as they stay: parked a second after their request, and the freed
        // buffers handed back by a quiet second later (`alloc::start_purger`).
        tokio::time::sleep(Duration::from_secs(4)).await;
        let held = rss_now_mb(t.pid);
        // Still open: a second request on every 100th.
        let mut conns = conns;
        let mut again = 0;
        for s in conns.iter_mut().step_by(100) {
            assert_eq!(
                roundtrip(s, t.addr, SHORT).await.unwrap(),
                200,
                "{}: a held connection still serves",
                t.name
            );
            again += 1;
        }
        let each_kb = (held - before) * 1024.0 / n as f64;
        drop(conns);
        tokio::time::sleep(Duration::from_secs(settle as u64)).await;
        let after = rss_now_mb(t.pid);
        let back = after / before.max(1e-9);
        println!(
            "{:8}: idle {before:.1} MiB, {n} open {held:.1} MiB ({each_kb:.1} KiB a connection; opened in {open_secs:.1} s; {again} of them served a second request), {settle} s after they closed {after:.1} MiB ({:+.0} % of idle), peak {:.1} MiB",
            t.name,
            (back - 1.0) * 100.0,
            peak_rss_mb(t.pid)
        );
        if t.name == "gateway" {
            gateway_each = each_kb;
            gateway_back = back;
        }
    }
    println!(
        "gateway: {gateway_each:.1} KiB a connection (goal ≤ 8 KB: {}); RSS {settle} s after they closed {:+.0} % of idle (goal within 20 %: {})",
        judged(gateway_each <= 8.0),
        (gateway_back - 1.0) * 100.0,
        judged(gateway_back <= 1.2)
    );
    drop(children);
}

// ---- streams ----

const STREAM: &str =
    r#"{"model":"up","messages":[{"role":"user","content":"Write."}],"stream":true}"#;

/// A mock whose streams are `words` content chunks, `every` apart.
fn slow_mock(dir: &std::path::Path, name: &str, words: usize, every_ms: u64) -> (Proc, SocketAddr) {
    let reply: Vec<String> = (0..words).map(|i| format!("w{i}")).collect();
    mock(
        dir,
        name,
        &format!(
            "name: {name}\nchunk_delay: {every_ms}ms\nreply: \"{}\"\n",
            reply.join(" ")
        ),
    )
}

/// One stream read to its end: the time between each chunk read and the one before (ms), and
/// whether it ended with `[DONE]` after a 200.
async fn read_stream(c: &reqwest::Client, url: &str, body: &str) -> (Vec<f64>, bool) {
    let resp = match c
        .post(url)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
    {
        Ok(r) => r,
        Err(_) => return (Vec::new(), false),
    };
    let ok = resp.status() == 200;
    let mut gaps = Vec::new();
    let mut last: Option<Instant> = None;
    let mut tail = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let Ok(chunk) = chunk else {
            return (gaps, false);
        };
        let now = Instant::now();
        if let Some(l) = last {
            gaps.push((now - l).as_secs_f64() * 1000.0);
        }
        last = Some(now);
        tail.extend_from_slice(&chunk);
        if tail.len() > 64 {
            tail.drain(..tail.len() - 64);
        }
    }
    let done = tail.windows(12).any(|w| w == b"data: [DONE]");
    (gaps, ok && done)
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()
        .unwrap()
}

/// Short requests at `rate` a second for `secs`, each on its own task: their latencies (ms),
/// clocked from when each was due.
async fn steady(c: &reqwest::Client, url: &str, rate: u64, secs: f64) -> Vec<f64> {
    let total = (rate as f64 * secs) as usize;
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let start = Instant::now();
    let mut handles = Vec::with_capacity(total);
    for i in 0..total {
        let due = start + period * i as u32;
        tokio::time::sleep_until(due.into()).await;
        let (c, url) = (c.clone(), url.to_string());
        handles.push(tokio::spawn(async move {
            let r = c
                .post(&url)
                .header("content-type", "application/json")
                .body(SHORT)
                .send()
                .await
                .expect("a short request");
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await;
            due.elapsed().as_secs_f64() * 1000.0
        }));
    }
    let mut lat = Vec::with_capacity(total);
    for h in handles {
        lat.push(h.await.unwrap());
    }
    lat
}

async fn slow(dir: &std::path::Path) {
    let n = env_or("AUTOHEDGE_BENCH_SLOW", 2_000, 50);
    let words = if smoke() { 4 } else { 20 };
    let (_m, up) = slow_mock(dir, "slow", words, if smoke() { 200 } else { 1_000 });
    let (children, targets) = targets(dir, up, "slow");
    println!(
        "\n## {n} concurrent slow streams ({words} chunks, one a second), short requests at 100/s beside them"
    );
    let c = client();
    let secs = if smoke() { 1.0 } else { 6.0 };
    let mut gateway_peak = f64::NAN;
    let mut gateway_added = f64::NAN;
    for t in &targets {
        let url = format!("http://{}/v1/chat/completions", t.addr);
        let alone = p99(steady(&c, &url, 100, secs).await);
        let rss0 = rss_now_mb(t.pid);
        let started = Instant::now();
        // Started spread over a second, as streams arrive: not all writing in the same instant.
        let streams: Vec<_> = (0..n)
            .map(|i| {
                let (c, url) = (c.clone(), url.clone());
                let at = started + Duration::from_secs(1) * i as u32 / n as u32;
                tokio::spawn(async move {
                    tokio::time::sleep_until(at.into()).await;
                    read_stream(&c, &url, STREAM).await.1
                })
            })
            .collect();
        // Sample the resident memory while they run.
        let pid = t.pid;
        let running = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let sampler = {
            let running = running.clone();
            tokio::spawn(async move {
                let mut peak = 0f64;
                while running.load(std::sync::atomic::Ordering::Relaxed) {
                    peak = peak.max(rss_now_mb(pid));
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                peak
            })
        };
        tokio::time::sleep(Duration::from_secs(2)).await;
        let beside = p99(steady(&c, &url, 100, secs).await);
        let mut ok = 0;
        for s in streams {
            ok += usize::from(s.await.unwrap());
        }
        running.store(false, std::sync::atomic::Ordering::Relaxed);
        let sampled = sampler.await.unwrap_or(0.0);
        // VmHWM covers what the 200 ms samples could miss; the samples, a process without it.
        let peak = sampled.max(peak_rss_mb(t.pid));
        let took = started.elapsed().as_secs_f64();
        println!(
            "{:8}: {ok} of {n} streams whole in {took:.1} s; RSS {rss0:.1} MiB before, peak {peak:.1} MiB; short requests' p99 {alone:.3} ms alone, {beside:.3} ms beside the streams ({:+.3} ms)",
            t.name,
            beside - alone
        );
        assert_eq!(ok, n, "{}: every slow stream whole", t.name);
        if t.name == "gateway" {
            gateway_peak = peak;
            gateway_added = beside - alone;
        }
    }
    println!(
        "gateway: peak RSS {gateway_peak:.1} MiB (goal ≤ 200 MiB: {}); p99 added to other requests {gateway_added:+.3} ms (goal ≤ 0.5 ms: {})",
        judged(gateway_peak <= 200.0),
        judged(gateway_added <= 0.5)
    );
    drop(children);
}

async fn gaps(dir: &std::path::Path) {
    let n = env_or("AUTOHEDGE_BENCH_GAP_STREAMS", 200, 20);
    let words = if smoke() { 10 } else { 100 };
    let rounds = if smoke() { 1 } else { 3 };
    let (_m, up) = slow_mock(dir, "gaps", words, 20);
    let (children, targets) = targets(dir, up, "gaps");
    println!(
        "\n## {n} concurrent streams, a chunk every 20 ms ({words} chunks): the time between chunks read, {rounds} rounds"
    );
    let c = client();
    let names = ["direct", "floor", "gateway"];
    let urls = [
        format!("http://{up}/v1/chat/completions"),
        format!("http://{}/v1/chat/completions", targets[0].addr),
        format!("http://{}/v1/chat/completions", targets[1].addr),
    ];
    let mut pooled: [Vec<f64>; 3] = Default::default();
    for round in 0..rounds {
        for k in 0..3 {
            let i = (k + round) % 3;
            // Started spread over one chunk's interval, as streams arrive.
            let start = Instant::now();
            let streams: Vec<_> = (0..n)
                .map(|j| {
                    let (c, url) = (c.clone(), urls[i].clone());
                    let at = start + Duration::from_millis(20) * j as u32 / n as u32;
                    tokio::spawn(async move {
                        tokio::time::sleep_until(at.into()).await;
                        read_stream(&c, &url, STREAM).await
                    })
                })
                .collect();
            for s in streams {
                let (g, whole) = s.await.unwrap();
                assert!(whole, "{}: every stream whole", names[i]);
                pooled[i].extend(g);
            }
        }
    }
    let figures: Vec<f64> = pooled.iter().map(|g| p99(g.clone())).collect();
    for i in 0..3 {
        println!(
            "{:8}: p99 gap {:.3} ms over {} gaps{}",
            names[i],
            figures[i],
            pooled[i].len(),
            if i == 0 {
                String::new()
            } else {
                format!(" (added to direct: {:+.3} ms)", figures[i] - figures[0])
            }
        );
    }
    let added = figures[2] - figures[0];
    println!(
        "gateway: p99 gap added {added:+.3} ms, the floor's {:+.3} ms (goal ≤ 0.2 ms: {})",
        figures[1] - figures[0],
        judged(added <= 0.2)
    );
    drop(children);
}
