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
/// than an idle one (P2C over latency × load; affinity off, as each request here is a
/// conversation of its own), and every in-flight count is back to zero after.
#[tokio::test]
async fn a_busy_replica_gets_fewer_requests() {
    let fast = MockUp::openai("name: fast").await;
    let slow = MockUp::openai("name: slow\nrules: [{delay: 400ms}]").await;
    let gw = Gw::start(&replicas_cfg(
        &[fast.base(), slow.base()],
        "    balance: { affinity: none }\nhealth: { probe_interval: 1h }\n",
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

/// Each mock's calls to `path`, in order.
async fn calls(mocks: &[&MockUp], path: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for m in mocks {
        out.push(m.stats().await["by_path"][path].as_u64().unwrap_or(0));
    }
    out
}

/// The one mock whose count of `path` grew since `before` (sequential requests only).
async fn served_by(mocks: &[&MockUp], path: &str, before: &[u64]) -> usize {
    let now = calls(mocks, path).await;
    let grew: Vec<usize> = (0..mocks.len()).filter(|&i| now[i] > before[i]).collect();
    assert_eq!(grew.len(), 1, "one replica served: {before:?} -> {now:?}");
    grew[0]
}

/// A multi-turn chat stays on the replica that served its first turn (its prefix cache), and
/// different conversations spread over the replicas; every turn's audit attempt names the
/// address that served it.
#[tokio::test]
async fn a_conversation_stays_on_its_replica_and_conversations_spread() {
    let (r0, r1, r2) = (
        MockUp::openai("name: r0").await,
        MockUp::openai("name: r1").await,
        MockUp::openai("name: r2").await,
    );
    let mocks = [&r0, &r1, &r2];
    let mut gw = Gw::start(&replicas_cfg(
        &[r0.base(), r1.base(), r2.base()],
        "health: { probe_interval: 1h }\n",
    ));
    gw.ready().await;
    let path = "/v1/chat/completions";
    let mut homes = Vec::new();
    for c in 0..16 {
        let mut messages = vec![
            serde_json::json!({"role": "system", "content": "You are a travel agent."}),
            serde_json::json!({"role": "user", "content": format!("Plan trip {c}.")}),
        ];
        let mut home = None;
        for turn in 0..4 {
            let before = calls(&mocks, path).await;
            let r = gw
                .post(
                    "/v1/chat/completions",
                    serde_json::json!({"model": "m", "messages": messages}),
                )
                .await;
            assert_eq!(r.status(), 200);
            let at = served_by(&mocks, path, &before).await;
            match home {
                None => home = Some(at),
                Some(h) => assert_eq!(at, h, "conversation {c}, turn {turn} moved"),
            }
            messages.push(serde_json::json!({"role": "assistant", "content": "Sure."}));
            messages.push(serde_json::json!({"role": "user", "content": format!("More {turn}.")}));
        }
        homes.push(home.unwrap());
    }
    let used: std::collections::BTreeSet<usize> = homes.iter().copied().collect();
    assert!(
        used.len() >= 2,
        "16 conversations on one replica: {homes:?}"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let rows: Vec<Option<String>> = conn
        .prepare("SELECT address FROM attempts WHERE class = 'ok'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 64, "one attempt row a turn");
    let bases: Vec<String> = mocks.iter().map(|m| m.base()).collect();
    for a in &rows {
        assert!(
            a.as_ref().is_some_and(|a| bases.contains(a)),
            "the attempt names the address that served: {a:?}"
        );
    }
}

/// `balance: { strategy: random, affinity: none }`: one conversation's turns go anywhere.
#[tokio::test]
async fn without_affinity_one_conversation_spreads() {
    let (r0, r1) = (
        MockUp::openai("name: r0").await,
        MockUp::openai("name: r1").await,
    );
    let gw = Gw::start(&replicas_cfg(
        &[r0.base(), r1.base()],
        "    balance: { strategy: random, affinity: none }\nhealth: { probe_interval: 1h }\n",
    ));
    gw.ready().await;
    for _ in 0..30 {
        assert_eq!(gw.chat("m", "the same first message").await.status(), 200);
    }
    let (a, b) = (chat_calls(&r0.stats().await), chat_calls(&r1.stats().await));
    assert_eq!(a + b, 30);
    assert!(
        a > 0 && b > 0,
        "one conversation on both replicas: {a} and {b}"
    );
}

/// A Responses conversation passed through to replicas that keep it under their own ids (as
/// vLLM's `/v1/responses` does): every later turn goes to the replica that holds it — whatever
/// the balance says — so none is refused with "previous response not found".
#[tokio::test]
async fn a_native_responses_conversation_goes_back_to_the_replica_that_holds_it() {
    let (r0, r1, r2) = (
        MockUp::openai("name: r0").await,
        MockUp::openai("name: r1").await,
        MockUp::openai("name: r2").await,
    );
    let mocks = [&r0, &r1, &r2];
    // Random and without affinity: only the pin keeps the turns together.
    let gw = Gw::start(&replicas_cfg(
        &[r0.base(), r1.base(), r2.base()],
        "    balance: { strategy: random, affinity: none }\nhealth: { probe_interval: 1h }\n",
    ));
    gw.ready().await;
    let path = "/v1/responses";
    for c in 0..4 {
        let before = calls(&mocks, path).await;
        let r = gw
            .post(
                path,
                serde_json::json!({"model": "m", "input": format!("Hello {c}.")}),
            )
            .await;
        assert_eq!(r.status(), 200);
        let mut id = r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let home = served_by(&mocks, path, &before).await;
        for turn in 0..5 {
            let before = calls(&mocks, path).await;
            let r = gw
                .post(
                    path,
                    serde_json::json!({"model": "m", "input": format!("Turn {turn}."), "previous_response_id": id}),
                )
                .await;
            let status = r.status();
            let v = r.json::<Value>().await.unwrap();
            assert_eq!(status, 200, "conversation {c}, turn {turn}: {v}");
            assert_eq!(
                served_by(&mocks, path, &before).await,
                home,
                "conversation {c}, turn {turn} left its replica"
            );
            // The replica was given its own id for the conversation (it was passed through).
            let sent = mocks[home].stats().await["last_body"]["previous_response_id"].clone();
            assert!(
                sent.as_str()
                    .is_some_and(|s| s.starts_with("resp_") && s != id),
                "{sent}"
            );
            id = v["id"].as_str().unwrap().to_string();
        }
    }
}

/// A stream is load on its replica until its last byte: the address counts it in flight while
/// the client reads, and not after.
#[tokio::test]
async fn a_stream_counts_in_flight_until_its_end() {
    let (r0, r1) = (
        MockUp::openai(
            "name: r0\nchunk_delay: 150ms\nreply: one two three four five six seven eight nine ten",
        )
        .await,
        MockUp::openai(
            "name: r1\nchunk_delay: 150ms\nreply: one two three four five six seven eight nine ten",
        )
        .await,
    );
    let gw = Gw::start(&replicas_cfg(
        &[r0.base(), r1.base()],
        "health: { probe_interval: 1h }\n",
    ));
    gw.ready().await;
    let mut resp = gw
        .post(
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "count"}]}),
        )
        .await;
    assert_eq!(resp.status(), 200);
    // The stream has begun (its first bytes are here): it is in flight at one address.
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    let in_flight = |st: &Value| -> Vec<u64> {
        st["endpoints"]["m"]["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["in_flight"].as_u64().unwrap())
            .collect()
    };
    let during = in_flight(&gw.status().await);
    assert_eq!(during.iter().sum::<u64>(), 1, "{during:?}");
    let mut text = String::from_utf8_lossy(&first).into_owned();
    while let Some(b) = resp.chunk().await.unwrap() {
        text.push_str(&String::from_utf8_lossy(&b));
    }
    assert!(text.contains("[DONE]"), "{text}");
    let ok = eventually(Duration::from_secs(5), || async {
        in_flight(&gw.status().await).iter().sum::<u64>() == 0
    })
    .await;
    assert!(ok, "{:?}", in_flight(&gw.status().await));
}

/// `/metrics` has each address's in-flight count and ejections, and only the addresses the
/// config gives.
#[tokio::test]
async fn metrics_show_each_address() {
    let good = MockUp::openai("name: good").await;
    let bad =
        MockUp::openai("name: bad\nrules: [{when: {path: /v1/chat/completions}, status: 500}]")
            .await;
    let gw = Gw::start(&replicas_cfg(
        &[good.base(), bad.base()],
        "    balance: { strategy: random, affinity: none }\nhealth: { probe_interval: 1h, eject_after: 1, eject_base: 1h, eject_max: 1h }\n",
    ));
    gw.ready().await;
    let mut n = 0;
    while chat_calls(&bad.stats().await) == 0 && n < 60 {
        assert_eq!(gw.chat("m", &format!("q{n}")).await.status(), 200);
        n += 1;
    }
    assert_eq!(
        chat_calls(&bad.stats().await),
        1,
        "the bad replica was tried once"
    );
    let text = gw.metrics().await;
    for (url, ejections) in [(good.base(), 0), (bad.base(), 1)] {
        let line = format!(
            "autohedge_address_ejections_total{{endpoint=\"m\",address=\"{url}\"}} {ejections}"
        );
        assert!(text.contains(&line), "{line} in\n{text}");
        let line = format!("autohedge_address_in_flight{{endpoint=\"m\",address=\"{url}\"}} 0");
        assert!(text.contains(&line), "{line} in\n{text}");
    }
    assert_eq!(text.matches("autohedge_address_in_flight{").count(), 2);
}

/// vLLM replicas: the queue a replica's `/metrics` reports (fresh from the probe) is load, so
/// new requests go to the idle one.
#[tokio::test]
async fn a_vllm_replica_with_a_long_queue_gets_no_new_requests() {
    let busy = MockUp::start(
        autohedge::demo::mock::Flavor::Vllm,
        "name: busy\nwaiting: 60",
    )
    .await;
    let idle = MockUp::start(autohedge::demo::mock::Flavor::Vllm, "name: idle").await;
    let gw = Gw::start(&format!(
        "models:\n  m:\n    type: vllm\n    base_urls: [\"{}\", \"{}\"]\n    balance: {{ affinity: none }}\nhealth: {{ probe_interval: 200ms, vllm_max_waiting: 1000 }}\n",
        busy.base(),
        idle.base()
    ));
    gw.ready().await;
    let sampled = eventually(Duration::from_secs(10), || async {
        gw.status().await["endpoints"]["m"]["addresses"]
            .as_array()
            .is_some_and(|a| a.iter().any(|a| a["queue"] == 60))
    })
    .await;
    assert!(sampled, "{}", gw.status().await["endpoints"]["m"]);
    for i in 0..20 {
        assert_eq!(gw.chat("m", &format!("q{i}")).await.status(), 200);
    }
    assert_eq!(chat_calls(&idle.stats().await), 20);
    assert_eq!(chat_calls(&busy.stats().await), 0);
}

/// A chain of one endpoint of several addresses: a hedge goes to another address of it (never
/// the one the first copy went to), and the copy that answers first serves.
#[tokio::test]
async fn a_hedge_goes_to_another_address_of_the_same_endpoint() {
    let slow =
        MockUp::openai("name: slow\nrules: [{when: {path: /v1/chat/completions}, delay: 3s}]")
            .await;
    let fast = MockUp::openai("name: fast").await;
    let mut gw = Gw::start(&replicas_cfg(
        &[slow.base(), fast.base()],
        "    balance: { strategy: random, affinity: none }\n    hedge: { after: 100ms, max_extra: 100%, min_after: 50ms }\nhealth: { probe_interval: 1h }\n",
    ));
    gw.ready().await;
    // Until a first copy went to the slow address (each request: one chance in two).
    let mut sent = 0;
    while chat_calls(&slow.stats().await) == 0 && sent < 40 {
        assert_eq!(gw.chat("m", &format!("q{sent}")).await.status(), 200);
        sent += 1;
    }
    assert!(
        chat_calls(&slow.stats().await) >= 1,
        "a first copy went to the slow address"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    // The hedged requests: their attempts went to two addresses, and the fast one served.
    let hedged: Vec<(String, String, Option<String>)> = conn
        .prepare(
            "SELECT a.request_id, a.class, a.address FROM attempts a JOIN requests r ON r.id = a.request_row WHERE r.hedges > 0 ORDER BY a.request_row, a.seq",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert!(!hedged.is_empty(), "a request was hedged");
    let ids: std::collections::BTreeSet<&String> = hedged.iter().map(|(id, _, _)| id).collect();
    for id in ids {
        let rows: Vec<_> = hedged.iter().filter(|(i, _, _)| i == id).collect();
        let served: Vec<_> = rows.iter().filter(|(_, c, _)| c == "ok").collect();
        assert_eq!(served.len(), 1, "{rows:?}");
        assert_eq!(
            served[0].2.as_deref(),
            Some(fast.base().as_str()),
            "{rows:?}"
        );
        assert!(
            rows.iter()
                .any(|(_, c, a)| c == "hedge_cancelled"
                    && a.as_deref() == Some(slow.base().as_str())),
            "the first copy, at the slow address, was cancelled: {rows:?}"
        );
    }
}

/// A request whose attempt failed at one address tries the others, never that one again
/// (before, a retry drew its address anew and could land on the failed one twice more, and the
/// client got a 503 while two replicas served).
#[tokio::test]
async fn a_request_never_retries_the_address_that_failed_it() {
    let bad =
        MockUp::openai("name: bad\nrules: [{when: {path: /v1/chat/completions}, status: 500}]")
            .await;
    let (g0, g1) = (
        MockUp::openai("name: g0").await,
        MockUp::openai("name: g1").await,
    );
    // Never ejected (100 in a row), drawn at random: only the request's own memory keeps its
    // retries away from the bad address.
    let mut gw = Gw::start(&replicas_cfg(
        &[bad.base(), g0.base(), g1.base()],
        "    balance: { strategy: random, affinity: none }\nhealth: { probe_interval: 1h, eject_after: 100 }\n",
    ));
    gw.ready().await;
    for i in 0..40 {
        assert_eq!(gw.chat("m", &format!("q{i}")).await.status(), 200);
    }
    assert!(
        chat_calls(&bad.stats().await) >= 1,
        "the bad address was tried"
    );
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let twice: i64 = conn
        .query_row(
            "SELECT COUNT(*) FROM (SELECT request_row, address FROM attempts WHERE address IS NOT NULL GROUP BY request_row, address HAVING COUNT(*) > 1)",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(twice, 0, "an address tried twice for one request");
}

/// A replica whose process died is ejected by its own probes, before any client's request
/// finds it; the others serve.
#[tokio::test]
async fn a_dead_replica_is_ejected_by_its_probes_alone() {
    let alive = MockUp::openai("name: alive").await;
    let dead = MockUp::openai("name: dead").await;
    let dead_base = dead.base();
    let mut gw = Gw::start(&replicas_cfg(
        &[alive.base(), dead_base.clone()],
        "health: { probe_interval: 200ms, eject_after: 2, eject_base: 1h, eject_max: 1h }\n",
    ));
    gw.ready().await;
    // Both probed and active first.
    let both = eventually(Duration::from_secs(10), || async {
        gw.status().await["endpoints"]["m"]["addresses"]
            .as_array()
            .is_some_and(|a| a.len() == 2 && a.iter().all(|a| a["state"] == "active"))
    })
    .await;
    assert!(both, "{}", gw.status().await["endpoints"]["m"]);
    drop(dead);
    let ejected = eventually(Duration::from_secs(20), || async {
        gw.status().await["endpoints"]["m"]["addresses"]
            .as_array()
            .is_some_and(|a| {
                a.iter()
                    .any(|a| a["url"] == dead_base.as_str() && a["state"] == "ejected")
            })
    })
    .await;
    assert!(ejected, "{}", gw.status().await["endpoints"]["m"]);
    assert_eq!(alive.requests().await, 0, "no client request was needed");
    for i in 0..10 {
        assert_eq!(gw.chat("m", &format!("q{i}")).await.status(), 200);
    }
    assert_eq!(chat_calls(&alive.stats().await), 10);
    let st = gw.status().await;
    assert_ne!(st["endpoints"]["m"]["state"], "unhealthy", "{st}");
    gw.stop();
    assert!(gw.db_text().contains("its probes failed in a row"));
}
