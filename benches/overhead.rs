//! Overhead benchmark, in one run on loopback: the same load against (a) the upstream directly,
//! (b) a bare hyper pass-through proxy — the floor any Rust proxy pays on this machine — and (c)
//! the gateway (release binary, audit trail on). Reports added latency at a fixed rate,
//! throughput at saturation as a ratio to the floor, CPU per request and peak RSS, then the time
//! from a config write to the first request served in the new order.
//!
//! Run: `cargo bench --bench overhead` (about a minute). Every server is its own process
//! (this binary re-executed with `--role`), so CPU and memory are measured per process.

use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

const GATEWAY: &str = env!("CARGO_BIN_EXE_autohedge");

/// A fixed rate that the issue sets as the latency target's load.
const RATE: u64 = 500;
const RATE_SECS: u64 = 4;
/// Closed-loop concurrency for the saturation run.
const CONCURRENCY: usize = 32;
const SATURATION_SECS: u64 = 3;
const RELOAD_ROUNDS: usize = 20;

const REPLY: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, this is a benchmark reply of moderate length.","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":11,"total_tokens":23},"system_fingerprint":"fp_bench"}"#;
const REQUEST: &str = r#"{"model":"bench","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in one sentence."}],"temperature":0.2}"#;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(role) = args.iter().find_map(|a| a.strip_prefix("--role=")) {
        let tag = args
            .iter()
            .find_map(|a| a.strip_prefix("--tag="))
            .unwrap_or("u")
            .to_string();
        let target = args
            .iter()
            .find_map(|a| a.strip_prefix("--target="))
            .map(str::to_string);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            match role {
                "upstream" => upstream(tag).await,
                "proxy" => proxy(target.expect("--target")).await,
                _ => panic!("unknown role"),
            }
        });
        return;
    }
    // `cargo bench` passes `--bench`; anything else (e.g. `cargo test --benches`) is a no-op.
    if !args.iter().any(|a| a == "--bench") {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

fn listen_line(child: &mut Child, prefix: &str) -> SocketAddr {
    let out = child.stdout.take().unwrap();
    let mut lines = BufReader::new(out).lines();
    let addr = loop {
        let line = lines.next().expect("child printed its address").unwrap();
        if let Some(rest) = line.split(prefix).nth(1) {
            break rest.trim().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    addr
}

fn spawn_role(role: &str, extra: &[String]) -> (Child, SocketAddr) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .arg(format!("--role={role}"))
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr = listen_line(&mut child, "listening on ");
    (child, addr)
}

async fn upstream(tag: String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    println!("listening on {}", listener.local_addr().unwrap());
    let tag: Arc<str> = tag.into();
    loop {
        let (s, _) = listener.accept().await.unwrap();
        let _ = s.set_nodelay(true);
        let tag = tag.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let tag = tag.clone();
                async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/json")
                            .header("x-upstream", &*tag)
                            .body(Full::new(Bytes::from_static(REPLY.as_bytes())))
                            .unwrap(),
                    )
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(s), svc)
                .await;
        });
    }
}

/// The floor: accept, forward the request to the upstream with a pooled client, stream the
/// response back. No parsing, no policy.
async fn proxy(target: String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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
                    Ok::<_, Infallible>(match resp {
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

fn client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(conn)
}

async fn one(client: &HttpClient, url: &str) -> (Duration, Option<String>) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(REQUEST.as_bytes())))
        .unwrap();
    let t = Instant::now();
    let resp = client.request(req).await.expect("request");
    let served = resp
        .headers()
        .get("x-upstream")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let status = resp.status();
    let _ = resp.into_body().collect().await.expect("body");
    assert!(status.is_success(), "{url}: {status}");
    (t.elapsed(), served)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Open-loop fixed rate: requests start on schedule whatever the previous ones do.
async fn fixed_rate(url: &str) -> Vec<f64> {
    let c = client();
    // Warm the pool.
    for _ in 0..50 {
        one(&c, url).await;
    }
    let total = RATE * RATE_SECS;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut handles = Vec::with_capacity(total as usize);
    for _ in 0..total {
        tick.tick().await;
        let c = c.clone();
        let url = url.to_string();
        handles.push(tokio::spawn(async move { one(&c, &url).await.0 }));
    }
    let mut lat = Vec::with_capacity(handles.len());
    for h in handles {
        lat.push(h.await.unwrap().as_secs_f64() * 1000.0);
    }
    lat.sort_by(f64::total_cmp);
    lat
}

/// Closed loop at fixed concurrency: requests per second.
async fn saturate(url: &str) -> (f64, u64) {
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(SATURATION_SECS);
    let start = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..CONCURRENCY {
        let c = c.clone();
        let url = url.to_string();
        handles.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                one(&c, &url).await;
                n += 1;
            }
            n
        }));
    }
    let mut n = 0;
    for h in handles {
        n += h.await.unwrap();
    }
    (n as f64 / start.elapsed().as_secs_f64(), n)
}

fn proc_cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

fn peak_rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

struct Row {
    name: &'static str,
    p50: f64,
    p99: f64,
    rps: f64,
    cpu_us_per_req: f64,
    rss_mb: f64,
}

async fn measure(name: &'static str, url: &str, pid: u32) -> Row {
    let lat = fixed_rate(url).await;
    let cpu0 = proc_cpu_secs(pid);
    let (rps, n) = saturate(url).await;
    let cpu1 = proc_cpu_secs(pid);
    Row {
        name,
        p50: pct(&lat, 50.0),
        p99: pct(&lat, 99.0),
        rps,
        cpu_us_per_req: (cpu1 - cpu0) * 1e6 / n.max(1) as f64,
        rss_mb: peak_rss_mb(pid),
    }
}

fn start_gateway(dir: &std::path::Path, config: &str) -> (Child, SocketAddr) {
    let cfg = dir.join("config.yaml");
    std::fs::write(&cfg, config).unwrap();
    let mut child = Command::new(GATEWAY)
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&cfg)
        .arg("--data-dir")
        .arg(dir.join("data"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let addr = listen_line(&mut child, "listening on http://");
    (child, addr)
}

fn gateway_config(a: SocketAddr, b: SocketAddr, order: [&str; 2]) -> String {
    format!(
        "models:\n  a: {{ type: openai, base_url: \"http://{a}/v1\", model: bench }}\n  b: {{ type: openai, base_url: \"http://{b}/v1\", model: bench }}\nrouting_policy: {{ fallback_chain: [a, b] }}\nroutes:\n  bench: [{}, {}]\n",
        order[0], order[1]
    )
}

async fn run() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut up_a, a) = spawn_role("upstream", &["--tag=a".into()]);
    let (mut up_b, b) = spawn_role("upstream", &["--tag=b".into()]);
    let (mut px, p) = spawn_role("proxy", &[format!("--target={a}")]);
    let (mut gw, g) = start_gateway(tmp.path(), &gateway_config(a, b, ["a", "b"]));
    let path = "/v1/chat/completions";

    println!(
        "overhead benchmark: {RATE} req/s for {RATE_SECS}s, then {CONCURRENCY} concurrent for {SATURATION_SECS}s, each target in turn\n"
    );
    let direct = measure("direct", &format!("http://{a}{path}"), up_a.id()).await;
    let floor = measure("hyper proxy (floor)", &format!("http://{p}{path}"), px.id()).await;
    let gateway = measure(
        "autohedge (audit on)",
        &format!("http://{g}{path}"),
        gw.id(),
    )
    .await;

    println!(
        "| target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s at saturation | vs floor | CPU µs/req | peak RSS MB |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in [&direct, &floor, &gateway] {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.0} | {:.0}% | {:.0} | {:.1} |",
            r.name,
            r.p50,
            r.p99,
            r.p50 - direct.p50,
            r.p99 - direct.p99,
            r.rps,
            100.0 * r.rps / floor.rps,
            r.cpu_us_per_req,
            r.rss_mb
        );
    }

    // Reload: time from the config write to the first response from the new first endpoint.
    let c = client();
    let url = format!("http://{g}{path}");
    let mut samples = Vec::new();
    let mut order = ["a", "b"];
    for _ in 0..RELOAD_ROUNDS {
        order.swap(0, 1);
        let want = order[0];
        let tmpf = tmp.path().join("config.yaml.new");
        std::fs::write(&tmpf, gateway_config(a, b, order)).unwrap();
        let t = Instant::now();
        std::fs::rename(&tmpf, tmp.path().join("config.yaml")).unwrap();
        loop {
            let req = Request::post(&url)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from_static(REQUEST.as_bytes())))
                .unwrap();
            let resp = c.request(req).await.unwrap();
            let served = resp
                .headers()
                .get("x-autohedge-endpoint")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let _ = resp.into_body().collect().await;
            if served.as_deref() == Some(want) {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "reload never took effect"
            );
        }
        samples.push(t.elapsed().as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    samples.sort_by(f64::total_cmp);
    println!(
        "\nreload: config write -> first request in the new order, {RELOAD_ROUNDS} rounds: p50 {:.1} ms, max {:.1} ms (goal < 200 ms)",
        pct(&samples, 50.0),
        samples[samples.len() - 1]
    );

    ollama_stream(tmp.path()).await;

    for c in [&mut up_a, &mut up_b, &mut px, &mut gw] {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Words in the benchmark's streamed answer: one NDJSON object (and one SSE chunk) each.
const STREAM_WORDS: usize = 64;
const STREAM_RUNS: usize = 200;

/// Reads a streamed response: (time to the first body frame, total time, frames).
async fn read_stream(client: &HttpClient, url: &str, body: &'static str) -> (f64, f64, usize) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    let t = Instant::now();
    let resp = client.request(req).await.expect("stream request");
    assert!(resp.status().is_success());
    let mut body = resp.into_body();
    let mut first = None;
    let mut frames = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("frame");
        if frame.is_data() {
            frames += 1;
            first.get_or_insert_with(|| t.elapsed().as_secs_f64() * 1000.0);
        }
    }
    (
        first.unwrap_or(0.0),
        t.elapsed().as_secs_f64() * 1000.0,
        frames,
    )
}

/// The translation path: an Ollama NDJSON stream through the gateway (translated to OpenAI SSE)
/// against the same stream read directly from the Ollama-flavoured mock.
async fn ollama_stream(dir: &std::path::Path) {
    let words: Vec<String> = (0..STREAM_WORDS).map(|i| format!("w{i}")).collect();
    let script = dir.join("ollama.yaml");
    std::fs::write(&script, format!("reply: \"{}\"\n", words.join(" "))).unwrap();
    let mut mock = Command::new(GATEWAY)
        .args([
            "mock-upstream",
            "--listen",
            "127.0.0.1:0",
            "--flavor",
            "ollama",
            "--script",
        ])
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let o = listen_line(&mut mock, "listening on http://");
    let gdir = dir.join("ollama-gw");
    std::fs::create_dir_all(&gdir).unwrap();
    let (mut gw, g) = start_gateway(
        &gdir,
        &format!(
            "models:\n  local: {{ type: ollama, host: \"http://{o}\", model: \"qwen2.5:7b\" }}\nhealth: {{ probe_interval: 1h }}\n"
        ),
    );
    const DIRECT: &str = r#"{"model":"qwen2.5:7b","stream":true,"messages":[{"role":"user","content":"Say something long."}]}"#;
    const VIA: &str = r#"{"model":"local","stream":true,"messages":[{"role":"user","content":"Say something long."}]}"#;
    let c = client();
    let direct_url = format!("http://{o}/api/chat");
    let via_url = format!("http://{g}/v1/chat/completions");
    for _ in 0..20 {
        read_stream(&c, &direct_url, DIRECT).await;
        read_stream(&c, &via_url, VIA).await;
    }
    let (mut d_ttft, mut d_total, mut g_ttft, mut g_total) = (vec![], vec![], vec![], vec![]);
    let mut frames = (0, 0);
    for _ in 0..STREAM_RUNS {
        let (a, b, n) = read_stream(&c, &direct_url, DIRECT).await;
        d_ttft.push(a);
        d_total.push(b);
        frames.0 = n;
        let (a, b, n) = read_stream(&c, &via_url, VIA).await;
        g_ttft.push(a);
        g_total.push(b);
        frames.1 = n;
    }
    for v in [&mut d_ttft, &mut d_total, &mut g_ttft, &mut g_total] {
        v.sort_by(f64::total_cmp);
    }
    println!(
        "\nOllama stream ({STREAM_WORDS} chunks, {STREAM_RUNS} runs; direct NDJSON vs translated SSE through the gateway):"
    );
    println!("| | p50 first chunk ms | p99 first chunk ms | p50 whole stream ms | body frames |");
    println!("|---|---|---|---|---|");
    println!(
        "| direct /api/chat | {:.3} | {:.3} | {:.3} | {} |",
        pct(&d_ttft, 50.0),
        pct(&d_ttft, 99.0),
        pct(&d_total, 50.0),
        frames.0
    );
    println!(
        "| gateway /v1/chat/completions | {:.3} | {:.3} | {:.3} | {} |",
        pct(&g_ttft, 50.0),
        pct(&g_ttft, 99.0),
        pct(&g_total, 50.0),
        frames.1
    );
    println!(
        "added time to first token: p50 {:.3} ms; per-chunk overhead: {:.1} µs",
        pct(&g_ttft, 50.0) - pct(&d_ttft, 50.0),
        1000.0 * (pct(&g_total, 50.0) - pct(&d_total, 50.0)) / STREAM_WORDS as f64
    );
    for c in [&mut mock, &mut gw] {
        let _ = c.kill();
        let _ = c.wait();
    }
}
