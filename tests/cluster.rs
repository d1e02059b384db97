//! `cluster:` against a real Redis 7 (Debian's `redis-server`, started here on a free loopback
//! port with persistence off; tests/run-all.sh installs it): several gateway processes share a
//! client key's limits and budget exactly, what one replica learns about an endpoint reaches the
//! others, and a store that is killed, frozen (SIGSTOP) or restarted empty never turns a request
//! into an error.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::redis_server::Redis;
use common::*;
use serde_json::{Value, json};

fn config(upstream: &MockUp, prefix: &str, timeout: &str, extra: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
auth:
  keys:
    - {{ name: team, key: env:TEAM_KEY, rpm: 60 }}
    - {{ name: tokens, key: env:TOKENS_KEY, tpm: 600 }}
    - {{ name: wide, key: env:WIDE_KEY, rpm: 600, tpm: 600000 }}
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "{prefix}", timeout: {timeout} }}
health: {{ probe_interval: 1h }}
{extra}"#,
        upstream.base()
    )
}

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

/// Three replicas of one config on one store.
fn start_three(cfg: &str, redis_url: &str) -> [Gw; 3] {
    [
        start(cfg, redis_url),
        start(cfg, redis_url),
        start(cfg, redis_url),
    ]
}

/// Waits until `gw` says the store is `up` again.
async fn until_up(gw: &Gw, what: &str) {
    let ok = eventually(Duration::from_secs(15), || async {
        gw.status().await["cluster"]["state"] == "up"
    })
    .await;
    assert!(ok, "{what}: {}", gw.status().await["cluster"]);
}

/// Sends `count` chat requests with `key`, spread round-robin over `gws`, all at once (each on
/// its own connection); returns the answers' statuses and headers, and how long the burst took.
async fn burst(
    gws: &[&Gw],
    key: &str,
    count: usize,
    body: Value,
) -> (Vec<(u16, reqwest::header::HeaderMap)>, Duration) {
    burst_of(gws, key, count, count.max(1), body).await
}

/// As [`burst`], with at most `at_once` requests in flight.
async fn burst_of(
    gws: &[&Gw],
    key: &str,
    count: usize,
    at_once: usize,
    body: Value,
) -> (Vec<(u16, reqwest::header::HeaderMap)>, Duration) {
    use futures_util::StreamExt;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let started = Instant::now();
    let got = futures_util::stream::iter((0..count).map(|i| {
        let url = gws[i % gws.len()].url("/v1/chat/completions");
        let (client, body) = (client.clone(), body.clone());
        let key = key.to_string();
        async move {
            let r = client
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.headers().clone())
        }
    }))
    .buffer_unordered(at_once)
    .collect::<Vec<_>>()
    .await;
    (got, started.elapsed())
}

/// A gateway's `/health` answer.
async fn health_of(gw: &Gw) -> Value {
    reqwest::get(gw.url("/health"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

fn count(got: &[(u16, reqwest::header::HeaderMap)], status: u16) -> usize {
    got.iter().filter(|(s, _)| *s == status).count()
}

/// Routing before the 429 counts the whole fleet's calls: each replica shares the upstream's
/// `x-ratelimit-*` answers it gets once a budget is at half or less, so three replicas against
/// an upstream bucket of 10 requests per 5 s (refilled continuously, as OpenAI's) send it
/// almost nothing it refuses. Returns (requests, 429s) for the run.
async fn fleet_against_a_bucket(clustered: bool) -> (u64, u64) {
    let redis = Redis::start();
    let limited = MockUp::openai("name: limited\nrate_limit: { requests: 10, per: 5s }").await;
    let spare = MockUp::openai("name: spare").await;
    let cluster = if clustered {
        "cluster: { redis: env:AUTOHEDGE_REDIS_URL, key_prefix: \"rl:\" }\n"
    } else {
        ""
    };
    let cfg = format!(
        "models:\n  limited: {{ type: openai, base_url: \"{}\" }}\n  spare: {{ type: openai, base_url: \"{}\" }}\nroutes:\n  chat: [limited, spare]\nhealth: {{ probe_interval: 1h }}\n{cluster}",
        limited.base(),
        spare.base()
    );
    let gws = start_three(&cfg, &redis.url());
    if clustered {
        until_clustered(&gws.iter().collect::<Vec<_>>(), 3).await;
    }
    for g in &gws {
        g.ready().await;
    }
    // 10 requests a second spread over the three for 8 s: five times the bucket's refill.
    let client = reqwest::Client::new();
    let mut sent = 0u64;
    let start_at = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    // After a stall of this runtime, the missed ticks do not fire back to back (three replicas
    // sent to at one moment, on shared state that had no time to spread): the cadence holds.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut pending = Vec::new();
    while start_at.elapsed() < Duration::from_secs(8) {
        tick.tick().await;
        let url = gws[sent as usize % 3].url("/v1/chat/completions");
        let c = client.clone();
        pending.push(tokio::spawn(async move {
            c.post(url)
                .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}))
                .send()
                .await
                .map(|r| r.status().as_u16())
        }));
        sent += 1;
    }
    for p in pending {
        assert_eq!(p.await.unwrap().unwrap(), 200, "every request served");
    }
    let mut refused = 0;
    let mut gws = gws;
    for g in gws.iter_mut() {
        g.stop();
        refused += audit_rows(
            g,
            "SELECT count(*) FROM attempts WHERE class = 'rate_limited'",
        )[0][0]
            .as_u64()
            .unwrap();
    }
    assert!(
        limited.requests().await > 5,
        "the limited endpoint served its share"
    );
    (sent, refused)
}

/// Three gateway processes behind one Redis admit exactly what one would: a key at `rpm: 60`
/// gets 60 of a 300-request burst spread over all three, and a key at `tpm: 600` asking 103
/// tokens a request gets 5. Without the shared store each would allow its own 60 (180).
#[tokio::test]
async fn three_replicas_admit_exactly_one_keys_limits() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    // A timeout far past any store answer under the burst, even from debug binaries on 2 busy
    // cores: a request the store does not answer in time is admitted on the replica's share,
    // which this test is not about (`a_frozen_store_costs_a_request_at_most_the_timeout` is).
    // A healthy run never waits it: the store answers in milliseconds.
    let cfg = config(&up, "exact:", "10s", "");
    let gws = start_three(&cfg, &redis.url());
    let gws: Vec<&Gw> = gws.iter().collect();
    until_clustered(&gws, 3).await;

    let hello = json!({"model": "a", "messages": [{"role": "user", "content": "Hello"}]});
    let (got, took) = burst(&gws, TEAM, 300, hello.clone()).await;
    assert_eq!(
        count(&got, 200) + count(&got, 429),
        300,
        "only 200s and 429s"
    );
    // One request a second refills: a burst slower than a second may earn that many more.
    let refilled = took.as_secs() as usize;
    let ok = count(&got, 200);
    assert!(
        (60..=60 + refilled).contains(&ok),
        "{ok} admitted of 300 in {took:?}"
    );
    assert_eq!(
        up.requests().await,
        ok as u64,
        "each admitted request reached the upstream"
    );
    let (_, refused) = got.iter().find(|(s, _)| *s == 429).unwrap();
    assert_eq!(refused["x-ratelimit-limit-requests"], "60");
    assert_eq!(refused["x-ratelimit-remaining-requests"], "0");
    assert!(refused.contains_key("retry-after"), "{refused:?}");

    // Each replica kept its own trail; `stats` and `report` given all three data dirs speak
    // for the fleet (and one alone does not).
    let fleet_stats = |dirs: &[&Gw]| {
        let mut c = Command::new(BIN);
        c.args(["stats", "--by-key", "--json", "--since", "1h"]);
        for gw in dirs {
            c.arg("--data-dir").arg(gw.data_dir());
        }
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v.as_array()
            .unwrap()
            .iter()
            .find(|r| r["key"] == "team")
            .cloned()
            .unwrap_or(json!({"requests": 0}))
    };
    let recorded = eventually(Duration::from_secs(10), || async {
        fleet_stats(&gws)["requests"] == 300
    })
    .await;
    let team = fleet_stats(&gws);
    assert!(recorded, "{team}");
    assert_eq!(team["served"], ok as u64, "{team}");
    assert_eq!(team["refused"], 300 - ok as u64, "{team}");
    assert!(
        fleet_stats(&gws[..1])["requests"].as_u64().unwrap() < 300,
        "one replica's trail alone holds part of the burst"
    );
    let mut c = Command::new(BIN);
    c.args(["report", "--since", "1h"]);
    for gw in &gws {
        c.arg("--data-dir").arg(gw.data_dir());
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(
        md.contains(&format!("| 300 | {ok} | 0 | {} |", 300 - ok)),
        "{md}"
    );

    // tpm: 3 estimated prompt tokens ("Hello" and "user", 4 characters a token) + 100.
    let asked = json!({"model": "a", "max_tokens": 100, "messages": [{"role": "user", "content": "Hello"}]});
    let (got, took) = burst(&gws, TOKENS, 30, asked).await;
    let ok = count(&got, 200);
    let refilled = (took.as_secs_f64() * 10.0 / 103.0) as usize;
    assert_eq!(count(&got, 200) + count(&got, 429), 30);
    assert!(
        (5..=5 + refilled).contains(&ok),
        "{ok} admitted in {took:?}"
    );
    let (_, refused) = got.iter().find(|(s, _)| *s == 429).unwrap();
    assert_eq!(refused["x-ratelimit-limit-tokens"], "600");
    // Every admission was the store's, and requests that asked together went in one call
    // (group commit): fewer calls than admissions, the counts exact all the same.
    let (mut decided, mut calls) = (0, 0);
    for gw in &gws {
        let st = gw.status().await;
        assert_eq!(st["cluster"]["local_admissions"], 0, "{}", st["cluster"]);
        decided += st["cluster"]["store_admissions"].as_u64().unwrap();
        calls += st["cluster"]["admission_calls"].as_u64().unwrap();
    }
    eprintln!("{decided} admissions in {calls} store calls");
    assert_eq!(decided, 330);
    assert!(calls < decided, "{decided} admissions in {calls} calls");
}

/// A key far from its limits is admitted on leases: each replica takes a share of the key's
/// buckets ahead (while they stay over half full) and spends it without a store call. The fleet
/// still admits exactly the key's limit: at `rpm: 600`, a 1,200-request burst spread over three
/// replicas gets 600 (plus what refills meanwhile), never more, and the refused carry the
/// limit's headers. Leases left unspent go back to the store.
#[tokio::test]
async fn leases_spare_the_store_and_keep_the_limit_exact() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    // Generous, as in `three_replicas_admit_exactly_one_keys_limits`: not about the timeout.
    let cfg = config(&up, "lease:", "10s", "");
    let gws = start_three(&cfg, &redis.url());
    let gws: Vec<&Gw> = gws.iter().collect();
    until_clustered(&gws, 3).await;
    let hello =
        json!({"model": "a", "max_tokens": 10, "messages": [{"role": "user", "content": "Hello"}]});
    let (got, took) = burst_of(&gws, WIDE, 1200, 150, hello).await;
    assert_eq!(
        count(&got, 200) + count(&got, 429),
        1200,
        "only 200s and 429s"
    );
    let ok = count(&got, 200);
    // Ten requests a second refill.
    let refilled = (took.as_secs_f64() * 10.0).ceil() as usize;
    let (mut leased, mut decided, mut calls, mut granted) = (0, 0, 0, 0);
    for gw in &gws {
        let st = gw.status().await;
        assert_eq!(st["cluster"]["local_admissions"], 0, "{}", st["cluster"]);
        leased += st["cluster"]["lease_admissions"].as_u64().unwrap();
        decided += st["cluster"]["store_admissions"].as_u64().unwrap();
        calls += st["cluster"]["admission_calls"].as_u64().unwrap();
        granted += st["cluster"]["leases_granted"].as_u64().unwrap();
    }
    eprintln!(
        "{ok} admitted of 1200 in {took:?}: {leased} on {granted} leases, {decided} by the store in {calls} calls"
    );
    // The leases were there and spent, and they are why the store was asked less.
    assert!(
        granted >= 3 && leased >= 8 * 3,
        "{leased} on {granted} leases"
    );
    assert_eq!(
        leased + decided,
        1200,
        "every request admitted once, somewhere"
    );
    assert!(
        (600..=600 + refilled).contains(&ok),
        "{ok} admitted of 1200 in {took:?} (limit 600, {refilled} refilled)"
    );
    assert_eq!(
        up.requests().await,
        ok as u64,
        "each admitted reached the upstream"
    );
    let (_, refused) = got.iter().find(|(s, _)| *s == 429).unwrap();
    assert_eq!(refused["x-ratelimit-limit-requests"], "600");
    assert_eq!(refused["x-ratelimit-remaining-requests"], "0");

    // Past their time the leases end in the store: nothing stays outstanding.
    // (An answer holds the two totals, or nothing once the key has expired.)
    let outstanding = || {
        redis
            .answer("HMGET lease:leaseamt:wide:600:600000 _r _t")
            .unwrap_or_default()
    };
    let values = |a: &str| -> Vec<String> {
        a.lines()
            .filter(|l| !l.starts_with('*') && !l.starts_with('$'))
            .map(str::to_string)
            .collect()
    };
    let ended = eventually(Duration::from_secs(5), || async {
        values(&outstanding()).iter().all(|v| v == "0")
    })
    .await;
    assert!(ended, "leases still outstanding: {}", outstanding());
}

/// The store killed: no request fails for it. Each replica admits on its own with the key's
/// limit split by the replicas it last saw (60 / 2 = 30 of a burst to one of two), `/health` says
/// `degraded` (`cluster_store_unreachable`), `/status.cluster` says `down`, and the
/// `cluster_store_down` alert fires once. Restarted empty on the same port, the store is used
/// again.
#[tokio::test]
async fn a_killed_store_splits_the_limits_and_comes_back() {
    let mut redis = Redis::start();
    let port = redis.port;
    let up = MockUp::openai("name: a").await;
    let (hook, hooked) = scripted_webhook(&[]).await;
    // A timeout no store answer misses on a busy machine (the first admission through a fresh
    // replica includes `admit.lua`'s NOSCRIPT round trips): a late answer would be a local
    // admission, which the exact counts below are not about. A killed store refuses at once,
    // so the outage never waits it.
    let cfg = config(
        &up,
        "killed:",
        "5s",
        &format!(
            "alerts: {{ webhooks: [{{ url: \"http://{hook}/hook\" }}], events: [cluster_store_down] }}\n"
        ),
    );
    let a = start(&cfg, &redis.url());
    let b = start(&cfg, &redis.url());
    until_clustered(&[&a, &b], 2).await;
    let hello = json!({"model": "a", "messages": [{"role": "user", "content": "Hello"}]});
    // The store answers first: a request admitted through it.
    let (got, _) = burst(&[&a], TEAM, 1, hello.clone()).await;
    assert_eq!(got[0].0, 200);
    assert_eq!(a.status().await["cluster"]["local_admissions"], 0);

    let killed_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    redis.kill();
    let (got, took) = burst(&[&a], TEAM, 100, hello.clone()).await;
    assert_eq!(
        count(&got, 200) + count(&got, 429),
        100,
        "no request failed for the store"
    );
    let ok = count(&got, 200);
    let refilled = (took.as_secs_f64() / 2.0) as usize + 1;
    assert!(
        (30..=30 + refilled).contains(&ok),
        "{ok} admitted alone in {took:?}"
    );
    let health = health_of(&a).await;
    assert_eq!(health["status"], "degraded", "{health}");
    assert!(
        health["reasons"]
            .as_array()
            .unwrap()
            .contains(&json!("cluster_store_unreachable")),
        "{health}"
    );
    let st = a.status().await;
    assert_eq!(st["cluster"]["state"], "down", "{}", st["cluster"]);
    assert!(st["cluster"]["local_admissions"].as_u64().unwrap() >= 100);
    assert!(st["cluster"]["last_error"].is_string());
    assert!(
        st["cluster"]["last_error_ms"].as_u64().unwrap() >= killed_ms,
        "the error is dated after the kill: {}",
        st["cluster"]
    );
    let alerted = eventually(Duration::from_secs(10), || async {
        hooked
            .lock()
            .unwrap()
            .iter()
            .any(|(_, _, b)| b.to_string().contains("cluster_store_down"))
    })
    .await;
    assert!(alerted, "the cluster_store_down alert was sent");
    // Both replicas met the outage (as each counts it) before the store comes back: `b`'s is
    // noticed at its heartbeat or its listener, whenever that comes.
    let noticed = eventually(Duration::from_secs(30), || async {
        a.status().await["cluster"]["outages"].as_u64() >= Some(1)
            && b.status().await["cluster"]["outages"].as_u64() >= Some(1)
    })
    .await;
    assert!(
        noticed,
        "both replicas met the outage: {} / {}",
        a.status().await["cluster"],
        b.status().await["cluster"]
    );

    // Back, empty: shared again.
    let redis = Redis::start_on(port);
    let ok = eventually(Duration::from_secs(15), || async {
        a.status().await["cluster"]["state"] == "up" && b.status().await["cluster"]["state"] == "up"
    })
    .await;
    assert!(
        ok,
        "the replicas reconnected: {}",
        a.status().await["cluster"]
    );
    let before = a.status().await["cluster"]["local_admissions"]
        .as_u64()
        .unwrap();
    let (got, _) = burst(&[&a, &b], TEAM, 10, hello.clone()).await;
    assert_eq!(count(&got, 200), 10, "a fresh store's bucket is full");
    assert_eq!(
        a.status().await["cluster"]["local_admissions"]
            .as_u64()
            .unwrap(),
        before,
        "admitted through the store again"
    );
    let health = health_of(&a).await;
    assert_eq!(health["status"], "ok", "{health}");
    assert!(redis.cmd("DBSIZE").unwrap().starts_with(':'));
    let store_down = || {
        hooked
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, _, b)| b["event"] == "cluster_store_down")
            .count()
    };
    let both = eventually(Duration::from_secs(30), || async { store_down() >= 2 }).await;
    assert!(both, "{} cluster_store_down alerts", store_down());
    // A moment for a duplicate to show (it can only make the exact count below fail).
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Once per replica for the outage, each naming itself.
    let mut sent: Vec<String> = hooked
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, _, b)| b["event"] == "cluster_store_down")
        .map(|(_, _, b)| b["detail"].as_str().unwrap().to_string())
        .collect();
    sent.sort();
    let (sa, sb) = (a.status().await, b.status().await);
    let mut named = vec![
        sent.iter()
            .filter(|d| d.contains(sa["cluster"]["replica"].as_str().unwrap()))
            .count(),
        sent.iter()
            .filter(|d| d.contains(sb["cluster"]["replica"].as_str().unwrap()))
            .count(),
    ];
    named.sort();
    assert_eq!((sent.len(), named), (2, vec![1, 1]), "{sent:?}");
    assert!(
        !sent
            .iter()
            .any(|d| d.contains(&redis.url()) && redis.url().contains('@'))
    );
}

/// A frozen store (SIGSTOP: the connection stays open, nothing answers) costs a request at most
/// `cluster.timeout` before it is admitted alone, and every request is answered.
#[tokio::test]
async fn a_frozen_store_costs_a_request_at_most_the_timeout() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    let cfg = config(&up, "frozen:", "25ms", "");
    let a = start(&cfg, &redis.url());
    until_clustered(&[&a], 1).await;
    let hello = json!({"model": "a", "messages": [{"role": "user", "content": "Hello"}]});
    let (got, _) = burst(&[&a], TEAM, 1, hello.clone()).await;
    assert_eq!(got[0].0, 200);

    redis.signal("STOP");
    let (got, _) = burst(&[&a], TEAM, 20, hello.clone()).await;
    redis.signal("CONT");
    assert_eq!(count(&got, 200), 20, "every request answered");
    let st = a.status().await["cluster"].clone();
    assert!(st["local_admissions"].as_u64().unwrap() >= 1, "{st}");
    // The request path gave up at `cluster.timeout`, as the gateway counts it (`last_error`
    // would say so too, unless the keeper's own 1 s check of the frozen store overwrote it
    // before this read: a matter of how long SIGSTOP, the burst and SIGCONT took).
    assert!(st["slow_answers"].as_u64().unwrap() >= 1, "{st}");
    until_up(&a, "back after SIGCONT").await;
}

/// A request whose client leaves while it waits on the store (its call to the store dropped
/// with it) does not leave its key waiting: the requests after it are decided by the store
/// again (in a call, or on the lease it brought), none admitted on its own for want of a call.
#[tokio::test]
async fn a_client_gone_mid_call_leaves_its_key_served_by_the_store() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    // A timeout long enough that the request is still waiting when its client leaves.
    let cfg = config(&up, "gone:", "3s", "");
    let a = start(&cfg, &redis.url());
    until_clustered(&[&a], 1).await;
    let hello = json!({"model": "a", "messages": [{"role": "user", "content": "Hello"}]});

    redis.signal("STOP");
    let left = reqwest::Client::new()
        .post(a.url("/v1/chat/completions"))
        .bearer_auth(TEAM)
        .json(&hello)
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        left.is_err(),
        "the client gave up while the store was frozen"
    );
    // The gateway saw it go (its request dropped with the call).
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.signal("CONT");
    until_up(&a, "back after SIGCONT").await;
    let before = a.status().await["cluster"].clone();
    let (got, _) = burst(&[&a], TEAM, 5, hello).await;
    assert_eq!(count(&got, 200), 5);
    let after = a.status().await["cluster"].clone();
    assert_eq!(
        after["local_admissions"], before["local_admissions"],
        "admitted on their own: {after}"
    );
    // Decided by the store: in a call, or on the lease a call brought (one replica: `rpm: 60`
    // leases 15).
    let by_store = |st: &Value| {
        st["store_admissions"].as_u64().unwrap() + st["lease_admissions"].as_u64().unwrap()
    };
    assert_eq!(by_store(&after), by_store(&before) + 5, "{after}");
    assert!(
        after["store_admissions"].as_u64().unwrap() > before["store_admissions"].as_u64().unwrap(),
        "a call was made: {after}"
    );
}

/// A store restarted empty is filled again from what the replicas know: a retirement replica A
/// learned before the restart is read by a replica started after it, which never calls the
/// endpoint.
#[tokio::test]
async fn a_store_restarted_empty_is_filled_with_what_the_replicas_know() {
    let mut redis = Redis::start();
    let port = redis.port;
    let gone = MockUp::openai(
        "rules: [{status: 410, error: \"The model gpt-4-0314 has been deprecated\"}]",
    )
    .await;
    let spare = MockUp::openai("name: spare").await;
    let cfg = format!(
        r#"models:
  gone: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  spare: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
routes:
  retire: [gone, spare]
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "refill:" }}
health: {{ probe_interval: 1h }}
"#,
        gone.base(),
        spare.base()
    );
    let a = start(&cfg, &redis.url());
    until_clustered(&[&a], 1).await;
    assert_eq!(
        header(&a.chat("retire", "hi").await, "x-autohedge-endpoint"),
        "spare"
    );
    assert_eq!(a.status().await["endpoints"]["gone"]["state"], "retired");
    let stored = eventually(Duration::from_secs(5), || async {
        redis.value("EXISTS refill:facts:gone").as_deref() == Some(":1")
    })
    .await;
    assert!(stored, "A stored the retirement");

    redis.kill();
    let redis = Redis::start_on(port);
    assert_eq!(
        redis.value("EXISTS refill:facts:gone").as_deref(),
        Some(":0")
    );
    let refilled = eventually(Duration::from_secs(15), || async {
        redis.value("EXISTS refill:facts:gone").as_deref() == Some(":1")
    })
    .await;
    assert!(
        refilled,
        "A filled the empty store: {}",
        a.status().await["cluster"]
    );

    let c = start(&cfg, &redis.url());
    until_clustered(&[&c], 2).await;
    let read = eventually(Duration::from_secs(5), || async {
        c.status().await["endpoints"]["gone"]["state"] == "retired"
    })
    .await;
    assert!(read, "C: {}", c.status().await["endpoints"]["gone"]);
    assert_eq!(
        header(&c.chat("retire", "hi").await, "x-autohedge-endpoint"),
        "spare"
    );
    assert_eq!(
        gone.requests().await,
        1,
        "only A ever called the retired endpoint"
    );
}

/// A key's `budget_usd` across three replicas: reservations live in the store, so concurrent
/// requests on all three overshoot the budget by at most one request's reservation, and every
/// admitted request's cost is in the shared spend once its settle is applied.
#[tokio::test]
async fn three_replicas_share_one_budget() {
    let redis = Redis::start();
    let up = MockUp::openai("name: a").await;
    // `timeout: 10s`: generous, not about the timeout. A store answer later than it would be
    // admitted on the replica's share and could overshoot the bounds below.
    let cfg = format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", model: gpt-4o-mini, cost: {{ input_per_mtok: 1000, output_per_mtok: 1000 }} }}
auth:
  keys:
    - {{ name: payer, key: env:TEAM_KEY, budget_usd: 0.1 }}
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "budget:", timeout: 10s }}
health: {{ probe_interval: 1h }}
"#,
        up.base()
    );
    let gws = start_three(&cfg, &redis.url());
    let gws: Vec<&Gw> = gws.iter().collect();
    until_clustered(&gws, 3).await;
    // Reserved: (3 prompt tokens estimated + 10) at $1,000 a million = $0.013 a request.
    let body =
        json!({"model": "a", "max_tokens": 10, "messages": [{"role": "user", "content": "Hello"}]});
    let mut admitted = 0;
    for _ in 0..4 {
        let (got, _) = burst(&gws, TEAM, 30, body.clone()).await;
        admitted += count(&got, 200);
        for (s, _) in &got {
            assert!(*s == 200 || *s == 429, "{s}");
        }
    }
    assert!(admitted > 0);
    let month = {
        let st = gws[0].status().await;
        let spend = &st["auth"]["spend_this_month_usd"];
        assert!(spend["payer"].as_f64().unwrap() > 0.0, "{st}");
        month_now()
    };
    // Every settle applied: no reservation left, the spend is every admitted request's cost.
    let settled = eventually(Duration::from_secs(10), || async {
        redis
            .value("GET budget:resvtot:payer")
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| v.abs() < 1e-9)
    })
    .await;
    assert!(
        settled,
        "reservations left: {:?}",
        redis.value("GET budget:resvtot:payer")
    );
    let spend: f64 = redis
        .value(&format!("HGET budget:spend:payer:{month} usd"))
        .unwrap()
        .parse()
        .unwrap();
    let mut carried = 0;
    for gw in &gws {
        carried += gw.status().await["cluster"]["settles_carried"]
            .as_u64()
            .unwrap();
    }
    eprintln!("{admitted} admitted, {carried} settles carried by admission calls");
    let per_request = spend / admitted as f64;
    assert!(
        per_request > 0.0 && per_request <= 0.013 + 1e-9,
        "{per_request}"
    );
    assert!(
        spend <= 0.1 + 0.013 + 1e-9,
        "overshot: {spend} for {admitted} requests"
    );
    assert!(
        spend >= 0.1 - 0.013,
        "stopped short: {spend} for {admitted} requests"
    );
    assert_eq!(up.requests().await, admitted as u64);

    // The store restarted empty: rebuilt from what the replicas know (each one's month as it
    // last saw the fleet's, plus its own costs since), never from nothing.
    let mut redis = redis;
    let port = redis.port;
    redis.kill();
    let redis = Redis::start_on(port);
    let mut known: f64 = 0.0;
    for g in &gws {
        let st = g.status().await;
        known = known.max(
            st["auth"]["spend_this_month_usd"]["payer"]
                .as_f64()
                .unwrap_or(0.0),
        );
    }
    assert!(known > 0.05, "the replicas know the month: {known}");
    let rebuilt = eventually(Duration::from_secs(15), || async {
        redis
            .value(&format!("HGET budget:spend:payer:{month} usd"))
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|v| v >= known - 1e-9)
    })
    .await;
    assert!(
        rebuilt,
        "the store's month after the restart: {:?} (replicas knew {known})",
        redis.value(&format!("HGET budget:spend:payer:{month} usd"))
    );
}

/// What one replica learns about an endpoint reaches the others through the store and applies
/// there without a call of their own: a retirement (410), a cooldown (429 and its
/// `retry-after`), a learned context window; a replica started later reads them from the store;
/// `endpoint clear` on one lifts them on all. Health stays each replica's own.
#[tokio::test]
async fn endpoint_knowledge_reaches_every_replica() {
    let redis = Redis::start();
    let gone = MockUp::openai(
        "rules: [{status: 410, error: \"The model gpt-4-0314 has been deprecated\"}]",
    )
    .await;
    let limited = MockUp::openai(
        "rules: [{status: 429, times: 1, headers: {retry-after: \"30\"}, error: \"Rate limit reached\"}]",
    )
    .await;
    let small = MockUp::openai("context_window: 80").await;
    let spare = MockUp::openai("name: spare").await;
    let cfg = format!(
        r#"models:
  gone: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  limited: {{ type: openai, base_url: "{}", model: gpt-4o-mini }}
  small: {{ type: openai, base_url: "{}", model: gpt-4o-mini, context_window: 100000 }}
  spare: {{ type: openai, base_url: "{}", model: gpt-4o-mini, context_window: 128000 }}
routes:
  retire: [gone, spare]
  cool: [limited, spare]
  window: [small, spare]
cluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: "facts:" }}
health: {{ probe_interval: 1h }}
"#,
        gone.base(),
        limited.base(),
        small.base(),
        spare.base()
    );
    let a = start(&cfg, &redis.url());
    let b = start(&cfg, &redis.url());
    until_clustered(&[&a, &b], 2).await;

    // A learns each thing from its own traffic.
    assert_eq!(
        header(&a.chat("retire", "hi").await, "x-autohedge-endpoint"),
        "spare"
    );
    assert_eq!(
        header(&a.chat("cool", "hi").await, "x-autohedge-endpoint"),
        "spare"
    );
    let long = "word ".repeat(100);
    let r = a.chat("window", &long).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "spare");
    let st = a.status().await;
    assert_eq!(
        st["endpoints"]["gone"]["state"], "retired",
        "{}",
        st["endpoints"]["gone"]
    );
    assert!(
        st["endpoints"]["limited"]["cooldown_remaining_ms"]
            .as_u64()
            .unwrap()
            > 20_000
    );
    assert_eq!(st["endpoints"]["small"]["learned_context_window"], 80);
    let calls = (
        gone.requests().await,
        limited.requests().await,
        small.requests().await,
    );
    assert_eq!(calls, (1, 1, 1));

    // B knows it without a call.
    let shared = eventually(Duration::from_secs(5), || async {
        let st = b.status().await;
        st["endpoints"]["gone"]["state"] == "retired"
            && st["endpoints"]["limited"]["cooldown_remaining_ms"]
                .as_u64()
                .unwrap_or(0)
                > 20_000
            && st["endpoints"]["small"]["learned_context_window"] == 80
    })
    .await;
    assert!(shared, "B: {}", b.status().await["endpoints"]);
    for route in ["retire", "cool"] {
        assert_eq!(
            header(&b.chat(route, "hi").await, "x-autohedge-endpoint"),
            "spare"
        );
    }
    let r = b.chat("window", &long).await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "spare");
    assert_eq!(
        (
            gone.requests().await,
            limited.requests().await,
            small.requests().await
        ),
        calls,
        "B called none of them"
    );
    // B's own trail says why: skipped for the cooldown and the retirement it never saw itself.
    let skipped = eventually(Duration::from_secs(5), || async {
        let rows = audit_rows(
            &b,
            "SELECT endpoint || ':' || class FROM attempts WHERE class LIKE 'skipped%' ORDER BY endpoint",
        );
        let got: Vec<String> = rows.iter().map(|r| r[0].as_str().unwrap_or("").to_string()).collect();
        got.contains(&"limited:skipped_cooldown".to_string())
            && got.iter().any(|g| g.starts_with("gone:skipped"))
    })
    .await;
    assert!(
        skipped,
        "B's attempts: {:?}",
        audit_rows(&b, "SELECT endpoint, class FROM attempts")
    );

    // A replica started later reads them from the store (its own data dir is new).
    let c = start(&cfg, &redis.url());
    until_clustered(&[&c], 3).await;
    let read = eventually(Duration::from_secs(5), || async {
        let st = c.status().await;
        st["endpoints"]["gone"]["state"] == "retired"
            && st["endpoints"]["small"]["learned_context_window"] == 80
    })
    .await;
    assert!(read, "C: {}", c.status().await["endpoints"]);

    // Cleared on B: lifted on A and C.
    let r = reqwest::Client::new()
        .post(b.url("/admin/endpoints/gone/clear"))
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for gw in [&a, &c] {
        let lifted = eventually(Duration::from_secs(5), || async {
            gw.status().await["endpoints"]["gone"]["state"] != "retired"
        })
        .await;
        assert!(lifted, "{}", gw.status().await["endpoints"]["gone"]);
    }
    assert_eq!(
        redis.value("EXISTS facts:facts:gone").as_deref(),
        Some(":0"),
        "the stored facts went with the clear"
    );

    // `autohedge endpoint clear` with no gateway answering at its URL clears the store too:
    // the learned window is lifted on every running replica and no longer stored.
    assert_eq!(
        redis.value("EXISTS facts:facts:small").as_deref(),
        Some(":1")
    );
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.yaml"), &cfg).unwrap();
    let out = Command::new(BIN)
        .args([
            "endpoint",
            "clear",
            "small",
            "--url",
            "http://127.0.0.1:9",
            "--config",
        ])
        .arg(dir.path().join("config.yaml"))
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("AUTOHEDGE_REDIS_URL", redis.url())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("cleared in the cluster store"), "{said}");
    for gw in [&a, &b, &c] {
        let lifted = eventually(Duration::from_secs(5), || async {
            gw.status().await["endpoints"]["small"]["learned_context_window"].is_null()
        })
        .await;
        assert!(lifted, "{}", gw.status().await["endpoints"]["small"]);
    }
    assert_eq!(
        redis.value("EXISTS facts:facts:small").as_deref(),
        Some(":0")
    );
}

/// Sharing against not sharing, on the same machine under the same load: the clustered fleet
/// meets almost none of the 429s the unshared one does (a fact that reaches the others a moment
/// late may let one request at the bucket's last unit through; "almost none" is counted, not
/// timed).
#[tokio::test]
async fn three_replicas_route_before_the_429_together() {
    let (sent, refused) = fleet_against_a_bucket(true).await;
    eprintln!("clustered: {refused} 429s for {sent} requests");
    let (alone_sent, alone_refused) = fleet_against_a_bucket(false).await;
    eprintln!("unclustered: {alone_refused} 429s for {alone_sent} requests");
    assert!(
        refused <= 2 && alone_refused >= 5 * refused.max(1),
        "shared: {refused} of {sent} requests met a 429; unshared: {alone_refused} of {alone_sent}"
    );
}

/// The same fleet without `cluster:`: each replica learns the bucket only from its own calls, and
/// the 429s show (what the test above would see if nothing were shared).
#[tokio::test]
async fn unshared_replicas_meet_the_429s() {
    let (sent, refused) = fleet_against_a_bucket(false).await;
    eprintln!("unclustered: {refused} 429s for {sent} requests");
    assert!(
        (refused as f64) >= sent as f64 * 0.01,
        "{refused} of {sent}: the shared test above could not fail"
    );
}

/// A key an upstream rejects (401) on replica A is one B never tries: B's first request goes out
/// with the other key (the upstream sees three calls, not four), and B's `/status` counts one
/// usable key before B has sent anything.
#[tokio::test]
async fn a_rejected_key_is_skipped_by_every_replica() {
    let redis = Redis::start();
    let up = MockUp::openai(
        "name: keyed\nrules: [{when: {key: sk-revoked-000}, status: 401, error: \"Incorrect API key provided\"}]",
    )
    .await;
    let cfg = format!(
        "models:\n  keyed: {{ type: openai, base_url: \"{}\", model: gpt-4o-mini, api_keys: [env:KEY_ONE, env:KEY_TWO] }}\ncluster: {{ redis: env:AUTOHEDGE_REDIS_URL, key_prefix: \"keys:\" }}\nhealth: {{ probe_interval: 1h }}\n",
        up.base()
    );
    let env = |url: &str| {
        Gw::start_with_env(
            &cfg,
            &[
                ("KEY_ONE", "sk-revoked-000"),
                ("KEY_TWO", "sk-valid-111"),
                ("AUTOHEDGE_REDIS_URL", url),
            ],
        )
    };
    let a = env(&redis.url());
    let b = env(&redis.url());
    until_clustered(&[&a, &b], 2).await;
    // Both have made their first probe round (it must not land between the counts below).
    a.ready().await;
    b.ready().await;
    let before = up.requests().await;
    let r = a.chat("keyed", "hi").await;
    assert_eq!(r.status(), 200, "served with the second key");
    assert_eq!(
        up.requests().await,
        before + 2,
        "A tried the revoked key first"
    );
    assert_eq!(a.status().await["endpoints"]["keyed"]["keys"]["usable"], 1);
    let known = eventually(Duration::from_secs(5), || async {
        b.status().await["endpoints"]["keyed"]["keys"]["usable"] == 1
    })
    .await;
    assert!(known, "B: {}", b.status().await["endpoints"]["keyed"]);
    // B's round-robin would start at the first key; it is skipped.
    for _ in 0..2 {
        assert_eq!(b.chat("keyed", "hi").await.status(), 200);
    }
    assert_eq!(
        up.requests().await,
        before + 4,
        "B sent each request once, with the valid key"
    );
}

/// `admit.lua` itself, against a real Redis: a bucket and the leases taken from it never hold
/// more than the limit. A full `rpm: 600` bucket leases 16 and keeps refilling for a second while
/// the lease is out; the fleet can then admit 584 more (the bucket stays at 600 minus what is
/// leased, not 600 on top of the lease), and the 16 come back when the lease is given back
/// unspent.
#[tokio::test]
async fn a_bucket_and_its_leases_never_hold_more_than_the_limit() {
    let redis = Redis::start();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let script = redis::Script::new(include_str!("../src/cluster/admit.lua"));
    // One call: `requests` requests of no tokens, a lease of 16 asked when `lease` names one,
    // `back` given back (its id, requests left). Returns (admitted, granted requests).
    async fn call(
        script: &redis::Script,
        conn: &mut redis::aio::MultiplexedConnection,
        requests: usize,
        lease: &str,
        back: (&str, u64),
    ) -> (usize, u64) {
        let mut inv = script.prepare_invoke();
        for k in [
            "rpm", "tpm", "spend", "resv", "resvamt", "resvtot", "lease", "leaseamt", "settled",
        ] {
            inv.key(format!("t:{k}"));
        }
        let asked = if lease.is_empty() { 0 } else { 16 };
        inv.arg(600)
            .arg(0)
            .arg(-1)
            .arg(3_600_000)
            .arg(0)
            .arg(86_400);
        inv.arg(asked)
            .arg(0)
            .arg(1)
            .arg(8)
            .arg(0)
            .arg(lease)
            // The lease's life: a minute, far past this test, which is about what a bucket
            // holds while a lease is out, not about when it ends.
            .arg(60_000);
        inv.arg(back.0).arg(back.1).arg(0).arg(900_000);
        for i in 0..requests {
            inv.arg(0).arg(0).arg(format!("r{i}"));
        }
        let out: Vec<redis::Value> = inv.invoke_async(conn).await.unwrap();
        let admitted = out[..requests * 5]
            .chunks(5)
            .filter(|c| redis::from_redis_value::<String>(c[0].clone()).unwrap() == "ok")
            .count();
        let granted: (u64, u64, u64) =
            redis::from_redis_value(redis::Value::Array(out[requests * 5..].to_vec())).unwrap();
        (admitted, if granted.0 == 1 { granted.1 } else { 0 })
    }
    // The lease, from a full bucket.
    assert_eq!(call(&script, &mut conn, 0, "L1", ("", 0)).await, (0, 16));
    // A second refills 10 requests; a full bucket had nowhere to put them.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The store's own clock (the one `admit.lua` refills by), in ms.
    async fn store_ms(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
        let (s, us): (u64, u64) = redis::cmd("TIME").query_async(conn).await.unwrap();
        s * 1000 + us / 1000
    }
    let before_2 = store_ms(&mut conn).await;
    let (admitted, _) = call(&script, &mut conn, 1000, "", ("", 0)).await;
    let after_2 = store_ms(&mut conn).await;
    assert_eq!(admitted, 584, "the bucket holds 600 less the 16 leased");
    // Given back unspent, the 16 are there again, with what refilled (10 a second) between the
    // two calls' clock reads: at least what refilled between `after_2` and `before_3`, at most
    // what refilled between `before_2` and `after_3`, plus the fraction left over.
    let before_3 = store_ms(&mut conn).await;
    let (admitted, _) = call(&script, &mut conn, 1000, "", ("L1", 16)).await;
    let after_3 = store_ms(&mut conn).await;
    let least = 16 + ((before_3 - after_2) / 100) as usize;
    let most = 17 + ((after_3 - before_2) / 100) as usize;
    assert!(
        (least..=most).contains(&admitted),
        "{admitted} after the lease came back ({least}..={most} by the store's clock)"
    );
    // Near empty, no lease is granted (it would leave the bucket under half full).
    assert_eq!(call(&script, &mut conn, 0, "L2", ("", 0)).await, (0, 0));
}

/// A key's settle names in the store are bounded whatever its rate: past the most kept, the
/// oldest go (the script's own bound, lowered here to 5 so the test need not send 100,000),
/// and a name still kept is still applied once.
#[tokio::test]
async fn a_keys_settle_names_are_bounded_in_the_store() {
    let real = include_str!("../src/cluster/settle.lua");
    assert!(
        real.contains("local most = 100000\n"),
        "the bound this test lowers"
    );
    let redis = Redis::start();
    let client = redis::Client::open(redis.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let script = redis::Script::new(&real.replace("local most = 100000\n", "local most = 5\n"));
    // One settle of 1 USD under `name`: what the month's spend is after it.
    async fn settle(
        script: &redis::Script,
        conn: &mut redis::aio::MultiplexedConnection,
        name: &str,
    ) -> f64 {
        let mut inv = script.prepare_invoke();
        for k in ["spend", "resv", "resvamt", "resvtot", "tpm", "settled"] {
            inv.key(format!("n:{k}"));
        }
        inv.arg(86_400).arg(3_600_000);
        inv.arg(name).arg("").arg(1.0).arg(0).arg(0);
        let _: i64 = inv.invoke_async(conn).await.unwrap();
        let usd: String = redis::cmd("HGET")
            .arg("n:spend")
            .arg("usd")
            .query_async(conn)
            .await
            .unwrap();
        usd.parse().unwrap()
    }
    for i in 0..20 {
        assert_eq!(
            settle(&script, &mut conn, &format!("s{i}")).await,
            f64::from(i + 1)
        );
        // Each name at a later millisecond of the store's clock: "the newest" is by time.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Twenty applied; five names kept, the newest.
    let kept: Vec<String> = redis::cmd("ZRANGE")
        .arg("n:settled")
        .arg(0)
        .arg(-1)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kept, ["s15", "s16", "s17", "s18", "s19"]);
    // A kept name sent again changes nothing.
    assert_eq!(settle(&script, &mut conn, "s19").await, 20.0);
}
