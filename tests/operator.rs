//! The operator's surface (docs/operations.md), against the real binary: the admin guard,
//! `/metrics`, the JSON and plain logs and their non-blocking writer, webhook alerts, `report`,
//! `stats`, `check-config`, `endpoint clear`, the `/docs` page's CSP, the `mock-upstream` command,
//! and what `serve` sets for its process (THP off, the open-files limit). Loopback mock upstreams
//! and a loopback webhook receiver.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const ADMIN: &str = "adm-secret-0f0f0f0f0f0f";

/// An address of this machine that is not loopback (the default route's interface, else
/// Docker's bridge): the admin surface must refuse it.
fn non_loopback_ip() -> std::net::IpAddr {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    if s.connect("10.255.255.255:9").is_ok()
        && let Ok(a) = s.local_addr()
        && !a.ip().is_loopback()
        && !a.ip().is_unspecified()
    {
        return a.ip();
    }
    let out = std::process::Command::new("hostname")
        .arg("-I")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .filter_map(|a| a.parse::<std::net::IpAddr>().ok())
        .find(|a| a.is_ipv4() && !a.is_loopback())
        .expect("this machine has a non-loopback IPv4 address")
}

/// `/metrics` parsed: series (name with labels, as printed) → value.
async fn metrics(gw: &Gw, key: Option<&str>) -> BTreeMap<String, f64> {
    let mut req = reqwest::Client::new().get(gw.url("/metrics"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap();
    assert_eq!(r.status(), 200);
    let ct = header(&r, "content-type");
    assert!(ct.starts_with("text/plain"), "{ct}");
    let text = r.text().await.unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn get(m: &BTreeMap<String, f64>, series: &str) -> f64 {
    m.get(series).copied().unwrap_or(0.0)
}

/// `THP_enabled` of a process, from `/proc/<pid>/status` (Linux 5.0 and later).
fn thp_enabled(pid: u32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .unwrap_or_else(|| panic!("no THP_enabled line in /proc/{pid}/status"))
        .trim()
        .parse()
        .unwrap()
}

/// The soft and hard "Max open files" of a process, from `/proc/<pid>/limits`.
fn open_files(pid: &str) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_else(|| panic!("no open files line in /proc/{pid}/limits:\n{limits}"));
    let mut n = line
        .split_whitespace()
        .filter_map(|w| w.parse::<u64>().ok());
    (n.next().unwrap(), n.next().unwrap())
}

#[tokio::test]
async fn the_admin_surface_needs_the_admin_key_or_loopback() {
    let m = MockUp::openai("name: up").await;
    let ip = non_loopback_ip();
    let http = reqwest::Client::new();
    // Without an admin key: loopback only.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.yaml"), cfg(&m, "")).unwrap();
    let mut gw = Gw::start_listening(
        dir.path(),
        &dir.path().join("config.yaml"),
        &[("TEAM_A_KEY", TEAM_A)],
        "0.0.0.0:0",
    );
    let port = gw.addr.port();
    let local = format!("http://127.0.0.1:{port}/status");
    let remote = format!("http://{ip}:{port}/status");
    assert_eq!(http.get(&local).send().await.unwrap().status(), 200);
    let r = http.get(&remote).send().await.unwrap();
    assert_eq!(r.status(), 403, "from {ip}");
    // Loopback, but naming another host: a page a browser loaded from elsewhere, whose name
    // was then pointed at 127.0.0.1 (DNS rebinding). `localhost` is local.
    let r = http
        .get(&local)
        .header("host", format!("rebind.example:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "a rebound name");
    let r = http
        .get(&local)
        .header("host", format!("localhost:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "localhost");
    // Loopback, but relayed by a reverse proxy on this host (the headers Caddy, Traefik, Envoy,
    // HAProxy or an nginx with `proxy_set_header` add): not a local operator.
    for (h, v) in [
        ("x-forwarded-for", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7;proto=https"),
        ("x-forwarded-host", "gateway.example"),
        ("x-forwarded-proto", "https"),
        ("x-real-ip", "203.0.113.7"),
        ("via", "1.1 caddy"),
    ] {
        let r = http.get(&local).header(h, v).send().await.unwrap();
        let status = r.status();
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(status, 403, "{h}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("came through a proxy"),
            "{body}"
        );
    }
    // The rest of the admin surface follows the same rule from the other address: /metrics and
    // /admin/* (and the live page's data) need the admin key there.
    for path in ["/metrics"] {
        let r = http
            .get(format!("http://{ip}:{port}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{path} from {ip}");
        let r = http
            .get(format!("http://127.0.0.1:{port}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{path} from loopback");
    }
    let r = http
        .post(format!("http://{ip}:{port}/admin/endpoints/a/clear"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "/admin/* from {ip}");
    // The API itself answers the other address (with a client key): the refusal is the admin
    // rule, not the network.
    let r = http
        .post(format!("http://{ip}:{port}/v1/chat/completions"))
        .bearer_auth(TEAM_A)
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        http.get(format!("http://{ip}:{port}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200,
        "/health stays open"
    );
    gw.stop();
    // With an admin key: the key, from anywhere (loopback included).
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.yaml"),
        cfg(&m, "").replace("auth:\n", "auth:\n  admin_key: env:ADMIN_KEY\n"),
    )
    .unwrap();
    let mut gw = Gw::start_listening(
        dir.path(),
        &dir.path().join("config.yaml"),
        &[("TEAM_A_KEY", TEAM_A), ("ADMIN_KEY", ADMIN)],
        "0.0.0.0:0",
    );
    let port = gw.addr.port();
    for base in [
        format!("http://127.0.0.1:{port}"),
        format!("http://{ip}:{port}"),
    ] {
        let r = http.get(format!("{base}/status")).send().await.unwrap();
        assert_eq!(r.status(), 401, "{base}");
        let r = http
            .get(format!("{base}/status"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{base}");
        let r = http
            .get(format!("{base}/status"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{base}");
        // Through a proxy too: the key is what counts.
        let r = http
            .get(format!("{base}/status"))
            .bearer_auth(ADMIN)
            .header("x-forwarded-for", "203.0.113.7")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{base} relayed");
        // A client key is not the admin key.
        let r = http
            .get(format!("{base}/status"))
            .bearer_auth(TEAM_A)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{base}");
    }
    // State-changing admin calls want JSON: a cross-site form cannot send it.
    let clear = format!("http://{ip}:{port}/admin/endpoints/a/clear");
    let r = http
        .post(&clear)
        .bearer_auth(ADMIN)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("x=1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let r = http
        .post(&clear)
        .bearer_auth(ADMIN)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The CLI sends the key from AUTOHEDGE_ADMIN_KEY.
    let out = std::process::Command::new(BIN)
        .args([
            "endpoint",
            "clear",
            "a",
            "--url",
            &format!("http://127.0.0.1:{port}"),
        ])
        .env("AUTOHEDGE_ADMIN_KEY", ADMIN)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = std::process::Command::new(BIN)
        .args([
            "endpoint",
            "clear",
            "a",
            "--url",
            &format!("http://127.0.0.1:{port}"),
        ])
        .env_remove("AUTOHEDGE_ADMIN_KEY")
        .output()
        .unwrap();
    assert!(!out.status.success(), "refused without the key");
    gw.stop();
    assert!(!gw.log().contains(ADMIN));
}

#[tokio::test]
async fn metrics_count_requests_failovers_states_and_reloads_with_bounded_labels() {
    let a = MockUp::openai("rules:\n  - when: {every: 2, path: /v1/chat/completions}\n    status: 500\n    error: boom\n").await;
    let b = MockUp::openai("").await;
    let dead = dead_addr();
    let config = |chain: &str| {
        format!(
            "models:\n  a: {{type: openai, base_url: '{}', model: m}}\n  b: {{type: openai, base_url: '{}', model: m}}\n  dead: {{type: openai, base_url: 'http://{}/v1', model: m}}\nrouting_policy: {{fallback_chain: [a, b]}}\nroutes:\n  chat: [{chain}]\nhealth: {{probe_interval: 100ms, flip_after: 1}}\n",
            a.base(),
            b.base(),
            dead
        )
    };
    let gw = Gw::start(&config("a, b"));
    for i in 0..4 {
        let r = gw.chat("chat", &format!("hi {i}")).await;
        assert_eq!(r.status(), 200);
    }
    let s = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "s"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(s.status(), 200);
    let _ = sse_events(s).await;
    // Client-chosen model names must not create series.
    for i in 0..20 {
        let r = gw.chat(&format!("attacker-{i}"), "x").await;
        assert_eq!(r.status(), 404);
    }
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(
                &metrics(&gw, None).await,
                "autohedge_endpoint_state{endpoint=\"dead\",state=\"unhealthy\"}",
            ) == 1.0
        })
        .await,
        "the dead endpoint never showed unhealthy"
    );
    let m = metrics(&gw, None).await;
    // a answered 500 to every second chat call: those requests failed over to b.
    let a500 = get(
        &m,
        "autohedge_attempts_total{endpoint=\"a\",class=\"server_error\"}",
    );
    assert!(a500 >= 2.0, "{m:#?}");
    assert_eq!(
        get(&m, "autohedge_failovers_total{from=\"a\",to=\"b\"}"),
        a500
    );
    let served: f64 = ["a", "b"]
        .iter()
        .map(|e| {
            get(
                &m,
                &format!(
                    "autohedge_requests_total{{route=\"chat\",endpoint=\"{e}\",status=\"200\"}}"
                ),
            )
        })
        .sum();
    assert_eq!(served, 5.0);
    assert_eq!(
        get(
            &m,
            "autohedge_requests_total{route=\"other\",endpoint=\"none\",status=\"404\"}"
        ),
        20.0
    );
    assert!(m.keys().all(|k| !k.contains("attacker")), "{m:#?}");
    assert_eq!(
        get(
            &m,
            "autohedge_request_duration_seconds_count{route=\"chat\"}"
        ),
        5.0
    );
    assert_eq!(get(&m, "autohedge_ttft_seconds_count{route=\"chat\"}"), 1.0);
    assert_eq!(get(&m, "autohedge_overhead_seconds_count"), 5.0);
    assert!(
        get(
            &m,
            "autohedge_tokens_total{endpoint=\"b\",direction=\"out\"}"
        ) > 0.0
    );
    assert_eq!(
        get(
            &m,
            "autohedge_endpoint_state{endpoint=\"b\",state=\"healthy\"}"
        ),
        1.0
    );
    assert_eq!(
        get(
            &m,
            "autohedge_endpoint_state{endpoint=\"b\",state=\"unhealthy\"}"
        ),
        0.0
    );
    assert_eq!(get(&m, "autohedge_audit_dropped_total"), 0.0);
    assert!(m.contains_key("autohedge_docker_up"));
    assert!(
        m.contains_key("autohedge_upstream_ratelimit_remaining{endpoint=\"b\",kind=\"tokens\"}"),
        "{m:#?}"
    );
    // The series count is bounded by the config, not by the traffic.
    let series = m.len();
    for i in 0..20 {
        let _ = gw.chat(&format!("more-{i}"), "x").await;
    }
    assert_eq!(metrics(&gw, None).await.len(), series);

    // Reloads: a good file, then a broken one.
    std::fs::write(&gw.config_path, config("b, a")).unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(
                &metrics(&gw, None).await,
                "autohedge_config_reloads_total{result=\"ok\"}",
            ) >= 1.0
        })
        .await
    );
    std::fs::write(&gw.config_path, "models: [not, a, map]\n").unwrap();
    assert!(
        eventually(Duration::from_secs(10), || async {
            get(
                &metrics(&gw, None).await,
                "autohedge_config_reloads_total{result=\"error\"}",
            ) >= 1.0
        })
        .await
    );
    drop(dead);
}

#[tokio::test]
async fn json_access_log_one_line_per_request_carrying_its_id_and_never_a_key() {
    const UP_KEY: &str = "sk-upstream-SECRET-4f1c9a";
    const CLIENT_KEY: &str = "sk-client-SECRET-77ab02";
    // The upstream accepts only UP_KEY: a 200 shows the key reached it.
    let a = MockUp::openai(&format!(
        "keys: ['{UP_KEY}']\nrules:\n  - when: {{model: m, path: /v1/chat/completions}}\n    times: 1\n    status: 503\n    error: warming up\n"
    ))
    .await;
    let config = format!(
        "models:\n  a: {{type: openai, base_url: '{}', model: m, api_key: env:UP_KEY, retries: 1}}\nrouting_policy: {{fallback_chain: [a]}}\nroutes:\n  chat: [a]\nauth:\n  keys:\n    - {{name: team-a, key: env:CLIENT_KEY}}\n",
        a.base()
    );
    let mut gw = Gw::start_with_env(
        &config,
        &[
            ("AUTOHEDGE_LOG_FORMAT", "json"),
            ("UP_KEY", UP_KEY),
            ("CLIENT_KEY", CLIENT_KEY),
        ],
    );
    let c = reqwest::Client::new();
    let send = |id: &'static str, stream: bool| {
        c.post(gw.url("/v1/chat/completions"))
            .bearer_auth(CLIENT_KEY)
            .header("x-request-id", id)
            .json(&json!({"model": "chat", "stream": stream, "messages": [{"role": "user", "content": "hello"}]}))
            .send()
    };
    let r = send("req-one", false).await.unwrap();
    assert_eq!(r.status(), 200, "{}", gw.log());
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    let r = send("req-two", true).await.unwrap();
    assert_eq!(r.status(), 200);
    let events = sse_events(r).await;
    assert!(events.iter().any(|e| e == "[DONE]"));
    let r = send("req-three", false).await.unwrap();
    assert_eq!(r.status(), 200);
    gw.stop();
    let log = gw.log();
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let access: Vec<&Value> = lines.iter().filter(|l| l["message"] == "request").collect();
    for id in ["req-one", "req-two", "req-three"] {
        let mine: Vec<&&Value> = access.iter().filter(|l| l["request_id"] == id).collect();
        assert_eq!(mine.len(), 1, "{id}: {mine:?}");
        let l = mine[0];
        assert_eq!(l["level"], "INFO");
        assert_eq!(l["route"], "chat");
        assert_eq!(l["endpoint"], "a");
        assert_eq!(l["status"], 200);
        assert_eq!(l["client_key"], "team-a");
        assert!(l["latency_ms"].as_f64().is_some());
        assert!(
            l["tokens_in"].as_u64().is_some() && l["tokens_out"].as_u64().is_some(),
            "{l}"
        );
        assert_eq!(l["span"]["request_id"], id);
    }
    let one = access
        .iter()
        .find(|l| l["request_id"] == "req-one")
        .unwrap();
    assert_eq!(one["attempts"], 2);
    assert_eq!(one["attempt_classes"], "server_error,ok");
    let two = access
        .iter()
        .find(|l| l["request_id"] == "req-two")
        .unwrap();
    assert_eq!(two["stream"], true);
    assert!(two["ttft_ms"].as_f64().is_some(), "{two}");
    // Lines logged while req-one was served (its failed attempt) carry its id.
    let during: Vec<&Value> = lines
        .iter()
        .filter(|l| l["span"]["request_id"] == "req-one" && l["message"] != "request")
        .collect();
    assert!(
        during.iter().any(|l| l["class"] == "server_error"),
        "no line of the failed attempt carried the request id: {during:?}"
    );
    assert!(!log.contains(UP_KEY) && !log.contains(CLIENT_KEY));
}

/// `docker service logs` (a pipe, a file) gets no ANSI colour codes, and at the default level a
/// request writes one line, its access line: the attempt that failed over is in that line's
/// `attempt_classes`, its detail at debug (state changes, such as an ejection, are lines of
/// their own; none happens here).
#[tokio::test]
async fn logs_have_no_colour_off_a_terminal_and_one_line_a_request_at_info() {
    let bad = MockUp::openai("rules: [{status: 503}]").await;
    let good = MockUp::openai("name: good").await;
    let mut gw = Gw::start_with_env(
        &format!(
            "models:\n  bad: {{ type: openai, base_url: \"{}\" }}\n  good: {{ type: openai, base_url: \"{}\" }}\nroutes:\n  chat: [bad, good]\nhealth: {{ eject_after: 100 }}\n",
            bad.base(),
            good.base()
        ),
        &[("NO_COLOR", UNSET), ("RUST_LOG", "info")],
    );
    let before = gw.log().lines().count();
    for i in 0..5 {
        let r = gw
            .chat_id(
                &format!("req-{i}"),
                serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}),
            )
            .await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(bad.requests().await, 5, "each request failed over from bad");
    gw.stop();
    let log = gw.log();
    assert!(!log.contains('\u{1b}'), "ANSI codes in a log file:\n{log}");
    let lines: Vec<&str> = log
        .lines()
        .skip(before)
        .filter(|l| l.contains("req-"))
        .collect();
    assert_eq!(lines.len(), 5, "one line a request:\n{}", lines.join("\n"));
    assert!(
        lines.iter().all(|l| l.contains("server_error")),
        "the failed attempt is in the access line: {lines:?}"
    );
}

#[tokio::test]
async fn a_blocked_stderr_drops_log_lines_instead_of_stalling_requests() {
    let a = MockUp::openai("").await;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("config.yaml");
    std::fs::write(
        &cfg,
        format!(
            "models:\n  a: {{type: openai, base_url: '{}', model: m}}\nrouting_policy: {{fallback_chain: [a]}}\n",
            a.base()
        ),
    )
    .unwrap();
    // stderr is a pipe nobody reads until the end: it fills after 64 KiB.
    // Killed however the test ends.
    let mut child = KillOnDrop(
        Command::new(BIN)
            .args(["serve", "--listen", "127.0.0.1:0", "--config"])
            .arg(&cfg)
            .arg("--data-dir")
            .arg(tmp.path().join("data"))
            .env("RUST_LOG", "debug")
            .env("AUTOHEDGE_LOG_FORMAT", "json")
            // A small queue in front of the pipe, so it overflows within a bounded test.
            .env("AUTOHEDGE_LOG_BUFFER_LINES", "256")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let stdout = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let mut out = BufReader::new(stdout).lines();
    let addr: SocketAddr = loop {
        let line = out.next().expect("listening line").unwrap();
        if let Some(rest) = line.strip_prefix("autohedge listening on http://") {
            break rest.trim().parse().unwrap();
        }
    };
    std::thread::spawn(move || for _ in out {});
    let c = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let body = json!({"model": "a", "messages": [{"role": "user", "content": "x"}]});
    let served = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let work = async {
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..8 {
            let (c, url, body, served) = (c.clone(), url.clone(), body.clone(), served.clone());
            tasks.spawn(async move {
                for i in 0..250 {
                    let r = c
                        .post(&url)
                        .header("x-request-id", format!("w{w}-{i}-{}", "p".repeat(200)))
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                    served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
    };
    // Bounded: a writer that blocked on the full pipe would hang here.
    let finished = tokio::time::timeout(Duration::from_secs(120), work).await;
    assert!(
        finished.is_ok(),
        "requests stalled behind a full stderr: {} served",
        served.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(served.load(std::sync::atomic::Ordering::Relaxed), 2000);
    let m: String = c
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let dropped: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("autohedge_log_dropped_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        dropped > 0.0,
        "no line was dropped: was stderr ever full?\n{m}"
    );
    // Lines were written until the pipe filled: the log is there, just not all of it.
    let mut first = vec![0u8; 4096];
    let n = err.read(&mut first).unwrap();
    assert!(n > 0 && String::from_utf8_lossy(&first[..n]).contains("\"level\""));
}

#[tokio::test]
async fn a_closed_stdout_does_not_panic_the_cli() {
    // `autohedge check-config | head -1`: the reader goes away after one line.
    let mut child = std::process::Command::new(BIN)
        .args(["check-config", "config/example.yaml"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{:?} {err}", out.status);
}

#[tokio::test]
async fn alerts_reach_webhooks_deduplicated_filtered_and_retried() {
    // The first POST is refused with 503: delivery retries it.
    let (hook_addr, hooked) = scripted_webhook(&[("/json/TOKEN-json-9d8e", vec!["503"])]).await;
    let gone = MockUp::openai("rules:\n  - when: {path: /v1/chat/completions}\n    status: 410\n    error: this model has been deprecated\n").await;
    let ok = MockUp::openai("").await;
    let bad = MockUp::openai(
        "rules:\n  - when: {path: /v1/chat/completions}\n    status: 500\n    error: down\n",
    )
    .await;
    let json_url = format!("http://{}/json/TOKEN-json-9d8e", hook_addr);
    let slack_url = format!("http://{}/services/T000/B000/SLACKSECRET77", hook_addr);
    let config = format!(
        "models:
  gone: {{type: openai, base_url: '{}', model: m}}
  ok: {{type: openai, base_url: '{}', model: m}}
  bad: {{type: openai, base_url: '{}', model: m}}
routing_policy: {{fallback_chain: [gone, ok]}}
routes:
  chat: [gone, ok]
  broken: [bad]
auth: {{admin_key: env:ADMIN}}
alerts:
  webhooks:
    - {{ url: env:HOOK_URL, format: json }}
    - {{ url: env:SLACK_WEBHOOK_URL, format: slack }}
  events: [endpoint_retired, all_failed]
  all_failed: {{ count: 2, window: 1m }}
",
        gone.base(),
        ok.base(),
        bad.base()
    );
    let mut gw = Gw::start_with_env(
        &config,
        &[
            ("HOOK_URL", json_url.as_str()),
            ("SLACK_WEBHOOK_URL", slack_url.as_str()),
            ("ADMIN", "admin-key-1"),
        ],
    );
    // /metrics sits behind the admin key like /status.
    let r = reqwest::get(gw.url("/metrics")).await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(!metrics(&gw, Some("admin-key-1")).await.is_empty());

    let r = gw.chat("chat", "hi").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "ok");
    for _ in 0..5 {
        assert_eq!(gw.chat("broken", "hi").await.status(), 503);
    }
    let json_alerts = |event: &str| {
        hooked
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _, v)| p.starts_with("/json/") && v["event"] == event)
            .count()
    };
    let slack_has = |what: &str| {
        hooked.lock().unwrap().iter().any(|(p, _, v)| {
            p.starts_with("/services/") && v["text"].as_str().is_some_and(|t| t.contains(what))
        })
    };
    // Everything that must come, waited for (the Slack POSTs as much as the JSON ones).
    assert!(
        eventually(Duration::from_secs(30), || async {
            json_alerts("endpoint_retired") >= 2
                && json_alerts("all_failed") >= 1
                && slack_has("`endpoint_retired` on endpoint `gone`")
                && slack_has("`all_failed`")
        })
        .await,
        "alerts: {:?}",
        hooked.lock().unwrap()
    );
    // Settle: nothing more should come (a wait that can only let a duplicate show).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let got = hooked.lock().unwrap().clone();
    // The retirement: refused once (503) and delivered on the retry; all_failed once, although
    // five requests failed (dedupe); nothing for events not listed.
    assert_eq!(json_alerts("endpoint_retired"), 2, "{got:?}");
    assert_eq!(json_alerts("all_failed"), 1, "{got:?}");
    let retired = got
        .iter()
        .find(|(p, _, v)| p.starts_with("/json/") && v["event"] == "endpoint_retired")
        .unwrap();
    assert_eq!(retired.2["endpoint"], "gone");
    let detail = retired.2["detail"].as_str().unwrap();
    assert!(
        detail.contains("410") || detail.contains("deprecated"),
        "{retired:?}"
    );
    assert!(
        got.iter().all(|(_, _, v)| v["event"].is_null()
            || ["endpoint_retired", "all_failed"].contains(&v["event"].as_str().unwrap_or(""))),
        "{got:?}"
    );
    let slack: Vec<&str> = got
        .iter()
        .filter(|(p, _, _)| p.starts_with("/services/"))
        .filter_map(|(_, _, v)| v["text"].as_str())
        .collect();
    assert!(
        slack
            .iter()
            .any(|t| t.contains("`endpoint_retired` on endpoint `gone`")),
        "{slack:?}"
    );
    assert!(
        slack.iter().any(|t| t.contains("`all_failed`")),
        "{slack:?}"
    );
    gw.stop();
    // The webhook URLs are secrets: only scheme and host reach the log.
    let log = gw.log();
    assert!(log.contains("alert sent"), "{log}");
    assert!(!log.contains("SLACKSECRET77") && !log.contains("TOKEN-json-9d8e"));
}

#[tokio::test]
async fn each_event_the_gateway_raises_here_reaches_the_webhook() {
    let (hook_addr, hooked) = scripted_webhook(&[]).await;
    let keyed = MockUp::openai("keys: [k-good]\n").await;
    let flaky = MockUp::openai("").await;
    let url = format!("http://{}/json/x", hook_addr);
    let config = format!(
        "server: {{ audit_queue: 1 }}
models:
  keyed: {{type: openai, base_url: '{}', model: m, api_keys: [env:BAD_KEY, env:GOOD_KEY]}}
  flaky: {{type: openai, base_url: '{}', model: m}}
routing_policy: {{fallback_chain: [keyed, flaky]}}
health: {{probe_interval: 100ms, flip_after: 1}}
docker: {{enabled: true, interval: 200ms, timeout: 300ms}}
alerts:
  webhooks: [{{ url: env:HOOK_URL }}]
",
        keyed.base(),
        flaky.base()
    );
    let gw = Gw::start_with_env(
        &config,
        &[
            ("HOOK_URL", url.as_str()),
            ("BAD_KEY", "k-bad"),
            ("GOOD_KEY", "k-good"),
            (
                "DOCKER_HOST",
                "unix:///nonexistent/autohedge-test/docker.sock",
            ),
        ],
    );
    // A rejected key (the probe or the first request uses key #1 and gets 401).
    assert_eq!(gw.chat("keyed", "hi").await.status(), 200);
    // A burst past an audit queue of one.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let u = gw.url("/v1/chat/completions");
        tasks.spawn(async move {
            let c = reqwest::Client::new();
            for _ in 0..5 {
                let r = c
                    .post(&u)
                    .json(
                        &json!({"model": "flaky", "messages": [{"role": "user", "content": "x"}]}),
                    )
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    // The flaky endpoint's probe starts failing.
    flaky
        .set_script("rules:\n  - when: {path: /v1/models}\n    status: 503\n    error: down\n")
        .await;
    // A config file that does not parse.
    std::fs::write(&gw.config_path, "models: [broken\n").unwrap();
    let seen = |event: &str, endpoint: Option<&str>| {
        hooked
            .lock()
            .unwrap()
            .iter()
            .any(|(_, _, v)| v["event"] == event && endpoint.is_none_or(|e| v["endpoint"] == e))
    };
    let all = [
        ("endpoint_auth_failed", Some("keyed")),
        ("endpoint_unhealthy", Some("flaky")),
        ("docker_unreachable", None),
        ("config_reload_failed", None),
        ("audit_dropped", None),
    ];
    let ok = eventually(Duration::from_secs(20), || async {
        all.iter().all(|(e, ep)| seen(e, *ep))
    })
    .await;
    assert!(
        ok,
        "missing: {:?}\nreceived: {:?}",
        all.iter()
            .filter(|(e, ep)| !seen(e, *ep))
            .collect::<Vec<_>>(),
        hooked.lock().unwrap()
    );
    // The Docker engine going away is one alert, not one per endpoint.
    let docker = hooked
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, _, v)| v["event"] == "docker_unreachable")
        .count();
    assert_eq!(docker, 1);
    let m = metrics(&gw, None).await;
    assert!(get(&m, "autohedge_audit_dropped_total") > 0.0);
}

/// Alert delivery retries a 429, a connection that closes with no answer and a 5xx, 1, 2 and 4 s
/// apart (and 8 s before a fifth try), and delivers on the fourth try; a 4xx other than 429 is
/// not retried. Gaps are checked from below only (a slow machine makes them longer, never
/// shorter).
#[tokio::test]
async fn alert_delivery_retries_429_lost_connections_and_5xx_with_backoff() {
    let (hook, got) = scripted_webhook(&[
        ("/retry", vec!["429", "drop", "500"]),
        ("/refuse", vec!["400"]),
    ])
    .await;
    let gone = MockUp::openai("rules:\n  - when: {path: /v1/chat/completions}\n    status: 410\n    error: this model has been deprecated\n").await;
    let ok = MockUp::openai("").await;
    let config = format!(
        "models:
  gone: {{type: openai, base_url: '{}', model: m}}
  ok: {{type: openai, base_url: '{}', model: m}}
routing_policy: {{fallback_chain: [gone, ok]}}
alerts:
  webhooks:
    - {{ url: 'http://{hook}/retry', format: json }}
    - {{ url: 'http://{hook}/refuse', format: json }}
  events: [endpoint_retired]
",
        gone.base(),
        ok.base(),
    );
    let mut gw = Gw::start(&config);
    let r = gw.chat("gone", "hi").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "ok");
    let arrivals = |path: &str| -> Vec<std::time::Instant> {
        got.lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _)| p == path)
            .map(|(_, t, _)| *t)
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(30), || async {
            arrivals("/retry").len() >= 4
        })
        .await,
        "the retirement alert was tried four times: {:?}",
        got.lock().unwrap()
    );
    let tries = arrivals("/retry");
    let gaps: Vec<f64> = tries
        .windows(2)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    eprintln!("alert delivery gaps: {gaps:?}");
    for (gap, least) in gaps.iter().zip([1.0, 2.0, 4.0]) {
        assert!(
            *gap >= least,
            "a retry came {gap:.2} s after the last, before {least} s: {gaps:?}"
        );
    }
    // Delivered on the fourth try, as the log says; the refused message was tried once.
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.log().contains("alert sent")
        })
        .await
    );
    assert_eq!(arrivals("/retry").len(), 4);
    assert_eq!(arrivals("/refuse").len(), 1, "a 400 is not retried");
    gw.stop();
    let log = gw.log();
    assert!(
        log.contains("\"status\":429") || log.contains("status=429"),
        "{log}"
    );
    assert!(log.contains("alert webhook unreachable"), "{log}");
}

#[tokio::test]
async fn the_report_reads_the_trail_and_recommends_by_its_rules() {
    let primary = MockUp::openai(
        "keys: [k-good]\nrules:\n  - when: {every: 5, path: /v1/chat/completions}\n    status: 429\n    error: slow down\n    headers: {retry-after: '0'}\n",
    )
    .await;
    let backup = MockUp::openai("").await;
    let old = MockUp::openai("rules:\n  - when: {path: /v1/chat/completions}\n    status: 410\n    error: the model was removed\n").await;
    let config = format!(
        "models:\n  primary: {{type: openai, base_url: '{}', model: m, api_keys: [env:BAD_KEY, env:GOOD_KEY]}}\n  backup: {{type: openai, base_url: '{}', model: m}}\n  old: {{type: openai, base_url: '{}', model: m}}\nrouting_policy: {{fallback_chain: [primary, backup], slow_start: 0}}\nroutes:\n  chat: [primary, backup]\n  legacy: [old, backup]\n",
        primary.base(),
        backup.base(),
        old.base()
    );
    let mut gw = Gw::start_with_env(&config, &[("BAD_KEY", "k-bad"), ("GOOD_KEY", "k-good")]);
    for i in 0..25 {
        let r = gw.chat("chat", &format!("q{i}")).await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(gw.chat("legacy", "x").await.status(), 200);
    gw.stop();
    let data = gw.data_dir();
    let md = Command::new(BIN)
        .args(["report", "--since", "1h", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        md.status.success(),
        "{}",
        String::from_utf8_lossy(&md.stderr)
    );
    let md = String::from_utf8(md.stdout).unwrap();
    // 26 requests, all served.
    assert!(md.contains("| 26 | 26 | 0 | 0 | 0 | 100.00 % |"), "{md}");
    assert!(md.contains("`primary` answered 429 to"), "{md}");
    assert!(
        md.contains("A key of `primary` was rejected 1 time: rotate it."),
        "{md}"
    );
    assert!(md.contains("`old` was retired"), "{md}");
    assert!(md.contains("| `rate_limited` | 5 |"), "{md}");
    // Every cause lists example request ids that exist in the trail.
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let example = md
        .lines()
        .find(|l| l.starts_with("| `rate_limited`"))
        .and_then(|l| l.rsplit('|').nth(1))
        .and_then(|cell| cell.split('`').nth(1))
        .unwrap()
        .to_string();
    let found: i64 = one(
        &conn,
        &format!(
            "SELECT COUNT(*) FROM attempts WHERE request_id = '{example}' AND class = 'rate_limited'"
        ),
    );
    assert_eq!(found, 1);

    let out = gw.dir.join("report.html");
    let st = Command::new(BIN)
        .args(["report", "--since", "24h", "--format", "html", "--out"])
        .arg(&out)
        .arg("--data-dir")
        .arg(&data)
        .status()
        .unwrap();
    assert!(st.success());
    let page = std::fs::read_to_string(&out).unwrap();
    assert_eq!(page.matches("<svg").count(), 3);
    // A run of seconds in a day's report is charted over its seconds, each value a dot (a
    // bucket alone still shows), the calls on whole-number ticks.
    assert!(
        page.contains(" s, times UTC)"),
        "buckets of seconds: {page}"
    );
    assert!(page.contains("<circle"), "{page}");
    let calls = &page[page.find("<svg").unwrap()..page.find("</svg>").unwrap()];
    let ticks: Vec<&str> = calls
        .split(r##"text-anchor="end" fill="#57606a">"##)
        .skip(1)
        .map(|t| t.split('<').next().unwrap())
        .collect();
    assert!(ticks.len() >= 2, "{calls}");
    for t in &ticks {
        assert!(t.parse::<u64>().is_ok(), "a count's tick {t:?}: {ticks:?}");
    }
    assert!(!page.contains("<script"));
    assert!(page.contains("rotate it"));
    // An empty window is a report with nothing to do, not an error.
    let empty = Command::new(BIN)
        .args(["report", "--since", "1ms", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(empty.status.success());
    assert!(String::from_utf8_lossy(&empty.stdout).contains("Nothing: no rule below fired."));
    // No trail: a clear error.
    let none = Command::new(BIN)
        .args(["report", "--data-dir"])
        .arg(gw.dir.join("nowhere"))
        .output()
        .unwrap();
    assert!(!none.status.success());
    assert!(String::from_utf8_lossy(&none.stderr).contains("no audit database"));
}

/// The report's timeout and 5xx rules: an endpoint that times out on 5 % or more of its calls,
/// and one failing with 5xx on 10 % or more (20 calls at least), each get their recommendation;
/// an endpoint under both thresholds gets neither.
#[tokio::test]
async fn the_report_recommends_on_timeouts_and_5xx() {
    // Every 4th call: a 503 (25 %); every 10th: 30 s, past its `timeouts.total` of 3 s
    // (10 %). The other calls answer at once, 3 s inside the timeout however busy the machine.
    let flaky = MockUp::openai(
        "rules:\n  - when: {every: 4, path: /v1/chat/completions}\n    status: 503\n",
    )
    .await;
    let slow = MockUp::openai(
        "rules:\n  - when: {every: 10, path: /v1/chat/completions}\n    delay: 30s\n",
    )
    .await;
    let fine = MockUp::openai("").await;
    let backup = MockUp::openai("").await;
    let config = format!(
        "models:\n  flaky: {{type: openai, base_url: '{}'}}\n  slow: {{type: openai, base_url: '{}', timeouts: {{total: 3s}}}}\n  fine: {{type: openai, base_url: '{}'}}\n  backup: {{type: openai, base_url: '{}'}}\nrouting_policy: {{slow_start: 0, success_threshold: 0}}\nhealth: {{eject_after: 1000}}\nroutes:\n  a: [flaky, backup]\n  b: [slow, backup]\n  c: [fine, backup]\n",
        flaky.base(),
        slow.base(),
        fine.base(),
        backup.base()
    );
    let mut gw = Gw::start(&config);
    for i in 0..20 {
        for route in ["a", "b", "c"] {
            let r = gw.chat(route, &format!("q{i}")).await;
            assert_eq!(r.status(), 200, "{route}");
        }
    }
    assert_eq!(flaky.requests().await, 20);
    assert_eq!(slow.requests().await, 20);
    gw.stop();
    let out = Command::new(BIN)
        .args(["report", "--since", "1h", "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = String::from_utf8(out.stdout).unwrap();
    assert!(
        md.contains("`slow` timed out on 10 % of its calls (2 of 20)"),
        "{md}"
    );
    assert!(
        md.contains("`flaky` failed with 5xx or connection errors on 25 % of its calls (5 of 20)"),
        "{md}"
    );
    assert!(
        !md.contains("`fine` timed out") && !md.contains("`fine` failed"),
        "{md}"
    );
}

#[tokio::test]
async fn stats_and_check_config_commands() {
    let a = MockUp::openai("rules: [{status: 503, when: {every: 2}}]").await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&two(&a, &b, ""));
    for _ in 0..6 {
        gw.chat("chat", "x").await;
    }
    gw.stop();
    let out = std::process::Command::new(BIN)
        .args(["stats", "--since", "1h", "--json", "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let a_row = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["endpoint"] == "a")
        .unwrap();
    assert_eq!(a_row["requests"], 6);
    assert_eq!(a_row["success_rate"], 0.5);
    assert_eq!(a_row["errors"]["server_error"], 3);
    assert_eq!(a_row["fallbacks_from"], 3);
    let b_row = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["endpoint"] == "b")
        .unwrap();
    assert_eq!(b_row["fallbacks_served"], 3);
    let out = std::process::Command::new(BIN)
        .args(["stats", "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("server_error=3"), "{text}");

    // check-config: resolved chains and key sources; unset env keys named.
    let cfg = gw.dir.join("check.yaml");
    std::fs::write(
        &cfg,
        "models:\n  x: { type: openai, api_key: env:AH_SURELY_UNSET_KEY }\n  y: { type: ollama, host: \"http://127.0.0.1:11434\", model: \"qwen2.5:7b\", timeout: 3 }\nrouting_policy: { fallback_chain: [x, y], cache_ttl: 5m }\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .arg("check-config")
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("fallback_chain: x -> y"), "{text}");
    assert!(
        text.contains("AH_SURELY_UNSET_KEY") && text.contains("not set"),
        "{text}"
    );
    std::fs::write(&cfg, "models:\n  x: { type: openai, colour: blue }\n").unwrap();
    let out = std::process::Command::new(BIN)
        .arg("check-config")
        .arg(&cfg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success());
    assert!(
        text.contains("models.x") && text.contains("colour"),
        "{text}"
    );
}

#[tokio::test]
async fn stats_watch_redraws_in_place_until_interrupted() {
    let a = MockUp::openai("").await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{type: openai, base_url: '{}', model: m}}\nrouting_policy: {{fallback_chain: [a]}}\n",
        a.base()
    ));
    assert_eq!(gw.chat("a", "hi").await.status(), 200);
    gw.stop();
    let mut child = KillOnDrop(
        Command::new(BIN)
            .args(["stats", "--watch", "--data-dir"])
            .arg(gw.data_dir())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut out = child.stdout.take().unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    let reader = std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        while let Ok(n) = out.read(&mut chunk) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    // Two redraws (2 s apart), waited for however slow the machine is.
    let redrawn = eventually(Duration::from_secs(30), || async {
        String::from_utf8_lossy(&seen.lock().unwrap())
            .matches("refreshed")
            .count()
            >= 2
    })
    .await;
    signal(child.id(), "INT");
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    reader.join().unwrap();
    let text = String::from_utf8(seen.lock().unwrap().clone()).unwrap();
    assert!(redrawn, "two redraws within 30 s: {text:?}");
    assert!(text.matches("\x1b[H\x1b[2J").count() >= 2, "{text:?}");
    assert!(text.matches("refreshed").count() >= 2, "{text:?}");
    assert!(text.contains("a "), "{text}");
}

#[tokio::test]
async fn endpoint_clear_lifts_auth_failed_and_a_cooldown_in_a_running_gateway() {
    // Inference calls with this key get 401 (probes pass): auth_failed comes from traffic only.
    let a = MockUp::openai("name: a\nrules: [{when: {key: sk-revoked-0000}, status: 401}]").await;
    let c =
        MockUp::openai("rules: [{status: 429, times: 1, headers: {retry-after: \"600\"}}]").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n{}{}{}",
        ep("a", &a, ", api_key: sk-revoked-0000"),
        ep("c", &c, ""),
        ep("b", &b, "")
    ));
    let _ = gw.chat("a", "x").await;
    let _ = gw.chat("c", "x").await;
    assert_eq!((a.requests().await, c.requests().await), (1, 1));
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["state"], "auth_failed");
    assert_eq!(st["endpoints"]["c"]["state"], "cooldown");
    for name in ["a", "c"] {
        let out = std::process::Command::new(BIN)
            .args(["endpoint", "clear", name, "--url", &gw.url("")])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["state"], "healthy");
    assert_eq!(st["endpoints"]["c"]["state"], "healthy");
    a.set_script("name: a").await;
    let r = gw.chat("a", "x").await;
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "a",
        "the key is tried again"
    );
    assert_eq!(
        header(&gw.chat("c", "x").await, "x-autohedge-endpoint"),
        "c"
    );
}

#[tokio::test]
async fn endpoint_clear_through_the_database_when_no_gateway_runs() {
    let a = MockUp::openai("rules: [{status: 410, times: 1}]").await;
    let b = MockUp::openai("name: b").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!("models:\n{}{}", ep("a", &a, ""), ep("b", &b, ""));
    let mut gw = Gw::start_in(dir.path(), &cfg, &[]);
    assert_eq!(
        header(&gw.chat("a", "x").await, "x-autohedge-endpoint"),
        "b"
    );
    assert_eq!(a.requests().await, 1, "a answered 410");
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "retired");
    gw.stop();
    // No gateway runs (the URL points at a port nothing listens on): the database is changed.
    let nobody = dead_addr();
    let out = std::process::Command::new(BIN)
        .args([
            "endpoint",
            "clear",
            "a",
            "--url",
            &format!("http://{nobody}"),
            "--data-dir",
        ])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let gw = Gw::start_in(dir.path(), &cfg, &[]);
    assert_eq!(gw.status().await["endpoints"]["a"]["state"], "healthy");
    assert_eq!(
        header(&gw.chat("a", "x").await, "x-autohedge-endpoint"),
        "a"
    );
}

/// `/docs` is served with a Content-Security-Policy that allows nothing but the page itself and
/// its calls to the gateway (its data comes from `/status`, set as text).
#[tokio::test]
async fn the_live_page_is_served_with_a_self_only_content_security_policy() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!("models:\n{}", ep("a", &a, "")));
    let r = reqwest::get(gw.url("/docs")).await.unwrap();
    assert_eq!(r.status(), 200);
    let csp = header(&r, "content-security-policy");
    // Nothing by default; the page may talk only to the gateway itself; no other origin, no
    // eval, no wildcard.
    assert!(csp.contains("default-src 'none'"), "{csp}");
    assert!(csp.contains("connect-src 'self'"), "{csp}");
    assert!(
        !csp.contains("unsafe-eval") && !csp.contains('*') && !csp.contains("http"),
        "{csp}"
    );
    let page = r.text().await.unwrap();
    assert!(page.contains("/status"), "the page reads /status");
    assert!(
        !page.contains("innerHTML"),
        "values are set as text, never parsed as HTML"
    );
}

#[tokio::test]
async fn mock_upstream_binary_runs_a_script_file() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("s.yaml");
    std::fs::write(&script, "name: cli\nrules:\n  - when: { every: 2 }\n    status: 429\n    headers: { retry-after: \"7\" }\n").unwrap();
    let mut child = KillOnDrop(
        std::process::Command::new(BIN)
            .args([
                "mock-upstream",
                "--listen",
                "127.0.0.1:0",
                "--flavor",
                "openai",
                "--script",
            ])
            .arg(&script)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    use std::io::BufRead;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    let c = reqwest::Client::new();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let r1 = c
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r1.status(), 200);
    let r2 = c
        .post(format!("http://{addr}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r2.status(), 429);
    assert_eq!(header(&r2, "retry-after"), "7");
    assert_eq!(header(&r2, "x-ratelimit-remaining-requests"), "0");
    let v: Value = r2.json().await.unwrap();
    assert_eq!(v["error"]["type"], "requests");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test]
async fn mock_upstream_answers_health_in_every_flavor() {
    for flavor in [
        autohedge::demo::mock::Flavor::Openai,
        autohedge::demo::mock::Flavor::Vllm,
        autohedge::demo::mock::Flavor::Ollama,
    ] {
        let m = MockUp::start(flavor, "name: m").await;
        let r = reqwest::get(format!("http://{}/health", m.addr))
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{flavor:?}");
    }
}

/// The serving process runs without transparent huge pages (mimalloc asks for them on its
/// arenas; the kernel zeroing a 2 MiB page on first touch held the first request after start for
/// 10-32 ms and grew peak RSS by 20 MB), still serves, and an operator's own
/// `MIMALLOC_ALLOW_THP` is left to mimalloc.
#[tokio::test]
async fn transparent_huge_pages_are_off_in_the_gateway_unless_the_operator_allows_them() {
    assert!(
        std::env::var_os("MIMALLOC_ALLOW_THP").is_none(),
        "run this test without MIMALLOC_ALLOW_THP in the environment"
    );
    // A process that does not turn them off has the flag at 1: the check below can fail.
    assert_eq!(thp_enabled(std::process::id()), 1);
    let up = MockUp::openai("").await;
    let config = format!(
        "models:\n  a: {{type: openai, base_url: '{}', model: m}}\nrouting_policy: {{fallback_chain: [a]}}\n",
        up.base()
    );
    let gw = Gw::start(&config);
    assert_eq!(gw.chat("a", "hi").await.status(), 200);
    assert_eq!(thp_enabled(gw.pid()), 0, "the gateway keeps huge pages on");

    let allowed = Gw::start_with_env(&config, &[("MIMALLOC_ALLOW_THP", "1")]);
    assert_eq!(allowed.chat("a", "hi").await.status(), 200);
    assert_eq!(
        thp_enabled(allowed.pid()),
        1,
        "the operator's MIMALLOC_ALLOW_THP was overridden"
    );
}

/// Started with a soft limit of 256 open files (as services often are, at 1,024) under a higher
/// hard limit, the gateway raises the soft one to the hard one: some 100 requests in flight would
/// otherwise exhaust it, and its upstream connects would fail with `EMFILE`. Under a low hard
/// limit it says so at start.
#[tokio::test]
async fn the_gateway_raises_its_open_files_limit_to_the_hard_one() {
    // The shell really starts a program with the soft limit lowered (else the check below could
    // not fail), and the hard limit leaves room above it.
    let out = Command::new("sh")
        .args(["-c", "ulimit -Sn 256 && exec cat /proc/self/limits"])
        .output()
        .unwrap();
    let shown = String::from_utf8(out.stdout).unwrap();
    let line = shown
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    assert!(line.contains(" 256 "), "{line}");
    let (_, hard) = open_files("self");
    assert!(
        hard > 256,
        "this machine's hard limit is {hard}: nothing to raise"
    );

    let up = MockUp::openai("").await;
    let config = format!(
        "models:\n  a: {{type: openai, base_url: '{}', model: m}}\nrouting_policy: {{fallback_chain: [a]}}\n",
        up.base()
    );
    let gw = Gw::start_after_shell(&config, "ulimit -Sn 256");
    assert_eq!(gw.chat("a", "hi").await.status(), 200);
    assert_eq!(up.requests().await, 1);
    assert_eq!(
        open_files(&gw.pid().to_string()),
        (hard, hard),
        "the soft limit is the hard one"
    );
    let log = gw.log();
    assert!(log.contains("open files limit raised"), "{log}");
    assert!(!log.contains("few open files allowed"), "{log}");

    // A hard limit of 512: nothing to raise, and a warning.
    let low = Gw::start_after_shell(&config, "ulimit -n 512");
    assert_eq!(low.chat("a", "hi").await.status(), 200);
    assert_eq!(open_files(&low.pid().to_string()), (512, 512));
    let log = low.log();
    assert!(log.contains("few open files allowed"), "{log}");
}
