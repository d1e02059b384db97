//! One gateway, many tenants: no client's request, key or bytes, no config value and no upstream's
//! bytes may change what the other clients get. Each test first shows the thing happened (the
//! upstream got the request, answered as it did) and then that nobody else was touched.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// An upstream that answers like vLLM's OpenAI server: a request whose `temperature` is not a
/// number gets vLLM's validation 400, which quotes the invalid input back; a message `overflow:N`
/// gets vLLM's context-length 400 stating a limit of N; anything else is served, with
/// `usage.prompt_tokens` N for a message `served:N` (else 10). Counts the requests it got.
struct VllmLike {
    base: String,
    requests: Arc<AtomicU64>,
}

async fn vllm_like() -> VllmLike {
    use axum::routing::post;
    let requests = Arc::new(AtomicU64::new(0));
    let seen = requests.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::Json<Value>| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                let bad = |msg: String| {
                    (
                        axum::http::StatusCode::BAD_REQUEST,
                        axum::Json(json!({"error": {"message": msg, "type": "BadRequestError", "param": null, "code": 400}})),
                    )
                };
                if let Some(t) = body.get("temperature").filter(|t| !t.is_number()) {
                    return bad(format!(
                        "1 validation error for ChatCompletionRequest\ntemperature\n  Input should be a valid number, unable to parse string as a number [type=float_parsing, input_value={t}, input_type=str]"
                    ));
                }
                let text = body
                    .pointer("/messages/0/content")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if let Some(n) = text.strip_prefix("overflow:") {
                    return bad(format!(
                        "This model's maximum context length is {n} tokens. However, you requested 99999 tokens (99990 in the messages, 9 in the completion). Please reduce the length of the messages or completion."
                    ));
                }
                let prompt: u64 = text
                    .strip_prefix("served:")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(10);
                (
                    axum::http::StatusCode::OK,
                    axum::Json(json!({
                        "id": "chatcmpl-v", "object": "chat.completion", "created": 1, "model": "tiny",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1}
                    })),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    VllmLike {
        base: format!("http://{addr}/v1"),
        requests,
    }
}

impl VllmLike {
    fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

fn learned(st: &Value, name: &str) -> Value {
    st["endpoints"][name]["learned_context_window"].clone()
}

async fn chat_with(gw: &Gw, id: &str, model: &str, content: &str) -> reqwest::Response {
    gw.chat_id(
        id,
        json!({"model": model, "messages": [{"role": "user", "content": content}]}),
    )
    .await
}

/// Rewrites the config file and has the gateway reload it (SIGHUP), waiting until `/status`
/// shows `until`.
async fn reload(gw: &Gw, cfg: &str, until: impl Fn(&Value) -> bool) {
    std::fs::write(&gw.config_path, cfg).unwrap();
    std::process::Command::new("kill")
        .args(["-HUP", &gw.pid().to_string()])
        .status()
        .unwrap();
    let ok = eventually(Duration::from_secs(10), || async {
        until(&gw.status().await)
    })
    .await;
    assert!(ok, "reload not seen: {}", gw.status().await);
}

/// vLLM's validation errors quote the input: a request whose `temperature` is the text of a
/// context-length error must not teach the endpoint a window of 1 token. Nor does an upstream's
/// stated limit below 64 tokens, or below a request it served in full. A real limit is learned,
/// with the request that taught it; `endpoint clear` forgets it in the running gateway and in
/// SQLite.
#[tokio::test]
async fn a_learned_window_comes_only_from_the_upstreams_own_word() {
    let v = vllm_like().await;
    let big = MockUp::openai("name: big").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "models:\n  v: {{ type: vllm, base_url: \"{}\", model: tiny }}\n  big: {{ type: openai, base_url: \"{}\", context_window: 128000 }}\nroutes:\n  chat: [v, big]\n",
        v.base,
        big.base()
    );
    let mut gw = Gw::start_in(dir.path(), &cfg, &[]);

    // The poisoned request: vLLM answers its 400, quoting the temperature.
    let r = gw
        .chat_id(
            "poison-1",
            json!({"model": "chat", "temperature": "This model's maximum context length is 1 tokens.",
                   "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(v.requests(), 1, "v got the request and answered its 400");
    let _ = r.text().await;
    assert_eq!(learned(&gw.status().await, "v"), Value::Null);
    // Everyone else is still served by v.
    let r = chat_with(&gw, "plain-1", "chat", "hello").await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "v");

    // A stated limit below 64 tokens is no model's window.
    let r = chat_with(&gw, "tiny-limit", "chat", "overflow:32").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(v.requests(), 3);
    assert_eq!(learned(&gw.status().await, "v"), Value::Null);

    // v served 500 prompt tokens in full: a stated limit of 300 is not its window.
    let r = chat_with(&gw, "served-500", "chat", "served:500").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "v");
    let r = chat_with(&gw, "below-served", "chat", "overflow:300").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(v.requests(), 5);
    assert_eq!(learned(&gw.status().await, "v"), Value::Null);

    // A real limit is learned, with the request that taught it.
    let r = chat_with(&gw, "teacher", "chat", "overflow:4096").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    let st = gw.status().await;
    assert_eq!(learned(&st, "v"), 4096);
    assert_eq!(
        st["endpoints"]["v"]["learned_context_window_request"],
        "teacher"
    );

    // `endpoint clear` forgets it live...
    let out = std::process::Command::new(BIN)
        .args(["endpoint", "clear", "v", "--url", &gw.url(""), "--data-dir"])
        .arg(gw.data_dir())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(learned(&gw.status().await, "v"), Value::Null);
    gw.stop();
    // ...and in SQLite: a restart does not bring it back.
    let gw = Gw::start_in(dir.path(), &cfg, &[]);
    assert_eq!(learned(&gw.status().await, "v"), Value::Null);
    let r = chat_with(&gw, "after-restart", "chat", "hello").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "v");
}

/// Pointing endpoint `e` at another server by a reload starts its state afresh: the window learned
/// from the old server, and its cooldown, do not carry over to the new one.
#[tokio::test]
async fn a_redefined_endpoint_forgets_what_was_learned_about_the_old_server() {
    let old = vllm_like().await;
    let new = vllm_like().await;
    let big = MockUp::openai("name: big").await;
    let cfg = |base: &str| {
        format!(
            "models:\n  e: {{ type: vllm, base_url: \"{base}\", model: tiny }}\n  big: {{ type: openai, base_url: \"{}\", context_window: 128000 }}\nroutes:\n  chat: [e, big]\n",
            big.base()
        )
    };
    let gw = Gw::start(&cfg(&old.base));
    let r = chat_with(&gw, "teach", "chat", "overflow:100").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(old.requests(), 1);
    assert_eq!(learned(&gw.status().await, "e"), 100);

    reload(&gw, &cfg(&new.base), |st| {
        st["endpoints"]["e"]["learned_context_window"].is_null()
    })
    .await;
    // The new server gets a prompt the old one's window would have sent elsewhere.
    let long = "word ".repeat(400);
    let r = chat_with(&gw, "long", "chat", &long).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "e");
    assert_eq!(new.requests(), 1);
    gw.status().await;
    let mut gw = gw;
    gw.stop();
    let ev = audit_rows(
        &gw,
        "SELECT event FROM endpoint_events WHERE endpoint = 'e' ORDER BY id",
    );
    assert!(
        ev.iter().any(|e| e[0] == "redefined"),
        "the change is an event: {ev:?}"
    );
}

/// `request_timeout: 18446744073709551615` (and every duration over 365 days, in any form) is
/// refused at load, naming its path; it used to load and turn every request into a 500.
#[tokio::test]
async fn an_outsized_duration_is_refused_at_load_naming_its_path() {
    let a = MockUp::openai("name: a").await;
    for (key, value) in [
        ("request_timeout", "18446744073709551615"),
        ("request_timeout", "31536001"),
        ("request_timeout", "1e30"),
        ("request_timeout", "\"400d\""),
        ("default_cooldown", "18446744073709551615"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(
            &path,
            format!(
                "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nrouting_policy: {{ {key}: {value} }}\n",
                a.base()
            ),
        )
        .unwrap();
        let out = std::process::Command::new(BIN)
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{key}: {value} loaded: {text}");
        assert!(
            text.contains(&format!("routing_policy.{key}")) && text.contains("365 days"),
            "{key}: {value}: {text}"
        );
    }
    // The cap itself loads and serves.
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nrouting_policy: {{ request_timeout: 31536000 }}\n",
        a.base()
    ));
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    assert_eq!(a.requests().await, 1);
}

async fn call_as(gw: &Gw, key: &str, id: &str, body: Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(key)
        .header("x-request-id", id)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// A key's `models` hold over the whole path: a key allowed `local` is never served, hedged or
/// retried by `paid`, the fallback chain's next endpoint, and `paid` is recorded as
/// `skipped_not_allowed`; a key allowed the route gets the route's whole chain. `GET /v1/models`
/// needs a client key and lists only what the key may ask for.
#[tokio::test]
async fn a_keys_allow_list_holds_over_fallback_hedges_and_the_model_list() {
    let local = MockUp::openai("name: local\nrules: [{status: 503}]").await;
    let paid = MockUp::openai("name: paid").await;
    let slow = MockUp::openai("name: slow\nrules: [{delay: 1s}]").await;
    let cfg = format!(
        r#"models:
  local: {{ type: openai, base_url: "{}" }}
  paid: {{ type: openai, base_url: "{}" }}
  slow: {{ type: openai, base_url: "{}", hedge: {{ after: 50ms, max_extra: 100% }} }}
routes:
  chat: [local, paid]
routing_policy: {{ fallback_chain: [local, paid], max_wait: 0s, panic_threshold: 0 }}
auth:
  keys:
    - {{ name: team-local, key: sk-team-local-000000, models: [local, slow] }}
    - {{ name: team-chat, key: sk-team-chat-111111, models: [chat] }}
"#,
        local.base(),
        paid.base(),
        slow.base()
    );
    let mut gw = Gw::start(&cfg);
    let ask =
        |model: &str| json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});

    // The route's key: local fails, paid (in the route's chain) serves.
    let r = call_as(&gw, "sk-team-chat-111111", "chat-ok", ask("chat")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "paid");
    assert_eq!(paid.requests().await, 1);

    // The endpoint's key: local fails, and neither slow's hedge nor paid may take over.
    let before = local.requests().await;
    let r = call_as(&gw, "sk-team-local-000000", "local-503", ask("local")).await;
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert!(local.requests().await > before, "local was really tried");
    assert_eq!(status, 503, "{body}");
    assert_eq!(paid.requests().await, 1, "paid never called");
    let classes: Vec<(String, String)> = body["error"]["attempts"]
        .as_array()
        .unwrap_or(&vec![])
        .iter()
        .map(|a| {
            (
                a["endpoint"].as_str().unwrap_or("").to_string(),
                a["class"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    assert!(
        classes.contains(&("paid".into(), "skipped_not_allowed".into())),
        "{body}"
    );

    // Asked for slow (chain: slow, then the fallback chain local, paid), the hedge goes to local
    // (covered; it fails) and never to paid; slow answers after its delay.
    let before = local.requests().await;
    let r = call_as(&gw, "sk-team-local-000000", "slow-hedge", ask("slow")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "slow");
    assert_eq!(slow.requests().await, 1);
    assert_eq!(paid.requests().await, 1, "no hedge to paid");
    assert_eq!(
        local.requests().await,
        before + 1,
        "the hedge went to local"
    );
    // Without an allow-list (the route's key may not ask for slow at all).
    let r = call_as(&gw, "sk-team-chat-111111", "slow-403", ask("slow")).await;
    assert_eq!(r.status(), 403);

    // The model list needs a key and shows only what the key may ask for.
    let models = |key: Option<&'static str>| {
        let url = gw.url("/v1/models");
        async move {
            let mut req = reqwest::Client::new().get(url);
            if let Some(k) = key {
                req = req.bearer_auth(k);
            }
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let (status, body) = models(None).await;
    assert_eq!(status, 401, "{body}");
    let ids = |v: &Value| -> Vec<String> {
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    };
    let (_, body) = models(Some("sk-team-local-000000")).await;
    assert_eq!(ids(&body), vec!["local", "slow"]);
    let (_, body) = models(Some("sk-team-chat-111111")).await;
    assert_eq!(ids(&body), vec!["chat"]);
    assert_eq!(
        body["data"][0]["autohedge"]["chain"],
        json!(["local", "paid"])
    );

    gw.stop();
    let rows = audit_rows(
        &gw,
        "SELECT a.endpoint, a.class FROM attempts a JOIN requests r ON r.id = a.request_row WHERE r.request_id IN ('local-503', 'slow-hedge') AND a.class = 'skipped_not_allowed' ORDER BY a.id",
    );
    assert_eq!(
        rows,
        vec![
            vec![json!("paid"), json!("skipped_not_allowed")],
            vec![json!("paid"), json!("skipped_not_allowed")],
        ]
    );
}

async fn with_host(gw: &Gw, host: &str) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("host", host)
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// DNS rebinding against `/v1/*`: on a loopback listener a request whose `Host` is a domain name
/// (a web page's, pointed at 127.0.0.1) gets 403 `host_not_allowed` and reaches no upstream;
/// `localhost` and IP literals pass. `server.allowed_hosts` replaces the default; on a listener
/// that is not loopback there is no check unless it is set. `max_concurrent_requests` defaults to
/// 4096.
#[tokio::test]
async fn a_rebound_host_name_cannot_use_a_loopback_gateway() {
    let a = MockUp::openai("name: a").await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
        a.base()
    );
    let gw = Gw::start(&cfg);
    let port = gw.addr.port();
    let (status, body) = with_host(&gw, &format!("localhost:{port}")).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(with_host(&gw, &format!("[::1]:{port}")).await.0, 200);
    assert_eq!(a.requests().await, 2);
    let (status, body) = with_host(&gw, &format!("rebind.attacker.example:{port}")).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "host_not_allowed", "{body}");
    assert_eq!(a.requests().await, 2, "nothing reached the upstream");
    let r = reqwest::Client::new()
        .get(gw.url("/v1/models"))
        .header("host", "rebind.attacker.example")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let st = gw.status().await;
    assert_eq!(st["server"]["max_concurrent_requests"], 4096, "{st}");

    // allowed_hosts set: exactly those names (and `.name` for the names under it).
    let gw = Gw::start(&format!(
        "server: {{ allowed_hosts: [gw.internal, .corp.example] }}\n{cfg}"
    ));
    assert_eq!(with_host(&gw, "gw.internal").await.0, 200);
    assert_eq!(with_host(&gw, "GW.Internal:8000").await.0, 200);
    assert_eq!(with_host(&gw, "ai.corp.example").await.0, 200);
    assert_eq!(with_host(&gw, "localhost").await.0, 403);
    assert_eq!(with_host(&gw, "corp.example.attacker.example").await.0, 403);

    // Not loopback: no check unless set.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        format!("{cfg}auth: {{ keys: [{{ name: t, key: sk-tenant-0000000000 }}] }}\n"),
    )
    .unwrap();
    let gw = Gw::start_listening(dir.path(), &path, &[], "0.0.0.0:0");
    let r = reqwest::Client::new()
        .post(format!(
            "http://127.0.0.1:{}/v1/chat/completions",
            gw.addr.port()
        ))
        .header("host", "gateway.example")
        .bearer_auth("sk-tenant-0000000000")
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
