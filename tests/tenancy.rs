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
    // The new server gets a prompt the old one's window would have sent elsewhere. (The
    // endpoint's state is made fresh just before the new table is swapped in: a request in
    // that instant still goes by the old table, so the first to reach the new server is
    // awaited, each served by `e`.)
    let long = "word ".repeat(400);
    for i in 0..20 {
        let r = chat_with(&gw, &format!("long-{i}"), "chat", &long).await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "e");
        if new.requests() > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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

/// How a raw SSE upstream ends its stream.
#[derive(Clone, Copy)]
enum Ending {
    /// Closes the connection in the middle of an HTTP chunk (a broken stream).
    Break,
    /// Sends `data:` lines with no blank line, without end (until the gateway hangs up, or
    /// `limit` bytes).
    Endless { limit: usize },
}

/// A loopback upstream speaking OpenAI's streaming wire format byte for byte: chunked HTTP/1.1,
/// `chunks` as given, then `ending`. Returns its base URL and the bytes of the ending it wrote.
async fn raw_sse_upstream(chunks: Vec<String>, ending: Ending) -> (String, Arc<AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let wrote = Arc::new(AtomicU64::new(0));
    let counter = wrote.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let chunks = chunks.clone();
            let counter = counter.clone();
            tokio::spawn(async move {
                // The request: headers, then a body of content-length bytes.
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                let body_start = loop {
                    let Ok(n) = sock.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    req.extend_from_slice(&buf[..n]);
                    if let Some(i) = req.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&req[..body_start]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                while req.len() < body_start + len {
                    let Ok(n) = sock.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    req.extend_from_slice(&buf[..n]);
                }
                let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                for c in &chunks {
                    out.extend_from_slice(format!("{:x}\r\n{c}\r\n", c.len()).as_bytes());
                }
                if sock.write_all(&out).await.is_err() {
                    return;
                }
                match ending {
                    Ending::Break => {
                        // A chunk announced longer than what follows, then the connection goes.
                        let _ = sock.write_all(b"400\r\ndata: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"par").await;
                        let _ = sock.flush().await;
                    }
                    Ending::Endless { limit } => {
                        let line = format!("data: {}\n", "z".repeat(1000));
                        let chunk = format!("{:x}\r\n{}\r\n", line.len() * 64, line.repeat(64));
                        let mut sent = 0;
                        while sent < limit {
                            if sock.write_all(chunk.as_bytes()).await.is_err() {
                                break;
                            }
                            sent += chunk.len();
                            counter.store(sent as u64, Ordering::SeqCst);
                        }
                    }
                }
            });
        }
    });
    (format!("http://{addr}/v1"), wrote)
}

fn content_event(text: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]})
    )
}

/// Every event of a stream the client got, each `data:` JSON or `[DONE]`; panics on any other.
fn whole_events(raw: &str) -> Vec<Value> {
    let mut p = autohedge::wire::sse::SseParser::new();
    let events = p.push(raw.as_bytes()).unwrap();
    assert!(
        !p.has_partial(),
        "the client's stream ends mid-event: {raw:?}"
    );
    events
        .iter()
        .filter(|e| e.data.trim() != "[DONE]")
        .map(|e| {
            serde_json::from_str(&e.data)
                .unwrap_or_else(|err| panic!("not JSON ({err}): {:?} in {raw:?}", e.data))
        })
        .collect()
}

/// An upstream that breaks in the middle of an event: the client gets the whole events before
/// it, then the gateway's error event on a clean boundary; the half event never reaches it.
#[tokio::test]
async fn a_stream_broken_mid_event_reaches_the_client_as_whole_events() {
    // The event before the break comes in two pieces, its blank line in the second.
    let first = content_event("Hello ");
    let (a, b) = first.split_at(20);
    let (base, _) = raw_sse_upstream(
        vec![a.to_string(), b.to_string(), content_event("world ")],
        Ending::Break,
    )
    .await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{base}\" }}\n"
    ));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let events = whole_events(&raw);
    let text: String = events
        .iter()
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(text, "Hello world ", "{raw}");
    assert!(
        !raw.contains(":\"par"),
        "the half event reached the client: {raw}"
    );
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "stream_broken", "{raw}");
}

/// An upstream that sends `data:` lines without the blank line that ends an event, without end:
/// the gateway holds at most `limits.max_event_bytes` of it, passes none of it on, ends the
/// client's stream with `stream_broken` and hangs up on the upstream; its memory stays flat.
/// Before the first content chunk the same upstream is failed over.
#[tokio::test]
async fn an_endless_event_is_cut_at_max_event_bytes_and_memory_stays_bounded() {
    const LIMIT: usize = 300 * 1024 * 1024;
    let (endless, wrote) = raw_sse_upstream(
        vec![content_event("Hello ")],
        Ending::Endless { limit: LIMIT },
    )
    .await;
    let (early, early_wrote) = raw_sse_upstream(vec![], Ending::Endless { limit: LIMIT }).await;
    let b = MockUp::openai("name: b\nreply: \"served by b\"").await;
    let gw = Gw::start(&format!(
        "models:\n  endless: {{ type: openai, base_url: \"{endless}\" }}\n  early: {{ type: openai, base_url: \"{early}\" }}\n  b: {{ type: openai, base_url: \"{}\" }}\nroutes:\n  late: [endless, b]\n  first: [early, b]\nlimits: {{ max_event_bytes: 1048576 }}\n",
        b.base()
    ));
    let ask = |model: &str| json!({"model": model, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    // Warm up every path once (code pages, pools, the allocator's first arenas), then measure
    // what a second 300 MB event costs.
    let _ = gw.chat("b", "x").await.text().await;
    for model in ["late", "first"] {
        let _ = gw
            .post("/v1/chat/completions", ask(model))
            .await
            .text()
            .await;
    }
    let rss_before = rss_kb(gw.pid());

    let r = gw.post("/v1/chat/completions", ask("late")).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "endless");
    let raw = r.text().await.unwrap();
    assert!(
        wrote.load(Ordering::SeqCst) > 1024 * 1024,
        "the upstream sent past the limit"
    );
    assert!(
        raw.len() < 1024 * 1024,
        "the client got {} bytes",
        raw.len()
    );
    assert!(
        !raw.contains("zzzz"),
        "none of the unfinished event passed on"
    );
    let events = whole_events(&raw);
    assert_eq!(events[0]["choices"][0]["delta"]["content"], "Hello ");
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "stream_broken", "{raw}");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("max_event_bytes"),
        "{last}"
    );
    // The gateway hung up: the upstream could not write its 300 MB.
    let ok = eventually(Duration::from_secs(10), || async {
        let a = wrote.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(200)).await;
        wrote.load(Ordering::SeqCst) == a
    })
    .await;
    assert!(ok);
    assert!((wrote.load(Ordering::SeqCst) as usize) < LIMIT / 4);

    // Before the first content chunk: an attempt that fails over, invisibly.
    let r = gw.post("/v1/chat/completions", ask("first")).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let raw = r.text().await.unwrap();
    assert!(raw.contains("served"), "{raw}");
    assert!(early_wrote.load(Ordering::SeqCst) > 1024 * 1024);

    let grown_mb = rss_kb(gw.pid()).saturating_sub(rss_before) / 1024;
    assert!(grown_mb < 32, "RSS grew by {grown_mb} MiB");
}

/// `tpm` counts what is spent: a prompt of token ids counts as its length, and a request without
/// `max_tokens` is charged its completion tokens when it ends, so the next requests wait. The
/// 429 carries the tokens trio.
#[tokio::test]
async fn tpm_counts_token_id_prompts_and_completions_without_max_tokens() {
    let a = MockUp::openai(&format!(
        "name: a\nreply: \"{}\"",
        "word ".repeat(300).trim()
    ))
    .await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nauth:\n  keys:\n    - {{ name: ids, key: sk-ids-000000000000, tpm: 100 }}\n    - {{ name: open, key: sk-open-00000000000, tpm: 100 }}\n",
        a.base()
    ));
    let send = |key: &'static str, path: &'static str, body: Value| {
        let url = gw.url(path);
        async move {
            reqwest::Client::new()
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    };
    // 60 token ids, twice: the second is over 100 tokens a minute.
    let ids: Vec<u32> = (1..=60).collect();
    let body = json!({"model": "a", "prompt": ids, "max_tokens": 1});
    let r = send("sk-ids-000000000000", "/v1/completions", body.clone()).await;
    assert_eq!(r.status(), 200);
    assert_eq!(a.requests().await, 1);
    let r = send("sk-ids-000000000000", "/v1/completions", body.clone()).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "x-ratelimit-limit-tokens"), "100");
    assert!(!header(&r, "x-ratelimit-remaining-tokens").is_empty());
    assert!(!header(&r, "x-ratelimit-reset-tokens").is_empty());
    assert_eq!(a.requests().await, 1, "refused before the upstream");
    // Lists of id lists count too: 3 × 2000 ids is far over a minute's 100.
    let many =
        json!({"model": "a", "prompt": [vec![7u32; 2000], vec![7u32; 2000], vec![7u32; 2000]]});
    assert_eq!(
        send("sk-ids-000000000000", "/v1/completions", many)
            .await
            .status(),
        429
    );

    // No max_tokens: admitted on its prompt; its 300 completion tokens are charged at the end.
    let chat = json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]});
    let r = send("sk-open-00000000000", "/v1/chat/completions", chat.clone()).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 300);
    assert_eq!(a.requests().await, 2);
    let r = send("sk-open-00000000000", "/v1/chat/completions", chat.clone()).await;
    assert_eq!(r.status(), 429, "the completion was charged");
    assert_eq!(header(&r, "x-ratelimit-remaining-tokens"), "0");
    // The same for a stream: its completion, counted as it ends, is charged too.
    let gw2 = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nauth:\n  keys:\n    - {{ name: s, key: sk-stream-000000000, tpm: 100 }}\n",
        a.base()
    ));
    let streamed = |n: &'static str| {
        let url = gw2.url("/v1/chat/completions");
        async move {
            reqwest::Client::new()
                .post(url)
                .bearer_auth("sk-stream-000000000")
                .header("x-request-id", n)
                .json(&json!({"model": "a", "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap()
        }
    };
    let r = streamed("s1").await;
    assert_eq!(r.status(), 200);
    let text = stream_text(&sse_events(r).await);
    assert_eq!(text.split_whitespace().count(), 300);
    assert_eq!(streamed("s2").await.status(), 429);
}

/// A budget cannot be overshot by concurrency: twenty requests at once against a $5 budget, each
/// able to cost $1, are admitted five at a time, never all twenty; the spend ends at most one
/// request's cost over the budget.
#[tokio::test]
async fn concurrent_requests_overshoot_a_budget_by_at_most_one_reservation() {
    let a = MockUp::openai("name: a\nreply: ok\nrules: [{delay: 500ms}]").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", cost: {{ input_per_mtok: 0, output_per_mtok: 1000000 }} }}\nauth:\n  keys:\n    - {{ name: team, key: sk-team-budget-0000, budget_usd: 5 }}\n",
        a.base()
    ));
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let url = gw.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .bearer_auth("sk-team-budget-0000")
                .json(&json!({"model": "a", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap());
    }
    let served = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!((served, refused), (5, 15), "{statuses:?}");
    assert_eq!(a.requests().await, 5);
    let spent = gw.status().await["auth"]["spend_this_month_usd"]["team"]
        .as_f64()
        .unwrap();
    assert!((5.0..=6.0).contains(&spent), "{spent}");
}

fn error_event(message: &str) -> String {
    format!(
        "data: {}\n\n",
        json!({"error": {"message": message, "type": "server_error", "code": null}})
    )
}

/// A continuation is invisible: when one upstream read holds both content and an in-band error,
/// the client still gets that content, then the continuation (no gap); the audit row and the
/// key's bill hold both legs' tokens.
#[tokio::test]
async fn a_continued_stream_has_no_gap_and_both_legs_are_billed() {
    let both = format!("{}{}", content_event("there "), error_event("engine died"));
    let (brk, _) = raw_sse_upstream(vec![content_event("Hello "), both], Ending::Break).await;
    let cont = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        "reply: \"Hello there my old friend\"",
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n  brk: {{ type: vllm, base_url: \"{brk}\", cost: {{ input_per_mtok: 0, output_per_mtok: 1000000 }} }}\n  cont: {{ type: vllm, base_url: \"{}\", cost: {{ input_per_mtok: 0, output_per_mtok: 1000000 }} }}\nroutes:\n  chat:\n    chain: [brk, cont]\n    continue_streams: true\nauth:\n  keys:\n    - {{ name: team, key: sk-team-cont-000000 }}\n",
        cont.base()
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth("sk-team-cont-000000")
        .header("x-request-id", "cont-1")
        .json(
            &json!({"model": "chat", "stream": true, "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": "greet"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let raw = r.text().await.unwrap();
    let events = whole_events(&raw);
    let text: String = events
        .iter()
        .filter_map(|v| {
            v.pointer("/choices/0/delta/content")
                .and_then(Value::as_str)
        })
        .collect();
    assert_eq!(cont.requests().await, 1, "cont carried the stream on");
    let sent = cont.stats().await["last_body"].clone();
    let prefix = sent["messages"].as_array().unwrap().last().unwrap()["content"].clone();
    assert_eq!(
        prefix, "Hello there ",
        "cont was asked to go on from what the client has"
    );
    assert_eq!(text, "Hello there my old friend", "{raw}");
    assert!(!raw.contains("engine died"), "{raw}");
    // The second leg's own usage, as the client saw it.
    let second = events
        .iter()
        .filter_map(|v| v["usage"]["completion_tokens"].as_u64())
        .next_back()
        .expect("usage chunk");
    let status = gw.status().await;
    let spent = status["auth"]["spend_this_month_usd"]["team"]
        .as_f64()
        .unwrap_or(0.0);
    gw.stop();
    let row = audit_rows(
        &gw,
        "SELECT tokens_out, cost_usd, continued_from FROM requests WHERE request_id = 'cont-1'",
    );
    // The first leg's "Hello there " (12 characters: 3 tokens estimated) plus the second's.
    assert_eq!(row[0][0], json!(3 + second), "{row:?}");
    assert_eq!(row[0][2], json!("brk"));
    let cost = row[0][1].as_f64().unwrap();
    assert!((cost - (3 + second) as f64).abs() < 1e-9, "{cost}");
    assert!(
        (spent - cost).abs() < 1e-9,
        "billed both legs: {spent} vs {cost}"
    );
}

/// A failed attempt the upstream billed (its answer reported `usage`) is charged to the request:
/// its tokens and cost join the serving endpoint's in the audit row and the key's spend.
#[tokio::test]
async fn a_failed_attempt_that_reported_usage_is_billed() {
    let a = MockUp::openai(
        r#"rules: [{body: "{\"error\": {\"message\": \"engine overloaded\", \"type\": \"server_error\"}, \"usage\": {\"prompt_tokens\": 5, \"completion_tokens\": 7, \"total_tokens\": 12}}"}]"#,
    )
    .await;
    let b = MockUp::openai("name: b\nreply: \"one two three\"").await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", cost: {{ input_per_mtok: 1000000, output_per_mtok: 1000000 }} }}\n  b: {{ type: openai, base_url: \"{}\", cost: {{ input_per_mtok: 1000000, output_per_mtok: 1000000 }} }}\nroutes:\n  chat: [a, b]\nauth:\n  keys:\n    - {{ name: team, key: sk-team-billed-0000 }}\n",
        a.base(),
        b.base()
    ));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth("sk-team-billed-0000")
        .header("x-request-id", "billed-1")
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1, "a answered its in-band error");
    let v: Value = r.json().await.unwrap();
    let (b_in, b_out) = (
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    let spent = gw.status().await["auth"]["spend_this_month_usd"]["team"]
        .as_f64()
        .unwrap();
    gw.stop();
    let row = audit_rows(
        &gw,
        "SELECT tokens_in, tokens_out, cost_usd FROM requests WHERE request_id = 'billed-1'",
    );
    assert_eq!(row[0][0], json!(5 + b_in), "{row:?}");
    assert_eq!(row[0][1], json!(7 + b_out), "{row:?}");
    let cost = (12 + b_in + b_out) as f64;
    assert!((row[0][2].as_f64().unwrap() - cost).abs() < 1e-9, "{row:?}");
    assert!((spent - cost).abs() < 1e-9, "{spent} vs {cost}");
}

/// A key's spend is persisted on its own path: with an audit queue of one, request rows are
/// dropped, yet `client_spend` holds the whole month's spend after a clean stop, and a restart
/// reads it back.
#[tokio::test]
async fn spend_survives_dropped_audit_rows() {
    let a = MockUp::openai("name: a").await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = format!(
        "server: {{ audit_queue: 1 }}\nmodels:\n  a: {{ type: openai, base_url: \"{}\", cost: {{ input_per_mtok: 1000000, output_per_mtok: 1000000 }} }}\nauth:\n  keys:\n    - {{ name: team, key: sk-team-spend-00000, budget_usd: 100000 }}\n",
        a.base()
    );
    let mut gw = Gw::start_in(dir.path(), &cfg, &[]);
    let url = gw.url("/v1/chat/completions");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let c = reqwest::Client::new();
            for _ in 0..10 {
                let r = c
                    .post(&url)
                    .bearer_auth("sk-team-spend-00000")
                    .json(&json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(a.requests().await, 200);
    let st = gw.status().await;
    let spent = st["auth"]["spend_this_month_usd"]["team"].as_f64().unwrap();
    assert!(spent > 0.0);
    gw.stop();
    let dropped = audit_rows(&gw, "SELECT COUNT(*) FROM requests")[0][0]
        .as_u64()
        .unwrap();
    assert!(dropped < 200, "rows were dropped: {dropped} of 200 written");
    let stored = audit_rows(&gw, "SELECT usd FROM client_spend WHERE client = 'team'")[0][0]
        .as_f64()
        .unwrap();
    assert!(
        (stored - spent).abs() < 1e-6,
        "stored {stored}, spent {spent}"
    );
    let gw = Gw::start_in(dir.path(), &cfg, &[]);
    let again = gw.status().await;
    // The key's state exists once it is used; its spend is read from the database then.
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth("sk-team-spend-00000")
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{again}");
    let after = gw.status().await["auth"]["spend_this_month_usd"]["team"]
        .as_f64()
        .unwrap();
    assert!(after > spent, "read back {after}, before {spent}");
}
