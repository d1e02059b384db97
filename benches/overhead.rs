//! Overhead benchmark, in one run on loopback: the same load against (a) the upstream directly,
//! (b) a bare hyper pass-through proxy — the floor any Rust proxy pays on this machine — and (c)
//! the gateway (release binary, audit trail on), interleaved in rounds so that the machine's noise
//! falls on all three alike. Reports, with the floor's own figure beside every ratio: latency at
//! 500 and 5,000 requests/s clocked from each request's scheduled send time (pooled: at least
//! 10,000 samples per p99), throughput and CPU per request at saturation (median over rounds),
//! peak RSS, the cold first request of a fresh process, the time from a config write to the
//! first request served in the new order, and an Ollama stream through the translator. Asserts
//! that both endpoints stayed probed healthy and that the audit trail holds one row per request
//! served.
//!
//! Run: `cargo bench --bench overhead` (about three minutes). Every server is its own process
//! (this binary re-executed with `--role`), so CPU and memory are measured per process.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};

use common::{gateway_bin, peak_rss_mb, rss_now_mb, spawn_role};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};

const RATES: [u64; 2] = [500, 5_000];
/// Seconds of each fixed-rate segment per round, so that every pooled p99 has at least 10,000
/// samples: 500/s × 4 s × 5 rounds = 10,000; 5,000/s × 1 s × 5 rounds = 25,000.
fn rate_secs() -> [f64; 2] {
    if smoke() { [0.3, 0.2] } else { [4.0, 1.0] }
}
/// Rounds: targets are measured in turn within each round (rotating which goes first), so a
/// noisy moment of the machine hits all of them; figures are pooled or the median over rounds.
fn rounds() -> usize {
    if smoke() { 1 } else { 5 }
}
/// Unmeasured warm-up before each target's segment in every round (pools, caches, CPU clocks).
fn warmup() -> Duration {
    Duration::from_millis(if smoke() { 100 } else { 500 })
}
/// Closed-loop connections for the saturation run.
const CONCURRENCY: usize = 16;
fn saturation_secs() -> f64 {
    if smoke() { 0.3 } else { 2.0 }
}
fn reload_count() -> usize {
    if smoke() { 2 } else { 20 }
}

/// Run without `--bench` (`cargo test --benches`, as CI does): every part for a moment, its
/// checks (probed healthy, one audit row a request served, the reload's order) kept, its
/// figures printed and judged by no one.
static SMOKE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn smoke() -> bool {
    SMOKE.load(Ordering::Relaxed)
}

const REPLY: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1700000000,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there, this is a benchmark reply of moderate length.","refusal":null},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":11,"total_tokens":23},"system_fingerprint":"fp_bench"}"#;
const MODELS: &str = r#"{"object":"list","data":[{"id":"bench","object":"model","created":1700000000,"owned_by":"bench"}]}"#;
const REQUEST: &str = r#"{"model":"bench","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hello in one sentence."}],"temperature":0.2}"#;

/// Content chunks of the streamed answer (issue #47: streams of hundreds of chunks).
const STREAM_CHUNKS: usize = 300;

/// The streamed answer: a role chunk, [`STREAM_CHUNKS`] content chunks, the finish, the usage and
/// `[DONE]`, each an event of its own as OpenAI sends them.
static STREAM_EVENTS: std::sync::LazyLock<Vec<Bytes>> = std::sync::LazyLock::new(|| {
    let head = r#"{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,"model":"bench","system_fingerprint":"fp_bench","choices":[{"index":0,"#;
    let mut v = vec![Bytes::from(format!(
        "data: {head}\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
    ))];
    for i in 0..STREAM_CHUNKS {
        v.push(Bytes::from(format!(
            "data: {head}\"delta\":{{\"content\":\" word{i}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
        )));
    }
    v.push(Bytes::from(format!(
        "data: {head}\"delta\":{{}},\"logprobs\":null,\"finish_reason\":\"stop\"}}]}}\n\n"
    )));
    v.push(Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"bench\",\"choices\":[],\"usage\":{{\"prompt_tokens\":12,\"completion_tokens\":{STREAM_CHUNKS},\"total_tokens\":{}}}}}\n\n",
        12 + STREAM_CHUNKS
    )));
    v.push(Bytes::from_static(b"data: [DONE]\n\n"));
    v
});

const STREAM_REQUEST: &str = r#"{"model":"bench","messages":[{"role":"user","content":"Write at length."}],"stream":true,"stream_options":{"include_usage":true}}"#;

/// The same stream asked of an upstream that writes it all at once.
const STREAM_REQUEST_BURST: &str = r#"{"model":"bench","messages":[{"role":"user","content":"Write at length."}],"stream":true,"stream_options":{"include_usage":true},"user":"burst"}"#;

/// [`STREAM_EVENTS`] in one buffer.
static STREAM_BURST: std::sync::LazyLock<Bytes> = std::sync::LazyLock::new(|| {
    STREAM_EVENTS
        .iter()
        .flat_map(|b| b.iter().copied())
        .collect()
});

/// A 1.2 KB prompt: with `context_window: 1000` its bytes exceed the window, so the gateway
/// counts it (o200k) on every request — what a self-hosted model's small window makes of every
/// prompt over it. The floor forwards the same body.
static COUNTED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let text = "The gateway counts every prompt before it routes, so that no request is sent to an endpoint whose context window cannot hold it; a self-hosted model's window is small, and a prompt of a few kilobytes is counted on every request. ".repeat(6);
    serde_json::json!({
        "model": "bench",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": &text[..1_150]},
        ],
        "temperature": 0.2,
    })
    .to_string()
});

/// Successful responses the gateway sent (it alone sets `x-autohedge-endpoint`): the audit trail
/// must hold exactly this many rows when the gateway has shut down.
static GATEWAY_SERVED: AtomicU64 = AtomicU64::new(0);
/// The main gateway's address (`host:port`): only its answers are counted in `GATEWAY_SERVED`.
static MAIN_GATEWAY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
/// The client key every request presents: the gateways with `auth.keys` admit it (the others
/// ignore the header).
const CLIENT_KEY: &str = "bench-client-key-0123456789";

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
                "proxy" => common::floor_proxy(target.expect("--target")).await,
                "collector" => collector().await,
                _ => panic!("unknown role"),
            }
        });
        return;
    }
    // `cargo bench` passes `--bench`; anything else (`cargo test --benches`) is a smoke run.
    SMOKE.store(!args.iter().any(|a| a == "--bench"), Ordering::Relaxed);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

/// An OTLP/HTTP collector that takes every export (200, an empty `ExportTraceServiceResponse`)
/// and counts the bytes: the traced gateway's receiver, never its limit.
async fn collector() {
    let listener = autohedge::front::server::bind("127.0.0.1:0").await.unwrap();
    println!("listening on {}", listener.local_addr().unwrap());
    loop {
        let (s, _) = listener.accept().await.unwrap();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                let _ = req.into_body().collect().await;
                Ok::<_, Infallible>(
                    Response::builder()
                        .header("content-type", "application/x-protobuf")
                        .body(Full::new(Bytes::new()).boxed())
                        .unwrap(),
                )
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                .await;
        });
    }
}

async fn upstream(tag: String) {
    let listener = autohedge::front::server::bind("127.0.0.1:0").await.unwrap();
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
                    // A real `/v1/models` list, so the gateway's probe sees a healthy endpoint.
                    let body = if req.uri().path().ends_with("/models") {
                        MODELS
                    } else {
                        REPLY
                    };
                    let asked = req
                        .into_body()
                        .collect()
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    // A stream asked as a burst (`"user":"burst"`): every event in one write,
                    // so the upstream is never what limits the rate.
                    if asked.windows(14).any(|w| w == b"\"user\":\"burst\"") {
                        return Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .header("x-upstream", &*tag)
                                .body(Full::new(STREAM_BURST.clone()).boxed())
                                .unwrap(),
                        );
                    }
                    // A stream: the chunks one frame each, as a server writes them.
                    if asked.windows(13).any(|w| w == b"\"stream\":true") {
                        let frames = STREAM_EVENTS
                            .iter()
                            .cloned()
                            .map(|b| Ok::<_, Infallible>(hyper::body::Frame::data(b)));
                        let body =
                            http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                        return Ok::<_, Infallible>(
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .header("x-upstream", &*tag)
                                .body(body.boxed())
                                .unwrap(),
                        );
                    }
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/json")
                            .header("x-upstream", &*tag)
                            .body(Full::new(Bytes::from_static(body.as_bytes())).boxed())
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

fn client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(conn)
}

async fn one(client: &HttpClient, url: &str) -> Option<String> {
    one_with(client, url, REQUEST).await
}

/// A chat request of `body` as the bench's client key.
fn post(url: &str, body: &'static str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {CLIENT_KEY}"))
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

async fn one_with(client: &HttpClient, url: &str, body: &'static str) -> Option<String> {
    let req = post(url, body);
    let resp = client.request(req).await.expect("request");
    let served = resp
        .headers()
        .get("x-upstream")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let via_gateway = resp.headers().contains_key("x-autohedge-endpoint");
    let status = resp.status();
    let _ = resp.into_body().collect().await.expect("body");
    assert!(status.is_success(), "{url}: {status}");
    if via_gateway && MAIN_GATEWAY.get().is_some_and(|g| url.contains(g.as_str())) {
        GATEWAY_SERVED.fetch_add(1, Ordering::Relaxed);
    }
    served
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    pct(&v, 50.0)
}

/// Open loop at a fixed rate. Each request's latency is clocked from the moment it was
/// *scheduled* to be sent, not from when its task got to run: a generator (or a target) that
/// falls behind shows up as latency instead of silently sending fewer requests (coordinated
/// omission, Gil Tene). The pacing runs on its own OS thread with `thread::sleep` (tens of
/// microseconds late at worst) rather than tokio's timer, whose 1 ms granularity would itself
/// add up to a millisecond to every figure.
async fn fixed_rate(c: &HttpClient, url: &str, rate: u64, secs: f64) -> Vec<f64> {
    fixed_rate_with(c, url, rate, secs, REQUEST).await
}

async fn fixed_rate_with(
    c: &HttpClient,
    url: &str,
    rate: u64,
    secs: f64,
    body: &'static str,
) -> Vec<f64> {
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
                one_with(&c, &url, body).await;
                scheduled.elapsed().as_secs_f64() * 1000.0
            }));
        }
        handles
    });
    let handles = tokio::task::spawn_blocking(move || pacer.join().unwrap())
        .await
        .unwrap();
    let mut lat = Vec::with_capacity(handles.len());
    for h in handles {
        lat.push(h.await.unwrap());
    }
    lat
}

/// Closed loop at fixed concurrency for `secs`: requests completed.
async fn saturate_with(c: &HttpClient, url: &str, secs: f64, body: &'static str) -> (u64, f64) {
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut handles = Vec::new();
    for _ in 0..CONCURRENCY {
        let c = c.clone();
        let url = url.to_string();
        handles.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                one_with(&c, &url, body).await;
                n += 1;
            }
            n
        }));
    }
    let mut n = 0;
    for h in handles {
        n += h.await.unwrap();
    }
    (n, start.elapsed().as_secs_f64())
}

/// One target of the comparison, with everything measured of it over the rounds.
struct Target {
    name: &'static str,
    url: String,
    pid: u32,
    /// The request body it is sent.
    body: &'static str,
    /// Latencies per fixed rate, pooled over rounds.
    lat: [Vec<f64>; 2],
    /// Each round's p99 per fixed rate (its median is robust to one bad round).
    round_p99: [Vec<f64>; 2],
    /// Requests per second at saturation, one figure per round.
    rps: Vec<f64>,
    /// CPU µs per request at saturation, one figure per round.
    cpu_us: Vec<f64>,
    /// Peak RSS (MiB) after its first warm-up: for a counting gateway, the first counted
    /// requests and the encoder's build, under 16 connections.
    warm_peak: Option<f64>,
}

impl Target {
    fn new(name: &'static str, url: String, pid: u32) -> Self {
        Target {
            name,
            url,
            pid,
            body: REQUEST,
            lat: [Vec::new(), Vec::new()],
            round_p99: [Vec::new(), Vec::new()],
            rps: Vec::new(),
            cpu_us: Vec::new(),
            warm_peak: None,
        }
    }

    /// The same sent `body`.
    fn with_body(mut self, body: &'static str) -> Self {
        self.body = body;
        self
    }

    /// One round: warm up, the fixed rates, then saturation with the process's CPU time.
    async fn round(&mut self, c: &HttpClient) {
        saturate_with(c, &self.url, warmup().as_secs_f64(), self.body).await;
        self.warm_peak.get_or_insert_with(|| peak_rss_mb(self.pid));
        for (i, rate) in RATES.into_iter().enumerate() {
            let mut l = fixed_rate_with(c, &self.url, rate, rate_secs()[i], self.body).await;
            l.sort_by(f64::total_cmp);
            self.round_p99[i].push(pct(&l, 99.0));
            self.lat[i].append(&mut l);
        }
        let cpu0 = common::cpu_secs(self.pid);
        let (n, secs) = saturate_with(c, &self.url, saturation_secs(), self.body).await;
        let cpu1 = common::cpu_secs(self.pid);
        self.rps.push(n as f64 / secs);
        self.cpu_us.push((cpu1 - cpu0) * 1e6 / n.max(1) as f64);
    }

    fn sorted(&mut self) {
        for l in &mut self.lat {
            l.sort_by(f64::total_cmp);
        }
    }
}

/// The counted prompt's three targets (issue #47): the upstream directly and the floor sent the
/// 1.2 KB prompt, and a gateway (started here, in `dir/counted`) whose endpoints'
/// `context_window: 1000` make it count that prompt on every request.
fn counted_targets(
    dir: &std::path::Path,
    (a, up_a): (SocketAddr, u32),
    b: SocketAddr,
    (p, px): (SocketAddr, u32),
    path: &str,
) -> (Child, [Target; 3]) {
    let counted_dir = dir.join("counted");
    std::fs::create_dir_all(&counted_dir).unwrap();
    let (gw, gc) = start_gateway(
        &counted_dir,
        &gateway_config_with(a, b, ["a", "b"], ", context_window: 1000"),
    );
    let counted: &'static str = COUNTED.as_str();
    let targets = [
        Target::new("direct, 1.2 KB", format!("http://{a}{path}"), up_a).with_body(counted),
        Target::new("floor, 1.2 KB", format!("http://{p}{path}"), px).with_body(counted),
        Target::new(
            "autohedge, 1.2 KB counted",
            format!("http://{gc}{path}"),
            gw.id(),
        )
        .with_body(counted),
    ];
    (gw, targets)
}

fn start_gateway(dir: &std::path::Path, config: &str) -> (Child, SocketAddr) {
    let cfg = dir.join("config.yaml");
    std::fs::write(&cfg, config).unwrap();
    // The log goes to a directory of its own: the config watcher follows the config's
    // directory, and a log file written beside it would wake the watcher on every write (as it
    // would in a deployment that logged next to its config).
    let logs = dir.join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let mut child = Command::new(gateway_bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&cfg)
        .arg("--data-dir")
        .arg(dir.join("data"))
        // As deployed: the default level (info, one access line a request) in JSON, metrics
        // recorded, the log written to a file the way a container runtime takes it.
        .env("RUST_LOG", "info")
        .env("AUTOHEDGE_LOG_FORMAT", "json")
        .stdout(Stdio::piped())
        .stderr(
            std::fs::File::create(logs.join("gateway.log"))
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
        )
        .spawn()
        .unwrap();
    let addr = common::listen_line(&mut child);
    (child, addr)
}

/// Two OpenAI-type endpoints whose model is an OpenAI-family name, with a `context_window` as
/// the embedded default config has: the gateway counts every prompt with tiktoken's o200k
/// encoder, as it does in front of OpenAI. The bench measures the default, not a gateway that
/// skips that work.
fn gateway_config(a: SocketAddr, b: SocketAddr, order: [&str; 2]) -> String {
    gateway_config_with(a, b, order, ", context_window: 128000")
}

/// The same with `extra` fields on both endpoints (`context_window: 128000` makes the gateway
/// count every prompt with the endpoint's tokenizer, as the embedded default config does).
fn gateway_config_with(a: SocketAddr, b: SocketAddr, order: [&str; 2], extra: &str) -> String {
    format!(
        "models:\n  a: {{ type: openai, base_url: \"http://{a}/v1\", model: gpt-4o-mini{extra} }}\n  b: {{ type: openai, base_url: \"http://{b}/v1\", model: gpt-4o-mini{extra} }}\nrouting_policy: {{ fallback_chain: [a, b] }}\nroutes:\n  bench: [{}, {}]\nhealth: {{ probe_interval: 1s }}\n",
        order[0], order[1]
    )
}

/// A freshly started target: time from its `listening` line to the first answer, and the p99 of
/// a 2 s run at 500/s started at once.
async fn cold(name: &str, start: impl FnOnce() -> (Child, SocketAddr)) -> (f64, f64) {
    let t = Instant::now();
    let (mut child, addr) = start();
    let ready = t.elapsed();
    let c = client();
    let url = format!("http://{addr}/v1/chat/completions");
    let t = Instant::now();
    one(&c, &url).await;
    let first = t.elapsed().as_secs_f64() * 1000.0;
    let mut l = fixed_rate(&c, &url, 500, 2.0).await;
    l.sort_by(f64::total_cmp);
    let _ = child.kill();
    let _ = child.wait();
    println!(
        "cold {name}: started in {:.0} ms; first request {first:.2} ms; p99 of the first 2 s at 500/s {:.2} ms",
        ready.as_secs_f64() * 1000.0,
        pct(&l, 99.0)
    );
    (first, pct(&l, 99.0))
}

async fn run() {
    let rounds = rounds();
    let tmp = tempfile::tempdir().unwrap();
    let (mut up_a, a) = spawn_role("upstream", &["--tag=a".into()]);
    let (mut up_b, b) = spawn_role("upstream", &["--tag=b".into()]);
    let path = "/v1/chat/completions";
    println!(
        "overhead benchmark on loopback, every target its own process; {rounds} interleaved rounds of: {}ms warm-up, {} req/s for {}s, {} req/s for {}s (latency from the scheduled send time), {CONCURRENCY} connections unthrottled for {}s",
        warmup().as_millis(),
        RATES[0],
        rate_secs()[0],
        RATES[1],
        rate_secs()[1],
        saturation_secs()
    );
    println!("gateway binary: {}", gateway_bin().display());
    // `AUTOHEDGE_BENCH_PART=streams`: only the streams' part (for profiling it).
    if std::env::var("AUTOHEDGE_BENCH_PART").as_deref() == Ok("streams") {
        let (mut px, p) = spawn_role("proxy", &[format!("--target={a}")]);
        let (mut gw, g) = start_gateway(tmp.path(), &gateway_config(a, b, ["a", "b"]));
        streams_report(
            &client(),
            (&format!("http://{p}{path}"), px.id()),
            (&format!("http://{g}{path}"), gw.id()),
        )
        .await;
        for c in [&mut up_a, &mut up_b, &mut px, &mut gw] {
            let _ = c.kill();
            let _ = c.wait();
        }
        return;
    }

    // `AUTOHEDGE_BENCH_PART=counted`: only the counted prompt's rounds (direct, floor, gateway).
    if std::env::var("AUTOHEDGE_BENCH_PART").as_deref() == Ok("counted") {
        let (mut px, p) = spawn_role("proxy", &[format!("--target={a}")]);
        let (mut gw, targets) = counted_targets(tmp.path(), (a, up_a.id()), b, (p, px.id()), path);
        let mut targets = Vec::from(targets);
        let c = client();
        for round in 0..rounds {
            for i in 0..targets.len() {
                let n = targets.len();
                targets[(round + i) % n].round(&c).await;
            }
            eprintln!("round {}/{rounds} done", round + 1);
        }
        for t in &mut targets {
            t.sorted();
        }
        counted_report(&targets);
        for c in [&mut up_a, &mut up_b, &mut px, &mut gw] {
            let _ = c.kill();
            let _ = c.wait();
        }
        return;
    }

    // Cold start first, each on a fresh process (the gateway with a fresh data directory).
    println!();
    let cold_floor = cold("hyper proxy (floor)", || {
        spawn_role("proxy", &[format!("--target={a}")])
    })
    .await;
    let cold_dir = tmp.path().join("cold");
    std::fs::create_dir_all(&cold_dir).unwrap();
    let cold_gw = cold("autohedge (counting prompts: context_window set)", || {
        start_gateway(
            &cold_dir,
            &gateway_config_with(a, b, ["a", "b"], ", context_window: 128000"),
        )
    })
    .await;

    GATEWAY_SERVED.store(0, Ordering::Relaxed);
    let (mut px, p) = spawn_role("proxy", &[format!("--target={a}")]);
    let (mut gw, g) = start_gateway(tmp.path(), &gateway_config(a, b, ["a", "b"]));
    let _ = MAIN_GATEWAY.set(g.to_string());
    let mut targets = vec![
        Target::new("direct", format!("http://{a}{path}"), up_a.id()),
        Target::new("hyper proxy (floor)", format!("http://{p}{path}"), px.id()),
        Target::new("autohedge (audit on)", format!("http://{g}{path}"), gw.id()),
    ];
    // `cluster:` (issue #33): the same gateway with a client key whose limits live in this
    // process, and with them shared through a local Redis (one admission script a request).
    let clustered = cluster_targets(tmp.path(), a, b, path);
    let mut extra_children = Vec::new();
    let with_cluster = clustered.is_some();
    if let Some((ts, children)) = clustered {
        targets.extend(ts);
        extra_children = children;
    }
    // The counted prompt (issue #47): a gateway whose endpoints' `context_window: 1000` makes it
    // count the 1.2 KB prompt on every request, beside the direct call and the floor sent the
    // same body.
    let (mut gw_counted, counted) =
        counted_targets(tmp.path(), (a, up_a.id()), b, (p, px.id()), path);
    let counted_from = targets.len();
    targets.extend(counted);
    // Traced (issue #51): the same gateway exporting every request's spans (sample 1.0) to a
    // collector of the bench's own; its figures beside the untraced gateway's.
    let (mut col, col_addr) = spawn_role("collector", &[]);
    let traced_dir = tmp.path().join("traced");
    std::fs::create_dir_all(&traced_dir).unwrap();
    let (mut gw_traced, gt) = start_gateway(
        &traced_dir,
        &format!(
            "{}telemetry:\n  otlp: {{ endpoint: \"http://{col_addr}/v1/traces\", sample_ratio: 1.0, max_queue_spans: 100000 }}\n",
            gateway_config(a, b, ["a", "b"])
        ),
    );
    let traced_at = targets.len();
    targets.push(Target::new(
        "autohedge, traced (sample 1.0)",
        format!("http://{gt}{path}"),
        gw_traced.id(),
    ));
    let c = client();
    let n = targets.len();
    for round in 0..rounds {
        for i in 0..n {
            let t = &mut targets[(round + i) % n];
            t.round(&c).await;
        }
        eprintln!("round {}/{rounds} done", round + 1);
    }
    for t in &mut targets {
        t.sorted();
    }
    let (direct, floor, gateway) = (&targets[0], &targets[1], &targets[2]);

    println!(
        "\nLatency (ms; pooled over {rounds} rounds; added = minus the direct figure of the same rounds):"
    );
    println!(
        "| rate | target | samples | p50 | p99 | added p50 | added p99 | median of round p99s | added |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (i, rate) in RATES.into_iter().enumerate() {
        for t in [direct, floor, gateway] {
            let rp99 = median(t.round_p99[i].clone());
            println!(
                "| {rate}/s | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {rp99:.3} | {:.3} |",
                t.name,
                t.lat[i].len(),
                pct(&t.lat[i], 50.0),
                pct(&t.lat[i], 99.0),
                pct(&t.lat[i], 50.0) - pct(&direct.lat[i], 50.0),
                pct(&t.lat[i], 99.0) - pct(&direct.lat[i], 99.0),
                rp99 - median(direct.round_p99[i].clone()),
            );
        }
    }
    let floor_rps = median(floor.rps.clone());
    let floor_cpu = median(floor.cpu_us.clone());
    println!(
        "\nSaturation ({CONCURRENCY} connections; median over {rounds} rounds; the floor's own figures beside every ratio):"
    );
    println!(
        "| target | req/s | floor req/s | vs floor | CPU µs/req | floor CPU µs/req | CPU vs floor | peak RSS MB |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for t in [direct, floor, gateway] {
        let rps = median(t.rps.clone());
        let cpu = median(t.cpu_us.clone());
        println!(
            "| {} | {rps:.0} | {floor_rps:.0} | {:.0}% | {cpu:.1} | {floor_cpu:.1} | {:.2}x | {:.1} |",
            t.name,
            100.0 * rps / floor_rps,
            cpu / floor_cpu,
            peak_rss_mb(t.pid)
        );
    }
    // Each round measured the floor and the gateway minutes apart at most: the ratio within a
    // round is a paired figure, and its spread over rounds shows how far the machine moved.
    let paired = |g: &[f64], f: &[f64]| -> (f64, f64, f64) {
        let r: Vec<f64> = g.iter().zip(f).map(|(g, f)| g / f).collect();
        let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (median(r), lo, hi)
    };
    let (rm, rlo, rhi) = paired(&gateway.rps, &floor.rps);
    let (cm, clo, chi) = paired(&gateway.cpu_us, &floor.cpu_us);
    println!(
        "Gateway vs floor within each round: throughput median {:.0}% (rounds {:.0}-{:.0}%), CPU a request median {cm:.2}x (rounds {clo:.2}-{chi:.2}x); floor req/s by round: {}",
        rm * 100.0,
        rlo * 100.0,
        rhi * 100.0,
        floor
            .rps
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "\nCold start: first request floor {:.2} ms, gateway {:.2} ms; p99 of the first 2 s at 500/s floor {:.2} ms, gateway {:.2} ms",
        cold_floor.0, cold_gw.0, cold_floor.1, cold_gw.1
    );
    let ratio = median(gateway.rps.clone()) / floor_rps;
    let cpu_ratio = median(gateway.cpu_us.clone()) / floor_cpu;
    let added500 = pct(&gateway.lat[0], 99.0) - pct(&direct.lat[0], 99.0);
    let added5k = pct(&gateway.lat[1], 99.0) - pct(&direct.lat[1], 99.0);
    println!(
        "Goals (issue #32's decision; instructions are counted by benches/instructions.sh): throughput >= 70% of the floor: {:.0}% {}; CPU/req {cpu_ratio:.2}x the floor's (no goal); p99 added <= 0.5 ms at 500/s: {added500:.3} ms {}; <= 1 ms at 5000/s: {added5k:.3} ms {}; peak RSS <= 50 MiB: {:.1} {}",
        ratio * 100.0,
        verdict(ratio >= 0.70),
        verdict(added500 <= 0.5),
        verdict(added5k <= 1.0),
        peak_rss_mb(gateway.pid),
        verdict(peak_rss_mb(gateway.pid) <= 50.0),
    );

    // Both endpoints must have been healthy all along (a probe that failed would make this a
    // benchmark of a degraded gateway).
    let status = status_json(&c, g).await;
    for ep in ["a", "b"] {
        assert_eq!(
            status["endpoints"][ep]["probe"]["ok"],
            serde_json::json!(true),
            "endpoint {ep} is not probed healthy: {}",
            status["endpoints"][ep]
        );
    }

    if with_cluster {
        cluster_report(&targets);
    }
    traced_report(&targets[2], &targets[traced_at], &targets[0]);
    let traced_status = status_json(&c, gt).await;
    let otlp = &traced_status["telemetry"]["otlp"];
    println!(
        "Traced gateway: spans exported {}, dropped {}, failed exports {}",
        otlp["spans_exported"], otlp["spans_dropped"], otlp["failed_exports"]
    );
    assert!(
        otlp["spans_exported"].as_u64().unwrap_or(0) > 0,
        "the traced gateway exported spans: {otlp}"
    );
    for ch in [&mut gw_traced, &mut col] {
        let _ = ch.kill();
        let _ = ch.wait();
    }
    counted_report(&targets[counted_from..counted_from + 3]);
    // Every request of the counted gateway was counted (its audit rows say how many tokens).
    let _ = Command::new("kill")
        .args(["-TERM", &gw_counted.id().to_string()])
        .status();
    let _ = gw_counted.wait();
    let db =
        rusqlite::Connection::open(tmp.path().join("counted").join("data").join("autohedge.db"))
            .unwrap();
    let (rows, counted_rows): (i64, i64) = db
        .query_row(
            "SELECT COUNT(*), COUNT(prompt_tokens_counted) FROM requests",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert!(rows > 0, "the counted gateway served");
    assert_eq!(counted_rows, rows, "every 1.2 KB prompt was counted");
    for mut ch in extra_children {
        let _ = ch.kill();
        let _ = ch.wait();
    }

    streams_report(
        &c,
        (&format!("http://{p}{path}"), px.id()),
        (&format!("http://{g}{path}"), gw.id()),
    )
    .await;

    reload_rounds(&c, tmp.path(), g, a, b).await;

    // Every request the gateway served has its audit row: stop it cleanly (SIGTERM drains the
    // audit queue) and count.
    let served = GATEWAY_SERVED.load(Ordering::Relaxed);
    let _ = Command::new("kill")
        .args(["-TERM", &gw.id().to_string()])
        .status();
    let _ = gw.wait();
    let db = rusqlite::Connection::open(tmp.path().join("data").join("autohedge.db")).unwrap();
    let rows: i64 = db
        .query_row("SELECT COUNT(*) FROM requests", [], |r| r.get(0))
        .unwrap();
    let rows = rows as u64;
    println!("\naudit trail: {rows} rows for {served} requests served");
    assert_eq!(rows, served, "every served request has its audit row");

    ollama_stream(tmp.path()).await;

    for c in [&mut up_a, &mut up_b, &mut px] {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The two `cluster:` targets, or `None` (said) without `redis-server` on this machine.
fn cluster_targets(
    dir: &std::path::Path,
    a: SocketAddr,
    b: SocketAddr,
    path: &str,
) -> Option<(Vec<Target>, Vec<Child>)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let redis = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let Ok(redis) = redis else {
        println!("(no redis-server on this machine: the cluster: targets are left out)");
        return None;
    };
    // Until it answers.
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let keys = format!(
        "auth:\n  keys:\n    - {{ name: bench, key: \"{CLIENT_KEY}\", rpm: 100000000, tpm: 100000000000 }}\n"
    );
    let base = gateway_config(a, b, ["a", "b"]);
    let local_dir = dir.join("keyed");
    let shared_dir = dir.join("clustered");
    std::fs::create_dir_all(&local_dir).unwrap();
    std::fs::create_dir_all(&shared_dir).unwrap();
    let (local, l) = start_gateway(&local_dir, &format!("{base}{keys}"));
    let (shared, s) = start_gateway(
        &shared_dir,
        &format!(
            "{base}{keys}cluster: {{ redis: \"redis://127.0.0.1:{port}/0\", key_prefix: \"bench:\" }}\n"
        ),
    );
    let targets = vec![
        Target::new(
            "autohedge, client key (limits in process)",
            format!("http://{l}{path}"),
            local.id(),
        ),
        Target::new(
            "autohedge, client key, cluster: (Redis)",
            format!("http://{s}{path}"),
            shared.id(),
        ),
    ];
    Some((targets, vec![local, shared, redis]))
}

/// `cluster:` against the same gateway with its limits in process, beside the floor.
fn cluster_report(targets: &[Target]) {
    let (direct, floor, local, shared) = (&targets[0], &targets[1], &targets[3], &targets[4]);
    println!(
        "\ncluster: (issue #33) — a client key's limits in process against shared through Redis:"
    );
    println!("| target | p99 500/s | p99 added 500/s | req/s | vs floor |");
    println!("|---|---|---|---|---|");
    let floor_rps = median(floor.rps.clone());
    for t in [floor, local, shared] {
        let rps = median(t.rps.clone());
        println!(
            "| {} | {:.3} | {:.3} | {rps:.0} | {:.0}% |",
            t.name,
            pct(&t.lat[0], 99.0),
            pct(&t.lat[0], 99.0) - pct(&direct.lat[0], 99.0),
            100.0 * rps / floor_rps
        );
    }
    let added = pct(&shared.lat[0], 99.0) - pct(&local.lat[0], 99.0);
    let ratio = median(shared.rps.clone()) / median(local.rps.clone());
    println!(
        "Goals: p99 added by cluster: <= 0.3 ms at 500/s: {added:.3} ms {}; throughput >= 0.9x the gateway without it: {:.2}x {}",
        verdict(added <= 0.3),
        ratio,
        verdict(ratio >= 0.9)
    );
}

/// One whole stream of [`STREAM_REQUEST`]: its time and bytes; checked to hold every content
/// chunk and `[DONE]`.
async fn one_stream(client: &HttpClient, url: &str, body: &'static str) -> (f64, usize) {
    let req = post(url, body);
    let t = Instant::now();
    let resp = client.request(req).await.expect("stream request");
    assert!(resp.status().is_success(), "{url}: {}", resp.status());
    // The main gateway's streams have their audit rows too.
    if resp.headers().contains_key("x-autohedge-endpoint")
        && MAIN_GATEWAY.get().is_some_and(|g| url.contains(g.as_str()))
    {
        GATEWAY_SERVED.fetch_add(1, Ordering::Relaxed);
    }
    let body = resp.into_body().collect().await.expect("stream").to_bytes();
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let text = std::str::from_utf8(&body).unwrap_or("");
    assert!(
        text.contains(&format!("word{}\"", STREAM_CHUNKS - 1))
            && text.ends_with("data: [DONE]\n\n"),
        "{url}: a stream cut short ({} bytes)",
        body.len()
    );
    (ms, body.len())
}

/// Streams of [`STREAM_CHUNKS`] chunks, [`CONCURRENCY`] at a time for `secs`: streams/s, MB/s,
/// per-stream times, and the process's CPU µs a stream.
async fn stream_saturate(
    c: &HttpClient,
    url: &str,
    pid: u32,
    secs: f64,
    body: &'static str,
) -> (f64, f64, Vec<f64>, f64) {
    let cpu0 = common::cpu_secs(pid);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut handles = Vec::new();
    for _ in 0..CONCURRENCY {
        let (c, url) = (c.clone(), url.to_string());
        handles.push(tokio::spawn(async move {
            let (mut times, mut bytes) = (Vec::new(), 0usize);
            while Instant::now() < deadline {
                let (ms, n) = one_stream(&c, &url, body).await;
                times.push(ms);
                bytes += n;
            }
            (times, bytes)
        }));
    }
    let (mut times, mut bytes) = (Vec::new(), 0usize);
    for h in handles {
        let (t, b) = h.await.unwrap();
        times.extend(t);
        bytes += b;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = common::cpu_secs(pid) - cpu0;
    let n = times.len().max(1) as f64;
    (
        n / elapsed,
        bytes as f64 / elapsed / 1e6,
        times,
        cpu * 1e6 / n,
    )
}

type StreamFigures = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// Streams of 300 chunks through the floor and the gateway, interleaved in rounds: from an
/// upstream that writes each event apart (as a model server does), and from one that writes the
/// whole stream at once (the gateway's own cost an event, the upstream never the limit).
async fn streams_report(c: &HttpClient, floor: (&str, u32), gateway: (&str, u32)) {
    for (how, body) in [
        ("each event written apart", STREAM_REQUEST),
        ("the whole stream written at once", STREAM_REQUEST_BURST),
    ] {
        // `AUTOHEDGE_BENCH_STREAMS=burst` (or `apart`): one of the two (for profiling it).
        match std::env::var("AUTOHEDGE_BENCH_STREAMS").as_deref() {
            Ok("burst") if body == STREAM_REQUEST => continue,
            Ok("apart") if body == STREAM_REQUEST_BURST => continue,
            _ => {}
        }
        streams_part(c, floor, gateway, how, body).await;
    }
}

async fn streams_part(
    c: &HttpClient,
    floor: (&str, u32),
    gateway: (&str, u32),
    how: &str,
    body: &'static str,
) {
    let (rounds, secs) = if smoke() { (1, 0.3) } else { (3, 2.0) };
    // Per target: streams/s and MB/s by round, every stream's time, CPU µs a stream by round.
    let mut figures: [StreamFigures; 2] = Default::default();
    for round in 0..rounds {
        for i in 0..2 {
            let k = (round + i) % 2;
            let (url, pid) = if k == 0 { floor } else { gateway };
            stream_saturate(c, url, pid, warmup().as_secs_f64(), body).await;
            let (sps, mbs, mut times, cpu) = stream_saturate(c, url, pid, secs, body).await;
            figures[k].0.push(sps);
            figures[k].1.push(mbs);
            figures[k].2.append(&mut times);
            figures[k].3.push(cpu);
        }
    }
    for f in &mut figures {
        f.2.sort_by(f64::total_cmp);
    }
    let events = (STREAM_CHUNKS + 4) as f64;
    println!(
        "\nStreams of {STREAM_CHUNKS} content chunks ({} KB each), the upstream's {how}, {CONCURRENCY} connections, median over {rounds} rounds:",
        STREAM_EVENTS.iter().map(Bytes::len).sum::<usize>() / 1000
    );
    println!("| target | streams/s | MB/s | p50 ms | p99 ms | CPU µs a stream | CPU µs an event |");
    println!("|---|---|---|---|---|---|---|");
    for (name, f) in ["hyper proxy (floor)", "autohedge"].iter().zip(&figures) {
        let cpu = median(f.3.clone());
        println!(
            "| {name} | {:.0} | {:.0} | {:.2} | {:.2} | {cpu:.0} | {:.2} |",
            median(f.0.clone()),
            median(f.1.clone()),
            pct(&f.2, 50.0),
            pct(&f.2, 99.0),
            cpu / events
        );
    }
    let ratio = median(figures[1].0.clone()) / median(figures[0].0.clone());
    println!(
        "Goal (issue #47): streams/s >= 0.5x the floor's ({how}): {ratio:.2}x {}",
        verdict(ratio >= 0.5)
    );
}

/// The gateway with tracing on (every request's spans exported) beside the same gateway without.
fn traced_report(plain: &Target, traced: &Target, direct: &Target) {
    let (rps, rps_t) = (median(plain.rps.clone()), median(traced.rps.clone()));
    let (cpu, cpu_t) = (median(plain.cpu_us.clone()), median(traced.cpu_us.clone()));
    let added = |t: &Target, i: usize| pct(&t.lat[i], 99.0) - pct(&direct.lat[i], 99.0);
    println!(
        "\nTracing (telemetry.otlp, sample 1.0, a loopback collector): saturation {rps_t:.0} req/s against {rps:.0} untraced ({:.2}x); CPU µs/req {cpu_t:.1} against {cpu:.1} ({:.2}x); p99 added at 500/s {:.3} ms against {:.3}; at 5000/s {:.3} ms against {:.3}; peak RSS {:.1} MiB against {:.1}",
        rps_t / rps,
        cpu_t / cpu,
        added(traced, 0),
        added(plain, 0),
        added(traced, 1),
        added(plain, 1),
        peak_rss_mb(traced.pid),
        peak_rss_mb(plain.pid),
    );
}

/// The counted prompt against the floor sent the same body: direct, floor, gateway.
fn counted_report(t: &[Target]) {
    let (direct, floor, gw) = (&t[0], &t[1], &t[2]);
    let floor_rps = median(floor.rps.clone());
    let rps = median(gw.rps.clone());
    let added500 = pct(&gw.lat[0], 99.0) - pct(&direct.lat[0], 99.0);
    let floor_added500 = pct(&floor.lat[0], 99.0) - pct(&direct.lat[0], 99.0);
    let (rss, peak) = (rss_now_mb(gw.pid), peak_rss_mb(gw.pid));
    let built = gw.warm_peak.unwrap_or(peak);
    println!(
        "\nA counted 1.2 KB prompt (context_window: 1000, o200k on every request): saturation {rps:.0} req/s against the floor's {floor_rps:.0} ({:.2}x; CPU µs/req {:.1} against {:.1}); p99 added at 500/s {added500:.3} ms (the floor's {floor_added500:.3}); RSS after the rounds {rss:.1} MiB; peak {built:.1} MiB after the first warm-up (the encoder built under 16 connections), {peak:.1} MiB over the whole run (floor {:.1})",
        rps / floor_rps,
        median(gw.cpu_us.clone()),
        median(floor.cpu_us.clone()),
        peak_rss_mb(floor.pid)
    );
    println!(
        "Goals (issue #47): >= 0.6x the floor: {:.2}x {}; p99 added at 500/s <= 0.5 ms: {added500:.3} ms {}; RSS <= 50 MiB with the encoder loaded: {rss:.1} {} (peak while it was built: {built:.1} {}; over the whole run, 5,000/s included: {peak:.1} {})",
        rps / floor_rps,
        verdict(rps / floor_rps >= 0.6),
        verdict(added500 <= 0.5),
        verdict(rss <= 50.0),
        verdict(built <= 50.0),
        verdict(peak <= 50.0),
    );
}

fn verdict(ok: bool) -> &'static str {
    if smoke() {
        return "(smoke run: not judged)";
    }
    if ok { "(met)" } else { "(NOT met)" }
}

async fn status_json(c: &HttpClient, g: SocketAddr) -> serde_json::Value {
    let req = Request::get(format!("http://{g}/status"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&body).unwrap()
}

/// Reload: time from the config write to the first response from the new first endpoint.
async fn reload_rounds(
    c: &HttpClient,
    dir: &std::path::Path,
    g: SocketAddr,
    a: SocketAddr,
    b: SocketAddr,
) {
    let url = format!("http://{g}/v1/chat/completions");
    let mut samples = Vec::new();
    let mut order = ["a", "b"];
    for _ in 0..reload_count() {
        order.swap(0, 1);
        let want = order[0];
        let tmpf = dir.join("config.yaml.new");
        std::fs::write(&tmpf, gateway_config(a, b, order)).unwrap();
        let t = Instant::now();
        std::fs::rename(&tmpf, dir.join("config.yaml")).unwrap();
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
            if served.is_some() {
                GATEWAY_SERVED.fetch_add(1, Ordering::Relaxed);
            }
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
        "\nreload: config write -> first request in the new order, {} rounds: p50 {:.1} ms, max {:.1} ms (goal < 200 ms)",
        reload_count(),
        pct(&samples, 50.0),
        samples[samples.len() - 1]
    );
}

/// Words in the benchmark's streamed answer: one NDJSON object (and one SSE chunk) each.
const STREAM_WORDS: usize = 64;
const STREAM_RUNS: usize = 200;

/// Reads a streamed response: (time to the first body frame, total time, frames).
async fn read_stream(client: &HttpClient, url: &str, body: &'static str) -> (f64, f64, usize) {
    let req = post(url, body);
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
    let mut mock = Command::new(gateway_bin())
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
    let o = common::listen_line(&mut mock);
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
