//! One gateway, many tenants: client keys and their limits, against the real binary. Who may call
//! which model (keys, digests, allow-lists that hold over fallback and hedges), `rpm` exact from
//! many connections at once, `tpm`, budgets exact under concurrency and across a restart, billed
//! failed attempts, spend that outlives dropped audit rows, and an open gateway warned about.
//! The admin surface is in `operator.rs`; Vault's part in `secrets.rs`.

mod common;

use common::*;
use serde_json::{Value, json};

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

/// The gateway's own 429 for a client key over its `rpm` or its `tpm` says how long to wait in
/// both forms, and the two agree: `retry-after` is `retry-after-ms` rounded up to whole seconds
/// (at least 1), both positive, and — a bucket refills whole within a minute, and a request no
/// larger than the limit never waits for more — at most a minute.
///
/// docs/security.md: "over `rpm`/`tpm`: 429 `rate_limit_exceeded` with `retry-after`,
/// `retry-after-ms` and OpenAI's own `x-ratelimit-{limit,remaining,reset}-{requests|tokens}`"
/// and "The 429 carries `retry-after`, `retry-after-ms` and
/// `x-ratelimit-{limit,remaining,reset}-tokens`."
/// docs/errors.md: "| 429 | `rate_limit_exceeded` | the client key's `rpm` or `tpm`, with
/// `retry-after`, `retry-after-ms` and `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` |"
///
/// Fails if: `ApiError::into_response` (src/error.rs) stops inserting `retry-after-ms` for
/// `ClientRateLimited`, writes it in another unit than milliseconds (seconds, microseconds) or
/// from another duration than `retry-after`'s, rounds `retry-after` down (a client retrying then
/// is refused again), or sends 0 for either; or if the limiter's `retry_after` for `rpm` (GCRA)
/// or `tpm` (token bucket) stops being the real wait.
#[tokio::test]
async fn the_gateways_own_429_carries_retry_after_ms_consistent_with_retry_after() {
    use serde_json::{Value, json};

    const RPM_KEY: &str = "sk-rpm-key-0000000001";
    const TPM_KEY: &str = "sk-tpm-key-0000000001";
    let up = MockUp::openai("name: up").await;
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}" }}
auth:
  keys:
    - {{ name: per-minute, key: {RPM_KEY}, rpm: 1 }}
    - {{ name: per-tokens, key: {TPM_KEY}, tpm: 100 }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let mut gw = Gw::start(&cfg);
    gw.ready().await;
    // `max_tokens: 80` plus a prompt of a few tokens: one such request fits `tpm: 100`, two do
    // not (tpm counts the prompt plus `max_tokens` at admission). `rpm: 1` lets one through.
    let call = |key: &'static str| {
        let url = gw.url("/v1/chat/completions");
        async move {
            reqwest::Client::new()
                .post(url)
                .bearer_auth(key)
                .json(&json!({"model": "a", "max_tokens": 80, "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap()
        }
    };

    // First, each key's allowance is really spent: its first request reached the upstream.
    for key in [RPM_KEY, TPM_KEY] {
        let r = call(key).await;
        assert_eq!(r.status(), 200, "{key}'s first request is within its limit");
    }
    assert_eq!(
        up.requests().await,
        2,
        "both first requests were served upstream"
    );

    for (key, kind, limit) in [(RPM_KEY, "requests", "1"), (TPM_KEY, "tokens", "100")] {
        let r = call(key).await;
        assert_eq!(r.status(), 429, "{key}: over its {kind} limit");
        // The gateway's own 429 (the key's limit), not an upstream's.
        assert_eq!(header(&r, &format!("x-ratelimit-limit-{kind}")), limit);
        // What is left is less than the request needs: none for `rpm`, some tokens for `tpm`.
        let remaining: u64 = header(&r, &format!("x-ratelimit-remaining-{kind}"))
            .parse()
            .unwrap_or_else(|_| panic!("{key}: {:?}", r.headers()));
        if kind == "requests" {
            assert_eq!(remaining, 0, "{key}");
        } else {
            assert!(remaining < 80, "{key}: remaining {remaining}");
        }
        assert!(
            header(&r, &format!("x-ratelimit-reset-{kind}")).ends_with("ms"),
            "{:?}",
            r.headers()
        );
        let secs: u64 = header(&r, "retry-after")
            .parse()
            .unwrap_or_else(|_| panic!("{key}: retry-after is whole seconds: {:?}", r.headers()));
        let ms: u64 = header(&r, "retry-after-ms").parse().unwrap_or_else(|_| {
            panic!(
                "{key}: retry-after-ms is present and a number: {:?}",
                r.headers()
            )
        });
        assert!(secs >= 1, "{key}: retry-after {secs}");
        assert!(ms > 0, "{key}: retry-after-ms {ms}");
        // The same wait twice: retry-after is retry-after-ms rounded up to a whole second.
        assert!(
            ms <= secs * 1000 && secs * 1000 <= ms + 1000,
            "{key}: retry-after {secs} s does not round up retry-after-ms {ms}"
        );
        // Milliseconds, not another unit: a minute's bucket never asks for more than a minute
        // from a request no larger than its limit.
        assert!(
            ms <= 60_000,
            "{key}: retry-after-ms {ms} is more than a minute"
        );
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    }
    assert_eq!(
        up.requests().await,
        2,
        "the refused requests never reached the upstream"
    );
    gw.stop();
}
