//! The wire to each backend type, against the real binary: the OpenAI passthrough (headers,
//! unknown fields, the client's own bytes), Ollama's translation both ways, `https` upstreams
//! behind a private CA (the openssl CLI, and Python's HTTPS server in tests/fixtures/tls), and
//! `HTTP_PROXY`.

mod common;

use common::*;
use serde_json::{Value, json};

/// A private CA and a server certificate for 127.0.0.1 it signed, made with the openssl CLI.
fn private_ca(
    dir: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("the openssl CLI is installed");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=AutoHedge Test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "srv.pem",
    ]);
    (dir.join("ca.pem"), dir.join("srv.pem"), dir.join("srv.key"))
}

/// An OpenAI-style upstream on 127.0.0.1 that keeps every request body's bytes as they came.
async fn recording_upstream() -> (String, std::sync::Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
    use axum::routing::post;
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = got.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(move |body: axum::body::Bytes| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(body.to_vec());
                axum::Json(json!({
                    "id": "c1", "object": "chat.completion", "created": 1, "model": "up",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/v1"), got)
}

#[tokio::test]
async fn non_stream_passes_through_with_headers() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&two(&a, &b, ""));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "my-req-1")
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "foo_unknown": {"x": 1}, "temperature": 0.2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-request-id"), "my-req-1");
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], "Hello from a!");
    let last = &a.stats().await["last_body"];
    assert_eq!(
        last["foo_unknown"],
        json!({"x": 1}),
        "unknown fields pass through"
    );
    assert_eq!(
        last["model"], "upstream-a",
        "model rewritten to the endpoint's id"
    );
    assert_eq!(b.requests().await, 0);

    // Naming an endpoint starts there; a fresh request id is generated when none is given.
    let r = gw.chat("b", "hi").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(header(&r, "x-request-id").len(), 36);

    // Completions and embeddings go through too.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "chat", "prompt": "Say hi"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap()["object"],
        "text_completion"
    );
    let r = gw
        .post(
            "/v1/embeddings",
            json!({"model": "chat", "input": ["a", "b"]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);

    // /v1/models lists routes and endpoints.
    let v: Value = reqwest::get(gw.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["chat", "a", "b"]);
    let h: Value = reqwest::get(gw.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(h["status"], "ok");
}

/// The upstream gets the client's own bytes with only `model` replaced (key order, spacing and
/// numbers as the client wrote them); a body with a key given twice, or one the endpoint's
/// `max_tokens` cap changes, is sent as the gateway read it instead, so the upstream cannot read
/// a different request from the one the gateway checked.
#[tokio::test]
async fn the_upstream_gets_the_clients_bytes_unless_they_could_be_read_two_ways() {
    let (base, got) = recording_upstream().await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{base}\", model: up-model, max_tokens: 100 }}\n"
    ));
    let send = |body: &'static str| {
        let url = gw.url("/v1/chat/completions");
        async move {
            reqwest::Client::new()
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        }
    };
    let plain = r#"{"messages": [{"role": "user", "content": "hi \"there\""}],  "model" : "a", "temperature": 1e-1, "seed": 123456789012345678901234567890}"#;
    let twice = r#"{"model": "a", "max_tokens": 5, "max_tokens": 7, "messages": [{"role": "user", "content": "x"}]}"#;
    let capped =
        r#"{"model": "a", "max_tokens": 5000, "messages": [{"role": "user", "content": "x"}]}"#;
    for body in [plain, twice, capped] {
        let r = send(body).await;
        assert_eq!(r.status(), 200, "{body}");
    }
    let got = got.lock().unwrap().clone();
    assert_eq!(got.len(), 3, "each request reached the upstream");
    assert_eq!(
        String::from_utf8(got[0].clone()).unwrap(),
        plain.replace(r#""model" : "a""#, r#""model" : "up-model""#)
    );
    // A key given twice goes once, with the value the gateway read (the last).
    let sent = String::from_utf8(got[1].clone()).unwrap();
    assert_eq!(sent.matches("max_tokens").count(), 1, "{sent}");
    let sent: Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(sent["max_tokens"], 7);
    assert_eq!(sent["model"], "up-model");
    // Over the cap: the cap goes, not the client's bytes.
    let sent: Value = serde_json::from_slice(&got[2]).unwrap();
    assert_eq!(sent["max_tokens"], 100);
    assert_eq!(sent["model"], "up-model");
}

#[tokio::test]
async fn ollama_answers_look_like_openai() {
    let o = MockUp::start(
        autohedge::demo::mock::Flavor::Ollama,
        "reply: \"Hi there friend\"",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&ollama_cfg(&o, &b));
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "ollama-1")
        .json(&json!({"model": "local", "max_tokens": 1000, "temperature": 0.1, "stop": "END", "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "local");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "local");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["choices"][0]["message"]["content"], "Hi there friend");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let sent = &o.stats().await["last_body"];
    assert_eq!(sent["model"], "qwen2.5:7b");
    assert_eq!(
        sent["options"]["num_predict"], 256,
        "capped at the endpoint's max_tokens"
    );
    assert_eq!(sent["options"]["stop"], json!(["END"]));
    assert_eq!(sent["stream"], false);
    assert_eq!(o.stats().await["by_path"]["/api/chat"], 1);

    // Streamed: role first, content chunks, finish, usage, [DONE].
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "ollama-2")
        .json(&json!({"model": "local", "stream": true, "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(header(&r, "content-type"), "text/event-stream");
    let ev = sse_events(r).await;
    assert_eq!(stream_text(&ev), "Hi there friend");
    let first: Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(first["object"], "chat.completion.chunk");
    let ids: std::collections::HashSet<String> = ev[..ev.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids.len(), 1, "one stable id per stream");
    let fin: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert_eq!(ev.last().unwrap(), "[DONE]");

    // Legacy completions and embeddings.
    let r = gw
        .post(
            "/v1/completions",
            json!({"model": "local", "prompt": "Say hi"}),
        )
        .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "Hi there friend");
    assert_eq!(o.stats().await["by_path"]["/api/generate"], 1);
    let r = gw
        .post(
            "/v1/embeddings",
            json!({"model": "local", "input": ["a", "b"], "encoding_format": "base64"}),
        )
        .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert!(v["data"][0]["embedding"].is_string(), "base64 honoured");
    assert_eq!(v["usage"]["prompt_tokens"], 2);

    // Tool calls, plain and streamed.
    o.set_script("rules: [{tool_call: get_weather}]").await;
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let r = gw
        .post("/v1/chat/completions", json!({"model": "local", "tools": tools, "messages": [{"role": "user", "content": "weather?"}]}))
        .await;
    let v: Value = r.json().await.unwrap();
    let call = &v["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        o.stats().await["last_body"]["tools"],
        tools,
        "tools forwarded"
    );
    let r = gw
        .post("/v1/chat/completions", json!({"model": "local", "stream": true, "tools": tools, "messages": [{"role": "user", "content": "weather?"}]}))
        .await;
    let ev = sse_events(r).await;
    let chunk: Value = ev
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|v| v.pointer("/choices/0/delta/tool_calls").is_some())
        .unwrap();
    assert_eq!(chunk["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
    assert_eq!(
        chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    let fin: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "tool_calls");

    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let (tout, est): (i64, bool) = conn
        .query_row(
            "SELECT tokens_out, tokens_estimated FROM requests WHERE request_id = 'ollama-2'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(
        (tout, est),
        (3, false),
        "Ollama's own counts recorded for a stream without include_usage"
    );
}

#[tokio::test]
async fn upstreams_behind_a_private_ca() {
    let tmp = tempfile::tempdir().unwrap();
    let (ca, cert, key) = private_ca(tmp.path());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tls/https_upstream.py");
    let mut server = KillOnDrop(
        std::process::Command::new("python3")
            .arg(&script)
            .arg(&cert)
            .arg(&key)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let port: u16 = line
        .trim()
        .strip_prefix("listening ")
        .unwrap()
        .parse()
        .unwrap();
    let base = format!("https://127.0.0.1:{port}/v1");
    let cfg =
        |extra: &str| format!("models:\n  a: {{ type: openai, base_url: \"{base}\"{extra} }}\n");

    // Only the web roots: the private CA is not trusted, the request fails (and says why).
    let gw = Gw::start(&cfg(""));
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["attempts"][0]["class"], "connect_error", "{v}");
    drop(gw);

    // The endpoint's ca_file.
    let gw = Gw::start(&cfg(&format!(", ca_file: \"{}\"", ca.display())));
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello over TLS!");
    drop(gw);

    // The system's CA store (here pointed at by SSL_CERT_FILE, as an operator's would be).
    let gw = Gw::start_with_env(&cfg(""), &[("SSL_CERT_FILE", ca.to_str().unwrap())]);
    let r = gw.chat("a", "x").await;
    assert_eq!(r.status(), 200, "the system store is trusted");

    // A ca_file that is no certificate is a config error naming the path.
    let bad = tmp.path().join("bad.pem");
    std::fs::write(&bad, "not a certificate").unwrap();
    let e = autohedge::config::Config::load(&cfg(&format!(", ca_file: \"{}\"", bad.display())))
        .unwrap_err();
    assert!(e.0.contains("models.a.ca_file"), "{}", e.0);
}

/// With a proxy in the environment, requests go through it (reqwest honours `HTTP_PROXY`), as
/// they did before the direct client existed: the upstream itself is never reached directly.
#[tokio::test]
async fn a_proxy_in_the_environment_is_honoured() {
    let upstream = MockUp::openai("reply: from the upstream itself\n").await;
    // The mock answers absolute-form requests too, so it can stand in for a forward proxy.
    let proxy = MockUp::openai("reply: through the proxy\n").await;
    let proxy_url = proxy.base().trim_end_matches("/v1").to_string();
    let gw = Gw::start_with_env(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", model: m }}\nroutes:\n  chat: [a]\nhealth: {{ probe_interval: 1h }}\n",
            upstream.base()
        ),
        &[("HTTP_PROXY", proxy_url.as_str())],
    );
    let r = gw.chat("chat", "hello").await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        json!("through the proxy"),
        "{body}"
    );
    assert_eq!(proxy.requests().await, 1, "the proxy carried the request");
    assert_eq!(upstream.requests().await, 0, "nothing bypassed the proxy");
    assert_no_panic(&gw);
}
