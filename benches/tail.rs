//! Beating the tail, on loopback, in one run, side by side.
//!
//! 1. Hedging. Two mock upstreams whose latency is heavy-tailed (97 % at 20–40 ms, 2 % at
//!    300 ms, 1 % at 1–2 s, drawn per request). The same open-loop load goes to (a) a gateway
//!    without hedging and (b) one hedging at p95 with a 5 % budget, in interleaved rounds; the
//!    floor is the upstream itself, called directly. Printed: p50, p99, p99.9 and the extra
//!    upstream requests (the mocks' own counts against the requests sent).
//!    Goal: p99.9 cut by at least 10x for at most 5 % extra upstream requests.
//! 2. Routing before the 429. A mock with a real token bucket (100 requests/s, answering 429 with
//!    OpenAI's body and headers when empty) first in a chain, an unlimited one second, 200
//!    requests/s offered: 429s the gateway spent a call on (its own audit trail) with
//!    `predict_rate_limits` off and on. Goal: under 1 % of requests.
//!
//! `cargo bench --bench tail` (about 6 minutes). Latencies are clocked from each request's
//! scheduled send time (coordinated omission).

mod common;

use common::{gateway, mock};
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

const REQUEST: &str =
    r#"{"model":"bench","messages":[{"role":"user","content":"hello"}],"max_tokens":8}"#;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// 1 % at 1–2 s, then 2 % (of all) at 300 ms, the rest at 20–40 ms.
const HEAVY_TAIL: &str = r#"name: tail
rules:
  - { when: { chance: 0.01 }, delay: 1s, delay_max: 2s }
  - { when: { chance: 0.0202 }, delay: 300ms }
  - { delay: 20ms, delay_max: 40ms }
"#;

/// 1,000 requests/s for 4 rounds of 25 s: 100,000 samples a target, so its p99.9 rests on the
/// 100 slowest beyond it (printed beside it).
fn rate() -> u64 {
    if smoke() { 200 } else { 1000 }
}
fn round_secs() -> f64 {
    if smoke() { 1.0 } else { 25.0 }
}
fn rounds() -> usize {
    if smoke() { 1 } else { 4 }
}

/// Run without `--bench` (`cargo test --benches`, as CI does): each part for a moment, with its
/// checks (every request answered and counted, one audit row each), its figures judged by no one.
fn smoke() -> bool {
    !std::env::args().any(|a| a == "--bench")
}

fn judged(ok: bool) -> &'static str {
    match (smoke(), ok) {
        (true, _) => "smoke run: not judged",
        (false, true) => "met",
        (false, false) => "NOT met",
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = std::env::temp_dir().join(format!("autohedge-tail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        hedging(&dir).await;
        predictive(&dir).await;
        let _ = std::fs::remove_dir_all(&dir);
    });
}

fn client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(conn)
}

async fn one(c: &HttpClient, url: &str) -> u16 {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(REQUEST.as_bytes())))
        .unwrap();
    match c.request(req).await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let _ = resp.into_body().collect().await;
            status
        }
        Err(_) => 0,
    }
}

/// Open loop at `rate` for `secs`: (latency from the scheduled send in ms, status) per request.
async fn fixed_rate(c: &HttpClient, url: &str, rate: u64, secs: f64) -> Vec<(f64, u16)> {
    let total = (rate as f64 * secs) as u64;
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let rt = tokio::runtime::Handle::current();
    let (c, url) = (c.clone(), url.to_string());
    let pacer = std::thread::spawn(move || {
        let start = Instant::now() + Duration::from_millis(5);
        let mut handles = Vec::with_capacity(total as usize);
        for i in 0..total {
            let scheduled = start + period * i as u32;
            let now = Instant::now();
            if scheduled > now {
                std::thread::sleep(scheduled - now);
            }
            let (c, url) = (c.clone(), url.clone());
            handles.push(rt.spawn(async move {
                let status = one(&c, &url).await;
                (scheduled.elapsed().as_secs_f64() * 1000.0, status)
            }));
        }
        handles
    });
    let handles = tokio::task::spawn_blocking(move || pacer.join().unwrap())
        .await
        .unwrap();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// The nearest-rank percentile's rank (1-based). The small margin keeps a product that should
/// be whole (99.9 % of 100,000) from rounding up past it in floating point.
fn rank(n: usize, p: f64) -> usize {
    ((p / 100.0) * n as f64 - 1e-9).ceil() as usize
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[rank(sorted.len(), p).clamp(1, sorted.len()) - 1]
}

/// How many samples lie beyond the `p`th percentile of `n` (what it rests on).
fn beyond(n: usize, p: f64) -> usize {
    n - rank(n, p).min(n)
}

async fn mock_requests(c: &HttpClient, m: SocketAddr) -> u64 {
    let req = Request::get(format!("http://{m}/__mock/stats"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    v["requests"].as_u64().unwrap_or(0)
}

struct Target {
    name: &'static str,
    url: String,
    mocks: Vec<SocketAddr>,
    lat: Vec<f64>,
    sent: u64,
    upstream: u64,
    errors: u64,
}

async fn hedging(dir: &std::path::Path) {
    println!(
        "== Hedging: heavy-tailed upstreams, {} requests/s, {} interleaved rounds of {} s ==",
        rate(),
        rounds(),
        round_secs()
    );
    // Each target gets its own pair of upstreams, so one's tail never queues behind another's.
    let mut procs = Vec::new();
    let mut pair = |tag: &str| {
        let (p1, a) = mock(dir, &format!("{tag}-1"), HEAVY_TAIL);
        let (p2, b) = mock(dir, &format!("{tag}-2"), HEAVY_TAIL);
        procs.push(p1);
        procs.push(p2);
        (a, b)
    };
    let (d1, _) = pair("direct");
    let (n1, n2) = pair("plain");
    let (h1, h2) = pair("hedged");
    let cfg = |a: SocketAddr, b: SocketAddr, hedge: &str| {
        format!(
            "models:\n  u1: {{ type: openai, base_url: \"http://{a}/v1\" }}\n  u2: {{ type: openai, base_url: \"http://{b}/v1\" }}\nroutes:\n  bench:\n    chain: [u1, u2]\n{hedge}health: {{ probe_interval: 5s }}\n"
        )
    };
    let (g1, plain) = gateway(&dir.join("plain"), &cfg(n1, n2, ""), &[]);
    let (g2, hedged) = gateway(
        &dir.join("hedged"),
        &cfg(
            h1,
            h2,
            "    hedge: { after: p95, max_extra: 5%, min_after: 50ms }\n",
        ),
        &[],
    );
    let c = client();
    let mut targets = vec![
        Target {
            name: "upstream direct (floor)",
            url: format!("http://{d1}/v1/chat/completions"),
            mocks: vec![d1],
            lat: vec![],
            sent: 0,
            upstream: 0,
            errors: 0,
        },
        Target {
            name: "gateway, no hedging",
            url: format!("http://{plain}/v1/chat/completions"),
            mocks: vec![n1, n2],
            lat: vec![],
            sent: 0,
            upstream: 0,
            errors: 0,
        },
        Target {
            name: "gateway, hedge at p95, 5% budget",
            url: format!("http://{hedged}/v1/chat/completions"),
            mocks: vec![h1, h2],
            lat: vec![],
            sent: 0,
            upstream: 0,
            errors: 0,
        },
    ];
    // Warm-up: connections, and enough samples for the p95 the hedge waits for.
    for t in &targets {
        let _ = fixed_rate(&c, &t.url, 200, 1.5).await;
    }
    // The order rotates from round to round, so a noisy moment of the machine falls on each.
    let n = targets.len();
    for round in 0..rounds() {
        for k in 0..n {
            let t = &mut targets[(k + round) % n];
            let mut before = 0;
            for m in &t.mocks {
                before += mock_requests(&c, *m).await;
            }
            let out = fixed_rate(&c, &t.url, rate(), round_secs()).await;
            let mut after = 0;
            for m in &t.mocks {
                after += mock_requests(&c, *m).await;
            }
            t.sent += out.len() as u64;
            t.upstream += after - before;
            t.errors += out.iter().filter(|(_, s)| *s != 200).count() as u64;
            t.lat.extend(out.into_iter().map(|(l, _)| l));
        }
    }
    println!(
        "{:<34} {:>8} {:>9} {:>9} {:>10} {:>12} {:>16} {:>7}",
        "target",
        "samples",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "beyond p99.9",
        "extra upstream",
        "errors"
    );
    let mut p999 = Vec::new();
    let mut extra = Vec::new();
    for t in targets.iter_mut() {
        t.lat.sort_by(f64::total_cmp);
        let x = (t.upstream as f64 - t.sent as f64) / t.sent as f64 * 100.0;
        println!(
            "{:<34} {:>8} {:>9.1} {:>9.1} {:>10.1} {:>12} {:>15.2}% {:>7}",
            t.name,
            t.lat.len(),
            pct(&t.lat, 50.0),
            pct(&t.lat, 99.0),
            pct(&t.lat, 99.9),
            beyond(t.lat.len(), 99.9),
            x,
            t.errors
        );
        p999.push(pct(&t.lat, 99.9));
        extra.push(x);
    }
    for t in &targets {
        assert!(
            t.sent > 0 && t.upstream >= t.sent,
            "{}: every request reached an upstream",
            t.name
        );
    }
    let cut = p999[1] / p999[2];
    let ok = cut >= 10.0 && extra[2] <= 5.0;
    println!(
        "p99.9 cut {cut:.1}x for {:.2}% extra upstream requests (goal: >= 10x for <= 5%): {}",
        extra[2],
        judged(ok)
    );
    let status = status_json(&c, hedged).await;
    println!("hedged gateway /status hedging: {}", status["hedging"]);
    drop((g1, g2, procs));
}

async fn status_json(c: &HttpClient, g: SocketAddr) -> serde_json::Value {
    let req = Request::get(format!("http://{g}/status"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap_or_default()
}

async fn predictive(dir: &std::path::Path) {
    const OFFERED: u64 = 200;
    let secs = if smoke() { 1.5 } else { 10.0 };
    println!(
        "\n== Routing before the 429: a 100 requests/s token bucket first, an unlimited upstream second, {OFFERED} requests/s for {secs} s =="
    );
    println!(
        "{:<28} {:>9} {:>14} {:>12} {:>16} {:>9} {:>8}",
        "gateway", "requests", "429s spent", "share", "calls to limited", "p99 ms", "errors"
    );
    let mut shares = Vec::new();
    for predict in [false, true] {
        let tag = if predict { "predict" } else { "react" };
        let (lp, limited) = mock(
            dir,
            &format!("{tag}-limited"),
            "name: limited\nrate_limit: { requests: 100, per: 1s }\n",
        );
        let (fp, free) = mock(dir, &format!("{tag}-free"), "name: free\n");
        let cfg = format!(
            "models:\n  limited: {{ type: openai, base_url: \"http://{limited}/v1\" }}\n  free: {{ type: openai, base_url: \"http://{free}/v1\" }}\nroutes:\n  bench: [limited, free]\nrouting_policy: {{ predict_rate_limits: {predict}, slow_start: 0 }}\nhealth: {{ probe_interval: 1h }}\n"
        );
        let (mut g, addr) = gateway(&dir.join(tag), &cfg, &[]);
        let c = client();
        let url = format!("http://{addr}/v1/chat/completions");
        // Let the bucket fill again after the probe.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let out = fixed_rate(&c, &url, OFFERED, secs).await;
        let limited_served = mock_requests(&c, limited).await;
        let mut lat: Vec<f64> = out.iter().map(|(l, _)| *l).collect();
        lat.sort_by(f64::total_cmp);
        let errors = out.iter().filter(|(_, s)| *s != 200).count();
        // Stop the gateway so the audit trail is complete, then read it.
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(g.0.id().to_string())
            .status();
        let _ = g.0.wait();
        let db = dir.join(tag).join("data").join("autohedge.db");
        let conn = rusqlite::Connection::open(db).unwrap();
        let spent: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM attempts WHERE class = 'rate_limited'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        let predicted: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM attempts WHERE class = 'skipped_ratelimit_predicted'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        // The share is read from the trail: it must hold every request sent.
        let rows: i64 = conn
            .query_row("SELECT COUNT(*) FROM requests", [], |r| r.get(0))
            .unwrap();
        assert_eq!(rows as usize, out.len(), "one audit row a request");
        let share = spent as f64 / out.len() as f64 * 100.0;
        shares.push(share);
        println!(
            "{:<28} {:>9} {:>14} {:>11.2}% {:>16} {:>9.1} {:>8}",
            if predict {
                "predict_rate_limits: true"
            } else {
                "predict_rate_limits: false"
            },
            out.len(),
            spent,
            share,
            limited_served,
            pct(&lat, 99.0),
            errors
        );
        if predict {
            println!("  (skipped as skipped_ratelimit_predicted: {predicted})");
        }
        drop((g, lp, fp));
    }
    println!(
        "429s spent with prediction: {:.2}% of requests (without: {:.2}%; goal < 1%): {}",
        shares[1],
        shares[0],
        judged(shares[1] < 1.0)
    );
}
