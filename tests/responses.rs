//! The Responses API across replicas: a `/v1/responses` conversation begun on one gateway
//! continues on another through the shared store (`cluster:`, a real Redis 7 started here as in
//! `cluster.rs`). The rest of the Responses API is in `neighbour.rs`, `tests/sdk`,
//! `tests/llamacpp` and `tests/vllm`.

mod common;

use std::time::{Duration, Instant};

use common::redis_server::Redis;
use common::*;
use serde_json::{Value, json};

fn start(cfg: &str, redis_url: &str) -> Gw {
    Gw::start_with_env(
        cfg,
        &[
            ("TEAM_KEY", TEAM),
            ("TOKENS_KEY", TOKENS),
            ("WIDE_KEY", WIDE),
            ("AUTOHEDGE_REDIS_URL", redis_url),
        ],
    )
}

/// A `/v1/responses` conversation begun on one replica continues on another: the pin (the
/// endpoint and the upstream's own id for the response) and the kept history go through the
/// store. Shown first on the upstream that speaks the Responses API — it 404s an id it did not
/// give, so its answer proves B sent the upstream's id — then on one that speaks only chat, which
/// must receive the whole conversation from B.
#[tokio::test]
async fn a_conversation_continues_on_another_replica() {
    let redis = Redis::start();
    let native = MockUp::openai("name: native\nreply: \"Hi Ada.\"").await;
    let chat = MockUp::start(
        autohedge::demo::mock::Flavor::Ollama,
        "name: chat\nreply: \"Hi again.\"\nmodels: [qwen]",
    )
    .await;
    // `timeout: 2s`: B's reads of the turn are bounded by it and a late answer reads as "not
    // found"; generous, since this test is not about the timeout (an unknown id is answered
    // at once, so nothing waits it on a healthy run).
    let cfg = format!(
        r#"models:
  native: {{ type: openai, base_url: "{}" }}
  chat: {{ type: ollama, base_url: "http://{}", model: qwen }}
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "conv:", timeout: 2s }}
health: {{ probe_interval: 1h }}
"#,
        native.base(),
        chat.addr
    );
    let (a, b) = (start(&cfg, &redis.url()), start(&cfg, &redis.url()));
    until_clustered(&[&a, &b], 2).await;
    let c = reqwest::Client::new();
    let ask = |gw: &Gw, body: Value| {
        let req = c.post(gw.url("/v1/responses")).json(&body);
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    for (model, upstream) in [("native", &native), ("chat", &chat)] {
        let (s, first) = ask(&a, json!({"model": model, "input": "My name is Ada."})).await;
        assert_eq!(s, 200, "{first}");
        let id = first["id"].as_str().unwrap().to_string();
        // B never saw it: it reads the turn (with the store's answer, within cluster.timeout).
        // (A shares the turn off its request path: B is asked until it is there; generous, as
        // it must come, and it ends as soon as it does.)
        let body = json!({"model": model, "input": "Who am I?", "previous_response_id": id});
        let deadline = Instant::now() + Duration::from_secs(30);
        let (ok, second) = loop {
            let (s, v) = ask(&b, body.clone()).await;
            if s == 200 || Instant::now() > deadline {
                break (s == 200, v);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(ok, "{model}: {second}");
        assert_eq!(second["previous_response_id"], id.as_str(), "{model}");
        let sent = upstream.stats().await["last_body"].clone();
        if model == "native" {
            let up = sent["previous_response_id"].as_str().unwrap();
            assert!(
                up.starts_with("resp_") && up != id,
                "the upstream's own id: {sent}"
            );
        } else {
            let texts: Vec<&str> = sent["messages"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|m| m["content"].as_str())
                .collect();
            assert_eq!(
                texts,
                ["My name is Ada.", "Hi again.", "Who am I?"],
                "{sent}"
            );
        }
        // Read back on B by A's id; an unknown id is still unknown.
        let got: Value = c
            .get(b.url(&format!("/v1/responses/{id}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(got["id"], id.as_str(), "{got}");
    }
    let (s, v) = ask(
        &b,
        json!({"model": "native", "input": "x", "previous_response_id": format!("resp_{}", "0".repeat(48))}),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("previous_response_not_found"))
    );
}
