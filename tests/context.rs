//! The context-window guard, against the real binary: counting (tiktoken, `encoding:`,
//! `backend_tokenize` for vLLM and llama.cpp), `context_skip`, `context_fill`,
//! `on_context_overflow` (reject, truncate), failover only to larger windows, a window learned
//! only from the upstream's own word and kept, and payload hygiene (strip, escape).

mod common;

use common::*;
use serde_json::{Value, json};

fn long_conversation() -> Vec<Value> {
    let mut m = vec![
        json!({"role": "system", "content": "You are a senior Rust reviewer. Answer briefly."}),
    ];
    for i in 0..8 {
        m.push(json!({"role": "user", "content": format!("Old question {i} about gardening: when should I water tomatoes and how much mulch is right for the beds in a dry summer?")}));
        m.push(json!({"role": "assistant", "content": format!("Old answer {i}: water deeply twice a week in the morning, keep five centimetres of mulch, and check the soil by hand before watering again.")}));
    }
    m.insert(5, json!({"role": "user", "content": "Here is my tokio channel code:\n```rust\nlet (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(16);\ntx.send(1).await?;\n```\nWhy is it slow?"}));
    m.insert(6, json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "run_clippy", "arguments": "{\"path\": \"src/main.rs\"}"}}]}));
    m.insert(7, json!({"role": "tool", "tool_call_id": "call_1", "content": "clippy: tokio channel capacity 16 is fine"}));
    m.push(json!({"role": "user", "content": "Now a different thing: my tokio mpsc channel blocks when the buffer is full. Why?"}));
    m
}

fn count_tokens(gw: &Gw, model: &str, body: &Value) -> u64 {
    use std::io::Write;
    let mut child = std::process::Command::new(BIN)
        .args(["count-tokens", "--json", "--model", model, "--config"])
        .arg(&gw.config_path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["tokens"].as_u64().unwrap()
}

async fn chat_with(gw: &Gw, id: &str, model: &str, content: &str) -> reqwest::Response {
    gw.chat_id(
        id,
        json!({"model": model, "messages": [{"role": "user", "content": content}]}),
    )
    .await
}

#[tokio::test]
async fn the_encoding_override_picks_the_tokenizer() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "models:\n  plain: {{ type: openai, base_url: \"{0}\", model: my-finetune }}\n  tuned: {{ type: openai, base_url: \"{0}\", model: my-finetune, encoding: cl100k_base }}\n",
        a.base()
    ));
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["tuned"]["tokenizer"],
        "tiktoken cl100k_base"
    );
    assert!(
        st["endpoints"]["plain"]["tokenizer"]
            .as_str()
            .unwrap()
            .starts_with("estimate"),
        "an unknown model id is estimated: {}",
        st["endpoints"]["plain"]
    );
    let body =
        json!({"messages": [{"role": "user", "content": "Tokenizers differ: ünïcödé, 東京, 🇫🇷."}]});
    assert_ne!(
        count_tokens(&gw, "plain", &body),
        count_tokens(&gw, "tuned", &body)
    );
}

/// The guard counts a prompt only when its byte bound (tokens <= UTF-8 bytes, plus framing)
/// does not already fit the window: a short prompt is served uncounted, and a prompt whose bytes
/// exceed the window but whose tokens fit is counted exactly and served by that endpoint, not
/// skipped or refused.
#[tokio::test]
async fn only_a_prompt_near_its_window_is_counted_and_the_bound_never_refuses() {
    let small = MockUp::openai("name: small").await;
    let big = MockUp::openai("name: big").await;
    let gw = Gw::start(&format!(
        "models:\n  small: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 400 }}\n  big: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 100000 }}\nrouting_policy: {{ fallback_chain: [small, big] }}\n",
        small.base(),
        big.base()
    ));
    let short = json!([{"role": "user", "content": "Hello there"}]);
    // 1,000 bytes: over the 380 tokens small allows, though its tokens are far fewer.
    let near = json!([{"role": "user", "content": "word ".repeat(200)}]);
    let exact = count_tokens(&gw, "small", &json!({ "messages": near }));
    assert!(exact < 300, "{exact}");
    let r = gw
        .chat_id("short", json!({"model": "small", "messages": short}))
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "small");
    let r = gw
        .chat_id(
            "near",
            json!({"model": "small", "messages": near, "max_tokens": 380 - exact}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "small",
        "the exact count fits, so the endpoint is not skipped"
    );
    let r = gw
        .chat_id(
            "over",
            json!({"model": "small", "messages": near, "max_tokens": 381 - exact}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big", "one token over");
    assert_eq!(small.requests().await, 2);
    let mut gw = gw;
    gw.stop();
    let counted = db_rows(
        &gw,
        "SELECT request_id || ':' || COALESCE(prompt_tokens_counted, 'none') FROM requests ORDER BY request_id",
    );
    assert_eq!(
        counted,
        [
            format!("near:{exact}"),
            format!("over:{exact}"),
            "short:none".to_string()
        ]
    );
}

#[tokio::test]
async fn backend_tokenize_counts_and_teaches_the_window() {
    let v = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "context_window: 80").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&format!(
        "models:\n  v: {{ type: vllm, base_url: \"{}\", backend_tokenize: vllm, tokenize_timeout: 500ms }}\n  b: {{ type: openai, base_url: \"{}\", context_window: 128000 }}\n",
        v.base(),
        b.base()
    ));
    let r = gw.chat("v", &"several words here ".repeat(40)).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(
        v.requests().await,
        0,
        "vLLM's own count said it would not fit"
    );
    assert_eq!(v.stats().await["by_path"]["/tokenize"], 1);
    let st = gw.status().await;
    assert_eq!(
        st["endpoints"]["v"]["learned_context_window"], 80,
        "max_model_len learned"
    );
    // Short prompts still go to v.
    let r = gw.chat("v", "hi").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "v");
}

/// `backend_tokenize: llamacpp`: the backend's count (plus the chat framing llama.cpp's
/// `/tokenize` does not apply), cached per body, and the local count when the backend fails.
#[tokio::test]
async fn backend_tokenize_llamacpp_counts_caches_and_falls_back() {
    let a = MockUp::openai(
        "name: a\nrules: [{when: {path: /tokenize}, status: 200, body: '{\"tokens\":[1,2,3,4,5,6,7]}'}]",
    )
    .await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", model: my-llama, context_window: 100000, backend_tokenize: llamacpp }}\n",
        a.base()
    ));
    let send = |id: &'static str, text: &'static str| {
        let url = gw.url("/v1/chat/completions");
        async move {
            reqwest::Client::new()
                .post(url)
                .header("x-request-id", id)
                .json(&json!({"model": "a", "messages": [{"role": "user", "content": text}]}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(send("b1", "count me please").await, 200);
    assert_eq!(send("b2", "count me please").await, 200);
    let tokenize_calls = |v: &Value| v["by_path"]["/tokenize"].as_u64().unwrap_or(0);
    assert_eq!(
        tokenize_calls(&a.stats().await),
        1,
        "the second count came from the cache"
    );
    a.set_script("name: a\nrules: [{when: {path: /tokenize}, status: 500}]")
        .await;
    assert_eq!(
        send("b3", "a different body now").await,
        200,
        "served with the local count"
    );
    assert_eq!(tokenize_calls(&a.stats().await), 1, "the backend was asked");
    gw.stop();
    let counted = db_rows(
        &gw,
        "SELECT request_id || ':' || prompt_tokens_counted FROM requests ORDER BY request_id",
    );
    // 7 tokens of text + 3 per message + 3 to prime the reply.
    assert_eq!(counted[0], "b1:13");
    assert_eq!(counted[1], "b2:13");
    assert!(
        counted[2].starts_with("b3:") && counted[2] != "b3:13",
        "{counted:?}"
    );
}

/// `context_skip` before any call, `max_completion_tokens` counted like `max_tokens`, and
/// `context_fill` deciding where the line is.
#[tokio::test]
async fn context_skip_honours_max_completion_tokens_and_context_fill() {
    let small = MockUp::openai("name: small").await;
    let big = MockUp::openai("name: big").await;
    let cfg = |fill: &str| {
        format!(
            "models:\n  small: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 400 }}\n  big: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 100000 }}\nrouting_policy: {{ fallback_chain: [small, big], context_fill: {fill} }}\n",
            small.base(),
            big.base()
        )
    };
    let mut gw = Gw::start(&cfg("0.95"));
    let messages = json!([{"role": "user", "content": "word ".repeat(200)}]);
    let prompt = count_tokens(&gw, "small", &json!({ "messages": messages }));
    assert!(prompt < 380, "{prompt}");
    // prompt + completion = 390: over 95% of 400 (380), within 100%.
    let completion = 390 - prompt;
    for (id, field) in [("mt", "max_tokens"), ("mct", "max_completion_tokens")] {
        let r = gw
            .chat_id(
                id,
                json!({"model": "small", "messages": messages, field: completion}),
            )
            .await;
        assert_eq!(header(&r, "x-autohedge-endpoint"), "big", "{field}");
    }
    assert_eq!(small.requests().await, 0, "skipped before any call");
    gw.stop();
    for id in ["mt", "mct"] {
        let got = db_rows(
            &gw,
            &format!(
                "SELECT endpoint || ':' || class || ':' || COALESCE(error, '') FROM attempts WHERE request_id = '{id}' ORDER BY seq"
            ),
        );
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].starts_with("small:context_skip:"), "{got:?}");
        assert!(
            got[0].contains(&format!("needs {prompt} prompt + {completion} completion")),
            "{got:?}"
        );
        assert!(got[0].contains("= 380"), "{got:?}");
        assert_eq!(got[1], "big:ok:");
    }
    drop(gw);
    let gw = Gw::start(&cfg("1.0"));
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "small", "messages": messages, "max_tokens": completion}),
        )
        .await;
    assert_eq!(
        header(&r, "x-autohedge-endpoint"),
        "small",
        "390 fits 100% of 400"
    );
}

#[tokio::test]
async fn context_guard_skips_rejects_and_truncates() {
    let a = MockUp::openai("name: a").await;
    let cfg = format!(
        r#"
models:
  small: {{ type: openai, base_url: "{}", model: gpt-4o-mini, context_window: 400 }}
routing_policy:
  fallback_chain: [small]
  truncation: {{ keep_turns: 2, omission_note: true }}
routes:
  strict: [small]
  trimming: {{ chain: [small], on_context_overflow: truncate }}
"#,
        a.base()
    );
    let mut gw = Gw::start(&cfg);
    let convo = long_conversation();
    // Counted with o200k_base before any call: too big for 95% of 400, so nothing is sent.
    let r = gw
        .post(
            "/v1/chat/completions",
            json!({"model": "strict", "messages": convo}),
        )
        .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("400 tokens"),
        "{v}"
    );
    assert_eq!(a.requests().await, 0);

    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "trunc-1")
        .json(&json!({"model": "trimming", "max_tokens": 50, "messages": convo}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let trunc = header(&r, "x-autohedge-truncated");
    let (msgs, toks) = trunc
        .split_once('/')
        .expect("x-autohedge-truncated: messages/tokens");
    let (msgs, toks): (usize, u64) = (msgs.parse().unwrap(), toks.parse().unwrap());
    assert!(msgs > 0 && toks > 0, "{trunc}");
    let sent = a.stats().await["last_body"]["messages"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        sent.len() + msgs,
        convo.len() + 1,
        "dropped messages plus one note"
    );
    assert_eq!(sent[0], convo[0], "system message whole and first");
    assert!(sent[1]["content"].as_str().unwrap().contains("omitted"));
    // The latest two user turns are intact at the end.
    assert_eq!(&sent[sent.len() - 3..], &convo[convo.len() - 3..]);
    // A tool call never travels without its result, nor a result without its call.
    let calls = sent
        .iter()
        .filter(|m| m.get("tool_calls").is_some())
        .count();
    let results = sent.iter().filter(|m| m["role"] == "tool").count();
    assert_eq!(calls, results);
    // The tokio exchange is the most related to the last question: it survives the trim.
    assert!(sent.iter().any(|m| {
        m["content"]
            .as_str()
            .is_some_and(|c| c.contains("mpsc::channel::<u32>"))
    }));
    for m in &sent {
        if let Some(c) = m["content"].as_str() {
            assert_eq!(c.matches("```").count() % 2, 0, "a code fence was split");
        }
    }
    // What was sent fits: count it the way the gateway does.
    let out = std::process::Command::new(BIN)
        .args(["count-tokens", "--json", "--model", "small", "--config"])
        .arg(&gw.config_path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .unwrap()
                .write_all(json!({"messages": sent}).to_string().as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    let counted: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(counted["tokens"].as_u64().unwrap() + 50 <= 380, "{counted}");
    assert_eq!(counted["method"], "tiktoken o200k_base");
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let (tm, tt, counted): (i64, i64, i64) = conn
        .query_row("SELECT truncated_messages, truncated_tokens, prompt_tokens_counted FROM requests WHERE request_id = 'trunc-1'", [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap();
    assert_eq!((tm as usize, tt as u64), (msgs, toks));
    assert!(counted > 380);
}

/// `on_context_overflow` set on an endpoint, and in `routing_policy`, applies to requests naming
/// that endpoint (routes have their own: `context_guard_skips_rejects_and_truncates`).
#[tokio::test]
async fn on_context_overflow_on_an_endpoint_and_in_the_policy() {
    let a = MockUp::openai("name: a").await;
    let long: Vec<Value> = (0..30)
        .flat_map(|i| {
            [
                json!({"role": "user", "content": format!("question {i}: {}", "lorem ipsum ".repeat(10))}),
                json!({"role": "assistant", "content": format!("answer {i}: {}", "dolor sit ".repeat(10))}),
            ]
        })
        .chain([json!({"role": "user", "content": "the last question"})])
        .collect();
    let cases = [
        (
            "endpoint",
            "  a: { type: openai, base_url: \"BASE\", model: gpt-4o-mini, context_window: 400, on_context_overflow: truncate }\nrouting_policy: { on_context_overflow: reject }\n",
            200,
        ),
        (
            "policy",
            "  a: { type: openai, base_url: \"BASE\", model: gpt-4o-mini, context_window: 400 }\nrouting_policy: { on_context_overflow: truncate }\n",
            200,
        ),
        (
            "default",
            "  a: { type: openai, base_url: \"BASE\", model: gpt-4o-mini, context_window: 400 }\n",
            400,
        ),
    ];
    for (what, models, want) in cases {
        let gw = Gw::start(&format!("models:\n{}", models.replace("BASE", &a.base())));
        let r = gw
            .post(
                "/v1/chat/completions",
                json!({"model": "a", "messages": long}),
            )
            .await;
        assert_eq!(r.status().as_u16(), want, "{what}");
        if want == 200 {
            assert!(!header(&r, "x-autohedge-truncated").is_empty(), "{what}");
        }
    }
}

#[tokio::test]
async fn context_length_fails_over_only_to_larger_windows() {
    let small = MockUp::openai("context_window: 80").await;
    let same = MockUp::openai("name: same").await;
    let big = MockUp::openai("name: big").await;
    let vague = MockUp::openai("rules: [{status: 400, error: \"input length exceeds the context length\", error_code: context_length_exceeded}]").await;
    let cfg = format!(
        r#"
models:
  vague: {{ type: openai, base_url: "{}" }}
  small: {{ type: openai, base_url: "{}" }}
  same: {{ type: openai, base_url: "{}", context_window: 80 }}
  big: {{ type: openai, base_url: "{}", context_window: 100000 }}
routing_policy: {{ fallback_chain: [small, same, big] }}
routes:
  short: [small, same]
  vague_only: [vague]
"#,
        vague.base(),
        small.base(),
        same.base(),
        big.base()
    );
    let gw = Gw::start(&cfg);
    let long = "lorem ipsum ".repeat(100);
    let r = gw.chat("small", &long).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(header(&r, "x-autohedge-attempts"), "2");
    assert_eq!(
        same.requests().await,
        0,
        "an endpoint with no larger window is skipped"
    );
    // small's refusal stated its limit: it is learned, kept, and used from the next request.
    assert_eq!(
        gw.status().await["endpoints"]["small"]["learned_context_window"],
        80
    );
    let r = gw.chat("small", &long).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    assert_eq!(
        small.requests().await,
        1,
        "skipped before the call this time"
    );
    // A short prompt still goes to small.
    let r = gw.chat("small", "hi").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "small");
    // Context errors do not count against the endpoint.
    assert_eq!(
        gw.status().await["endpoints"]["small"]["totals"]["failures"],
        0
    );
    // Nothing fits: a 400 that says the counted tokens and the largest window.
    let r = gw.chat("short", &long).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("largest context window in its chain is 80 tokens"),
        "{msg}"
    );
    // A refusal that states no limit, with nothing else to try: the upstream's own 400.
    let r = gw.chat("vague_only", &long).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "vague");
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["error"]["message"],
        "input length exceeds the context length"
    );
}

#[tokio::test]
async fn a_stated_context_limit_is_learned_and_recorded() {
    let a = MockUp::openai(
        "rules: [{status: 400, times: 1, error: \"This model's maximum context length is 300 tokens. However, your messages resulted in 900 tokens.\", error_code: context_length_exceeded}]",
    )
    .await;
    let b = MockUp::openai("name: b").await;
    let mut gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n  b: {{ type: openai, base_url: \"{}\", context_window: 128000 }}\n",
        a.base(),
        b.base()
    ));
    let r = gw
        .chat_id(
            "teacher-1",
            json!({"model": "a", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(a.requests().await, 1);
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["a"]["learned_context_window"], 300);
    assert_eq!(
        st["endpoints"]["a"]["learned_context_window_request"],
        "teacher-1"
    );
    gw.stop();
    let ev = db_rows(
        &gw,
        "SELECT event || ': ' || reason FROM endpoint_events WHERE endpoint = 'a'",
    );
    assert_eq!(
        ev,
        vec![
            "context_window_learned: upstream stated a context limit of 300 tokens (request teacher-1)"
        ]
    );
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

#[tokio::test]
async fn payload_hygiene_and_learned_limits_persist() {
    let a = MockUp::openai("name: a").await;
    let tmp = tempfile::tempdir().unwrap();
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", payload_hygiene: strip }}\n",
        a.base()
    );
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("x-request-id", "hyg-1")
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "line\u{2028}sep\u{0007}bell\nnewline\ttab"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        a.stats().await["last_body"]["messages"][0]["content"],
        "linesepbell\nnewline\ttab"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let n: i64 = one(
        &conn,
        "SELECT sanitized_chars FROM requests WHERE request_id = 'hyg-1'",
    );
    assert_eq!(n, 2);

    // A limit learned from an upstream error survives a restart.
    a.set_script("context_window: 80").await;
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, context_window: 100000 }}\n",
        a.base()
    );
    let mut gw = Gw::start_in(tmp.path(), &cfg, &[]);
    let r = gw.chat("a", &"word ".repeat(100)).await;
    assert_eq!(r.status(), 400, "nothing larger to try");
    // The bound fit the configured window, so nothing was counted before the upstream refused:
    // the refusal counts it, to say what the prompt needs.
    let msg = r.json::<Value>().await.unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("needs 108 prompt tokens"), "{msg}");
    assert_eq!(
        gw.status().await["endpoints"]["a"]["learned_context_window"],
        80
    );
    gw.stop();
    let gw = Gw::start_in(tmp.path(), &cfg, &[]);
    assert_eq!(
        gw.status().await["endpoints"]["a"]["learned_context_window"],
        80
    );
    let before = a.requests().await;
    let r = gw.chat("a", &"word ".repeat(100)).await;
    assert_eq!(r.status(), 400);
    assert_eq!(
        a.requests().await,
        before,
        "skipped before calling, from the learned limit"
    );
}

#[tokio::test]
async fn escape_hygiene_keeps_the_text_the_model_reads() {
    let a = MockUp::openai("name: a").await;
    let gw = Gw::start(&format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", payload_hygiene: escape }}\n",
        a.base()
    ));
    let text = "line\u{2028}sep\u{2029}para\ttab\r\n";
    let r = gw.chat("a", text).await;
    assert_eq!(r.status(), 200);
    let st = a.stats().await;
    assert_eq!(
        st["last_body"]["messages"][0]["content"], text,
        "the decoded text is identical"
    );
    // On the wire the line and paragraph separators went as `\uXXXX` escapes, never raw: the
    // decoded JSON above would be the same without hygiene, the bytes are not.
    let raw = st["last_raw_body"].as_str().unwrap();
    assert!(
        raw.contains(r#""line\u2028sep\u2029para\ttab\r\n""#),
        "escaped on the wire: {raw}"
    );
    assert!(
        !raw.contains(['\u{2028}', '\u{2029}']),
        "nothing raw: {raw}"
    );
}

/// A loopback upstream for `backend_tokenize`: `POST /tokenize` answers 200 with a valid JSON
/// body of `TOTAL` bytes — `{"count":7777,` then spaces, then `"tokens":[]}` — so a gateway that
/// held it whole would parse it and count 7,777 tokens; `POST /v1/chat/completions` answers a
/// small chat completion; GETs a one-model list (probes pass). `written` is how much of the
/// `/tokenize` body the gateway let this server write; `released` says a write failed (the
/// gateway hung up on the answer).
struct BigTokenize {
    addr: std::net::SocketAddr,
    written: std::sync::Arc<std::sync::atomic::AtomicU64>,
    released: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tokenize_calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
    chat_calls: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl BigTokenize {
    /// 160 MiB: well past the 64 MiB cap plus whatever the sockets' buffers hold.
    const TOTAL: u64 = 160 << 20;

    fn start() -> BigTokenize {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let released = Arc::new(AtomicBool::new(false));
        let tokenize_calls = Arc::new(AtomicU64::new(0));
        let chat_calls = Arc::new(AtomicU64::new(0));
        let (r, t, c) = (released.clone(), tokenize_calls.clone(), chat_calls.clone());
        // Keep-alive: more requests may follow on the same connection.
        let up = RawUp::with_release(
            move |req| {
                if req.method == "GET" {
                    return Answer::full(
                        "200 OK",
                        "application/json",
                        r#"{"object":"list","data":[{"id":"my-llama","object":"model"}]}"#,
                    );
                }
                if req.path == "/tokenize" {
                    t.fetch_add(1, Ordering::SeqCst);
                    let prefix = "{\"count\":7777,";
                    let suffix = "\"tokens\":[]}";
                    let piece = vec![b' '; 64 << 10];
                    let pieces = BigTokenize::TOTAL / piece.len() as u64;
                    let len =
                        prefix.len() as u64 + pieces * piece.len() as u64 + suffix.len() as u64;
                    return Answer::Stream {
                        head: format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len}\r\n\r\n{prefix}"
                        )
                        .into_bytes(),
                        credit: piece.len() as u64,
                        cap: pieces * piece.len() as u64,
                        piece,
                        then: Then::Finish(suffix.as_bytes().to_vec()),
                    };
                }
                c.fetch_add(1, Ordering::SeqCst);
                Answer::full(
                    "200 OK",
                    "application/json",
                    r#"{"id":"chatcmpl-big","object":"chat.completion","created":1700000000,"model":"my-llama","choices":[{"index":0,"message":{"role":"assistant","content":"counted locally"},"finish_reason":"stop"}],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}"#,
                )
            },
            move |_| r.store(true, Ordering::SeqCst),
        );
        BigTokenize {
            addr: up.addr,
            written: up.written_counter(),
            released,
            tokenize_calls,
            chat_calls,
        }
    }

    fn load(a: &std::sync::atomic::AtomicU64) -> u64 {
        a.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// An upstream whose `/tokenize` answer is larger than 64 MiB is not held whole: the gateway
/// reads it no further than 64 MiB (and what the sockets' buffers take), hangs up on it, falls
/// back to its local count, and the request is served as usual.
///
/// docs/errors.md (a 2xx answer larger than `server.max_response_bytes`): "Probe answers stop at
/// 8 MiB (a failed probe), `/tokenize` answers at 64 MiB, error bodies at 64 KiB: nothing an
/// upstream sends grows the gateway's memory without bound".
/// docs/configuration.md (`models.<name>.backend_tokenize`): "Ask the backend for an exact
/// prompt count (`vllm`: POST /tokenize with the messages; `llamacpp`: POST /tokenize with the
/// text), falling back to the local count." docs/routing.md: "`backend_tokenize: vllm |
/// llamacpp` asks the backend's own `/tokenize` (timeout `tokenize_timeout`, default 300 ms;
/// cached), falling back to the local count".
///
/// `tokenize_timeout` is 60 s here so that only the cap can stop the read: without it, the whole
/// 160 MiB would be read (loopback, a few seconds) and parsed to 7,777 tokens.
///
/// Fails if: `backend_count` (src/upstream/tokenize.rs) reads the answer without its 64 MiB
/// limit (`r.bytes()`, or `reqwest_body` with a larger limit): the server then writes all
/// 160 MiB and the audit row's `prompt_tokens_counted` is 7777; or if a `/tokenize` answer past
/// the cap failed the request instead of falling back to the local count.
#[tokio::test]
async fn a_tokenize_answer_past_64_mib_is_cut_and_the_local_count_used() {
    use serde_json::json;
    use std::time::Duration;

    let up = BigTokenize::start();
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"http://{}/v1\", model: my-llama, context_window: 100000, backend_tokenize: vllm, tokenize_timeout: 60s, timeouts: {{ total: 120s }} }}\nhealth: {{ probe_interval: 1h }}\n",
        up.addr
    );
    let mut gw = Gw::start(&cfg);
    gw.ready().await;
    let r = gw
        .chat_id(
            "big-tokenize",
            json!({"model": "a", "messages": [{"role": "user", "content": "count me please"}]}),
        )
        .await;
    // The backend was asked, its answer went past the cap, and the request was served all the
    // same by the endpoint.
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "a");
    assert_eq!(
        BigTokenize::load(&up.tokenize_calls),
        1,
        "the backend was asked"
    );
    assert_eq!(
        BigTokenize::load(&up.chat_calls),
        1,
        "the request was served upstream"
    );
    // The gateway hung up on the answer (the server's next write failed) …
    let released = eventually(Duration::from_secs(30), || async {
        up.released.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    let written = BigTokenize::load(&up.written);
    assert!(
        released,
        "the gateway never hung up on the /tokenize answer ({written} of {} bytes written)",
        BigTokenize::TOTAL
    );
    // … after reading past 64 MiB (the cap was reached, not a timeout or an early error) …
    assert!(
        written > 64 << 20,
        "only {written} bytes were written: the cap was not what stopped the read"
    );
    // … and no further than the sockets' buffers take: far from the whole answer.
    assert!(
        written < 100 << 20,
        "{written} bytes of the {} byte /tokenize answer were read",
        BigTokenize::TOTAL
    );
    gw.stop();
    // The count used is the gateway's own, not the 7,777 the whole answer says.
    let counted = audit_rows(
        &gw,
        "SELECT prompt_tokens_counted FROM requests WHERE request_id = 'big-tokenize'",
    );
    assert_eq!(counted.len(), 1, "{counted:?}");
    let n = counted[0][0].as_u64();
    assert!(
        n.is_some_and(|n| n > 0 && n != 7777),
        "prompt_tokens_counted {:?}: the local count, not the cut answer's",
        counted[0][0]
    );
}
