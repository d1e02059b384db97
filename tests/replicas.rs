//! Many replicas of one model behind one endpoint (`base_urls`), against the real binary and
//! loopback servers: each attempt goes to a usable address by load, a broken replica is ejected
//! alone while the others serve, and comes back by a probe of its own; `/status` shows each
//! address. (Discovered Swarm tasks are balanced the same way: tests/swarm.rs.)

mod common;

use std::time::Duration;

use common::*;
use serde_json::Value;

fn chat_calls(stats: &Value) -> u64 {
    stats["by_path"]["/v1/chat/completions"]
        .as_u64()
        .unwrap_or(0)
}

fn replicas_cfg(urls: &[String], extra: &str) -> String {
    format!(
        "models:\n  m:\n    type: openai\n    base_urls: [{}]\n{extra}",
        urls.iter()
            .map(|u| format!("\"{u}\""))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// A burst of requests at once: each pick sees the ones before it in flight, so the burst
/// spreads over every replica.
async fn burst(gw: &Gw, n: usize, tag: &str) -> Vec<u16> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let url = gw.url("/v1/chat/completions");
        let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("{tag}{i}")}]});
        tasks.push(tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .json(&body)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// One replica of three answers 500 to every chat: the requests it failed are tried again at
/// once on another replica (no client sees them), it is ejected alone, and the endpoint serves
/// on with the other two; `/status` names it ejected and the others active.
#[tokio::test]
async fn a_broken_replica_is_ejected_alone_and_no_client_sees_it() {
    // The good ones slow at first, so the burst's requests pile up on them and reach the
    // broken one too.
    let good0 = MockUp::openai("name: r0\nrules: [{delay: 200ms}]").await;
    let good1 = MockUp::openai("name: r1\nrules: [{delay: 200ms}]").await;
    let bad =
        MockUp::openai("name: bad\nrules: [{when: {path: /v1/chat/completions}, status: 500}]")
            .await;
    let mut gw = Gw::start(&replicas_cfg(
        &[good0.base(), good1.base(), bad.base()],
        "health: { probe_interval: 1h, eject_after: 1, eject_base: 1h, eject_max: 1h }\n",
    ));
    gw.ready().await;
    // A burst first: it reaches every replica, the broken one too (the thing happened).
    let mut statuses = burst(&gw, 12, "b").await;
    let tried = chat_calls(&bad.stats().await);
    assert!(tried >= 1, "the burst reached the broken replica");
    // Every request of the burst answered by a good one (those the broken one failed too).
    let (b0, b1) = (
        chat_calls(&good0.stats().await),
        chat_calls(&good1.stats().await),
    );
    assert_eq!(b0 + b1, 12);
    assert!(
        b0 > 0 && b1 > 0,
        "the burst spread over both good replicas: {b0} and {b1}"
    );
    // (A new script starts the mocks' counts afresh.)
    good0.set_script("name: r0").await;
    good1.set_script("name: r1").await;
    // Then one at a time: none reaches it any more.
    for i in 0..30 {
        statuses.push(gw.chat("m", &format!("q{i}")).await.status().as_u16());
    }
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert_eq!(
        chat_calls(&bad.stats().await),
        tried,
        "calls after its ejection"
    );
    let (c0, c1) = (
        chat_calls(&good0.stats().await),
        chat_calls(&good1.stats().await),
    );
    assert_eq!(c0 + c1, 30, "every request served by the two good replicas");
    let st = gw.status().await;
    let addrs = st["endpoints"]["m"]["addresses"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(addrs.len(), 3, "{addrs:?}");
    for a in &addrs {
        let want = if a["url"] == bad.base() {
            "ejected"
        } else {
            "active"
        };
        assert_eq!(a["state"], want, "{a}");
        assert_eq!(a["in_flight"], 0, "nothing left in flight: {a}");
    }
    assert_eq!(
        st["endpoints"]["m"]["state"], "healthy",
        "the endpoint itself serves"
    );
    gw.stop();
    assert!(
        gw.db_text().contains("address_ejected"),
        "the ejection is in the trail"
    );
}

/// An ejected replica comes back by a probe of its own once its ejection is over, never by
/// client traffic, and then serves again.
#[tokio::test]
async fn an_ejected_replica_comes_back_by_its_own_probe() {
    // The good one slow at first, so the burst reaches the flaky one too.
    let good = MockUp::openai("name: good\nrules: [{delay: 200ms}]").await;
    let flaky = MockUp::openai(
        "name: flaky\nrules: [{when: {path: /v1/chat/completions}, status: 503, times: 1}]",
    )
    .await;
    let gw = Gw::start(&replicas_cfg(
        &[good.base(), flaky.base()],
        "health: { probe_interval: 300ms, eject_after: 1, eject_base: 1s, eject_max: 1s }\n",
    ));
    gw.ready().await;
    let statuses = burst(&gw, 8, "b").await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    assert!(
        chat_calls(&flaky.stats().await) >= 1,
        "the burst reached the flaky replica"
    );
    let ejected = eventually(Duration::from_secs(10), || async {
        gw.status().await["endpoints"]["m"]["addresses"]
            .as_array()
            .is_some_and(|a| a.iter().any(|a| a["state"] != "active"))
    })
    .await;
    assert!(ejected, "the flaky replica was ejected");
    // Back by its probe (its /v1/models passes) once its second is over.
    let back = eventually(Duration::from_secs(30), || async {
        gw.status().await["endpoints"]["m"]["addresses"]
            .as_array()
            .is_some_and(|a| a.iter().all(|a| a["state"] == "active"))
    })
    .await;
    assert!(back, "the ejected replica came back by its probe");
    // It serves again: with the other replica failing now, every request is answered by it.
    let before = chat_calls(&flaky.stats().await);
    good.set_script("rules: [{when: {path: /v1/chat/completions}, status: 500}]")
        .await;
    for i in 0..5 {
        assert_eq!(gw.chat("m", &format!("again{i}")).await.status(), 200);
    }
    assert!(
        chat_calls(&flaky.stats().await) > before,
        "the replica serves again after its probe passed"
    );
}

/// Load decides: a replica holding its answers long gets fewer of the requests sent at once
/// than an idle one, and every in-flight count is back to zero after.
#[tokio::test]
async fn a_busy_replica_gets_fewer_requests() {
    let fast = MockUp::openai("name: fast").await;
    let slow = MockUp::openai("name: slow\nrules: [{delay: 400ms}]").await;
    let gw = Gw::start(&replicas_cfg(
        &[fast.base(), slow.base()],
        "health: { probe_interval: 1h }\n",
    ));
    gw.ready().await;
    // Warm both estimates.
    for i in 0..6 {
        assert_eq!(gw.chat("m", &format!("w{i}")).await.status(), 200);
    }
    let before = (
        chat_calls(&fast.stats().await),
        chat_calls(&slow.stats().await),
    );
    let mut tasks = Vec::new();
    for i in 0..40 {
        let url = gw.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("c{i}")}]}))
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    let fast_n = chat_calls(&fast.stats().await) - before.0;
    let slow_n = chat_calls(&slow.stats().await) - before.1;
    assert_eq!(fast_n + slow_n, 40);
    assert!(fast_n > slow_n * 2, "fast {fast_n}, slow {slow_n}");
    let st = gw.status().await;
    for a in st["endpoints"]["m"]["addresses"].as_array().unwrap() {
        assert_eq!(a["in_flight"], 0, "{a}");
    }
}
