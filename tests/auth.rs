//! Who may use it, against the real binary: client keys (their models, `rpm` from many
//! connections at once, `tpm`, a budget that survives a restart), the admin surface from loopback
//! and from another address, and keys that never leak. Vault's part is in `vault.rs`.

mod common;

use common::*;
use serde_json::{Value, json};

const TEAM_A: &str = "sk-team-a-0123456789abcdef";
const TEAM_B: &str = "sk-team-b-fedcba9876543210";
const ADMIN: &str = "adm-secret-0f0f0f0f0f0f";

fn cfg(m: &MockUp, extra_keys: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", api_key: sk-upstream-9999, cost: {{ input_per_mtok: 1000000, output_per_mtok: 1000000 }} }}
  b: {{ type: openai, base_url: "{}" }}
routes:
  chat: [a, b]
auth:
  keys:
    - {{ name: team-a, key: env:TEAM_A_KEY, models: [chat] }}
    - {{ name: team-b, key: "sha256:{}" }}
{extra_keys}"#,
        m.base(),
        m.base(),
        hex_sha256(TEAM_B)
    )
}

fn hex_sha256(s: &str) -> String {
    autohedge::config::key_digest(s)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

async fn call(gw: &Gw, key: Option<&str>, model: &str, extra: Value) -> reqwest::Response {
    let mut body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    if let (Some(o), Value::Object(e)) = (body.as_object_mut(), extra) {
        o.extend(e);
    }
    let mut req = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&body);
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap()
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    (status, body)
}

#[tokio::test]
async fn client_keys_decide_who_may_call_and_which_models() {
    let m = MockUp::openai("name: up").await;
    let mut gw = Gw::start_with_env(&cfg(&m, ""), &[("TEAM_A_KEY", TEAM_A)]);
    // Served with a key: the upstream got its own configured key, never the client's.
    let r = call(&gw, Some(TEAM_A), "chat", json!({})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(m.stats().await["key_tails"], json!(["9999"]));
    // `x-api-key` works as well, with a key given only as its digest.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-api-key", TEAM_B)
        .json(&json!({"model": "b", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(m.requests().await, 2);
    // `b` has no key of its own: the client's `x-api-key` (nor any Authorization) did not go
    // on in its place.
    let names = m.stats().await["last_header_names"].clone();
    assert!(
        names.as_array().is_some_and(|a| !a.is_empty()),
        "the mock saw the headers: {names}"
    );
    for h in ["x-api-key", "authorization"] {
        assert!(
            !names.as_array().unwrap().contains(&json!(h)),
            "{h} reached the keyless endpoint: {names}"
        );
    }
    assert_eq!(m.stats().await["key_tails"], json!(["9999"]));
    // No key, a wrong key: 401 in OpenAI's shape, and nothing reached the upstream.
    for key in [None, Some("sk-nope"), Some(&TEAM_A[..TEAM_A.len() - 1])] {
        let (status, body) = error_of(call(&gw, key, "chat", json!({})).await).await;
        assert_eq!(status, 401, "{key:?}");
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
    // A model the key may not use: 403.
    let (status, body) = error_of(call(&gw, Some(TEAM_A), "b", json!({})).await).await;
    assert_eq!(status, 403);
    assert_eq!(body["error"]["code"], "model_not_allowed", "{body}");
    assert_eq!(
        m.requests().await,
        2,
        "refused requests never reach an upstream"
    );
    let st = gw.status().await;
    assert_eq!(st["auth"]["client_keys"], 2);
    gw.stop();
    // The audit trail names the client, never the key; no key anywhere.
    let rows = audit_rows(
        &gw,
        "SELECT client_key, status, coalesce(error_class, '') FROM requests ORDER BY id",
    );
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{}:{}:{}",
                r[0].as_str().unwrap_or("-"),
                r[1],
                r[2].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec!["team-a:200:", "team-b:200:", "team-a:403:model_not_allowed"]
    );
    let db = std::fs::read(gw.db()).unwrap();
    let log = gw.log();
    for secret in [TEAM_A, TEAM_B, "sk-upstream-9999"] {
        assert!(!log.contains(secret), "{secret} in the log");
        assert!(!st.to_string().contains(secret), "{secret} in /status");
        assert!(
            !db.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "{secret} in SQLite"
        );
    }
}

#[tokio::test]
async fn a_burst_over_rpm_from_many_connections_lets_exactly_the_limit_through() {
    let m = MockUp::openai("name: up").await;
    let mut gw = Gw::start_with_env(
        &cfg(&m, "    - { name: burst, key: sk-burst-key-1, rpm: 5 }\n"),
        &[("TEAM_A_KEY", TEAM_A)],
    );
    let mut tasks = Vec::new();
    for _ in 0..30 {
        // A client (and a connection) per request.
        let url = gw.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .bearer_auth("sk-burst-key-1")
                .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}))
                .send()
                .await
                .unwrap()
        }));
    }
    let mut ok = 0;
    let mut limited = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        match r.status().as_u16() {
            200 => ok += 1,
            429 => limited.push(r),
            other => panic!("{other}"),
        }
    }
    assert_eq!(ok, 5, "exactly rpm requests pass");
    assert_eq!(m.requests().await, 5);
    let r = limited.pop().unwrap();
    assert_eq!(header(&r, "x-ratelimit-limit-requests"), "5");
    assert_eq!(header(&r, "x-ratelimit-remaining-requests"), "0");
    assert!(header(&r, "x-ratelimit-reset-requests").ends_with("ms"));
    let retry: u64 = header(&r, "retry-after").parse().unwrap();
    assert!((1..=12).contains(&retry), "{retry}");
    let (_, body) = error_of(r).await;
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    gw.stop();
}

#[tokio::test]
async fn tpm_and_a_monthly_budget_that_survives_a_restart() {
    let m = MockUp::openai("name: up").await;
    let dir = tempfile::tempdir().unwrap();
    let keys = "    - { name: tokens, key: sk-tokens-key-1, tpm: 100 }\n    - { name: spender, key: sk-spender-key-1, budget_usd: 5 }\n";
    let mut gw = Gw::start_in(dir.path(), &cfg(&m, keys), &[("TEAM_A_KEY", TEAM_A)]);
    // tpm: the prompt estimate plus max_tokens count at once (OpenAI's own rule).
    let r = call(
        &gw,
        Some("sk-tokens-key-1"),
        "chat",
        json!({"max_tokens": 80}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let r = call(
        &gw,
        Some("sk-tokens-key-1"),
        "chat",
        json!({"max_tokens": 80}),
    )
    .await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-ratelimit-limit-tokens"), "100");
    // Budget: `a` costs $1 per token each way, so one request spends more than $5.
    let r = call(&gw, Some("sk-spender-key-1"), "chat", json!({})).await;
    assert_eq!(r.status(), 200);
    let (status, body) =
        error_of(call(&gw, Some("sk-spender-key-1"), "chat", json!({})).await).await;
    assert_eq!(status, 429);
    assert_eq!(body["error"]["code"], "insufficient_quota", "{body}");
    let spent = gw.status().await["auth"]["spend_this_month_usd"]["spender"]
        .as_f64()
        .unwrap();
    assert!(spent >= 5.0, "{spent}");
    gw.stop();
    let persisted: f64 = one(
        &rusqlite::Connection::open(gw.db()).unwrap(),
        "SELECT usd FROM client_spend WHERE client = 'spender'",
    );
    assert!((persisted - spent).abs() < 1e-6, "{persisted} vs {spent}");
    // `autohedge stats --by-key`: requests, tokens and spend per key name.
    let out = std::process::Command::new(BIN)
        .args(["stats", "--by-key", "--json", "--since", "1h", "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let by_key: Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = |k: &str| {
        by_key
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["key"] == k)
            .cloned()
            .unwrap_or_else(|| panic!("{k} in {by_key}"))
    };
    assert_eq!(row("tokens")["requests"], 2);
    assert_eq!(row("tokens")["served"], 1);
    assert_eq!(row("tokens")["refused"], 1);
    assert_eq!(row("spender")["served"], 1);
    assert!((row("spender")["cost_usd"].as_f64().unwrap() - spent).abs() < 1e-6);
    assert!(row("spender")["tokens_in"].as_u64().unwrap() > 0);
    // A restart keeps the spend: still over budget.
    let mut gw = Gw::start_at(
        dir.path(),
        &dir.path().join("config.yaml"),
        &[("TEAM_A_KEY", TEAM_A)],
    );
    let (status, body) =
        error_of(call(&gw, Some("sk-spender-key-1"), "chat", json!({})).await).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "insufficient_quota");
    assert_eq!(
        m.requests().await,
        2,
        "the refused requests never reached the upstream"
    );
    gw.stop();
}

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
async fn an_open_gateway_on_a_public_address_is_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    std::fs::write(
        &path,
        "server: { listen: 0.0.0.0:8000 }\nmodels:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("anyone who reaches this address can spend the upstream keys"),
        "{text}"
    );
    std::fs::write(
        &path,
        "server: { listen: 127.0.0.1:8000 }\nmodels:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("anyone who reaches"));
    // An admin key that cannot be read is a warning, and the admin surface stays closed.
    std::fs::write(
        &path,
        "models:\n  a: { type: openai, base_url: \"http://127.0.0.1:9/v1\" }\nauth: { admin_key: env:AUTOHEDGE_SURELY_UNSET_ADMIN }\n",
    )
    .unwrap();
    let out = std::process::Command::new(BIN)
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("auth.admin_key") && text.contains("closed"),
        "{text}"
    );
    let dir2 = tempfile::tempdir().unwrap();
    let mut gw = Gw::start_at(dir2.path(), &path, &[]);
    let r = reqwest::get(gw.url("/status")).await.unwrap();
    assert_eq!(r.status(), 401, "closed even to loopback");
    gw.stop();
    // Bad auth sections are errors that say where.
    for (bad, needle) in [
        ("auth: { keys: [] }", "auth.keys"),
        (
            "auth: { keys: [{ name: x, key: \"sha256:zz\" }] }",
            "auth.keys[0].key",
        ),
        (
            "auth: { keys: [{ name: x, key: k1, models: [nope] }] }",
            "auth.keys[0].models[0]",
        ),
        ("auth: { keys: [{ name: x, key: k1, rpm: 0 }] }", "rpm"),
    ] {
        std::fs::write(
            &path,
            format!(
                "models:\n  a: {{ type: openai, base_url: \"http://127.0.0.1:9/v1\" }}\n{bad}\n"
            ),
        )
        .unwrap();
        let out = std::process::Command::new(BIN)
            .args(["check-config"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}");
        assert!(text.contains(needle), "{bad}: {text}");
    }
}
