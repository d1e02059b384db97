//! Config loading and live reload, against the real binary: the watcher follows editor renames,
//! Kubernetes `..data` swaps and symlinked configs, rejects an invalid file naming it, and is not
//! postponed forever by a stream of writes; SIGHUP re-reads a `file:` key; a redefined endpoint
//! starts afresh; an outsized duration is refused at load.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

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
    gw.hup();
    let ok = eventually(Duration::from_secs(10), || async {
        until(&gw.status().await)
    })
    .await;
    assert!(ok, "reload not seen: {}", gw.status().await);
}

#[tokio::test]
async fn live_reload_swaps_the_order_and_rejects_invalid_files() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let cfg = two(&a, &b, "");
    let gw = Gw::start(&cfg);
    assert_eq!(
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint"),
        "a"
    );
    // Edit the way an editor does: write a new file and rename it over the old one.
    let swapped = cfg.replace("chat: [a, b]", "chat: [b, a]");
    let tmp = gw.dir.join("config.yaml.tmp");
    std::fs::write(&tmp, &swapped).unwrap();
    std::fs::rename(&tmp, &gw.config_path).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint") == "b"
    })
    .await;
    assert!(ok, "new order served");
    // State survives the reload.
    assert!(
        gw.status().await["endpoints"]["a"]["totals"]["successes"]
            .as_u64()
            .unwrap()
            >= 1
    );

    // An invalid file is rejected with the bad key's path; the old table stays live.
    std::fs::write(
        &gw.config_path,
        swapped.replace("model: upstream-b", "model: upstream-b\n    bogus_key: 1"),
    )
    .unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["config"]["last_reload_error"]
            .as_str()
            .is_some_and(|e| e.contains("models.b") && e.contains("bogus_key"))
    })
    .await;
    assert!(ok, "{}", gw.status().await["config"]);
    assert_eq!(
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint"),
        "b"
    );
    assert!(gw.log().contains("bogus_key"));

    // A valid file is picked up again by the watcher. (What only SIGHUP reloads — a `file:` key
    // kept outside the watched directory — is tested by
    // `replacing_a_rejected_keys_value_clears_it_on_reload`.)
    std::fs::write(&gw.config_path, &cfg).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        header(&gw.chat("chat", "x").await, "x-autohedge-endpoint") == "a"
    })
    .await;
    assert!(ok);
}

#[tokio::test]
async fn reload_follows_a_kubernetes_style_data_symlink_swap() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let dir = tempfile::tempdir().unwrap();
    let cfgdir = dir.path().join("cfg");
    // What a ConfigMap volume looks like: config.yaml -> ..data/config.yaml, ..data -> ..v1.
    std::fs::create_dir_all(cfgdir.join("..v1")).unwrap();
    std::fs::write(cfgdir.join("..v1/config.yaml"), one_endpoint(&a, "a")).unwrap();
    std::os::unix::fs::symlink("..v1", cfgdir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/config.yaml", cfgdir.join("config.yaml")).unwrap();
    let gw = Gw::start_at(dir.path(), &cfgdir.join("config.yaml"), &[]);
    assert_eq!(
        header(&gw.chat("a", "x").await, "x-autohedge-endpoint"),
        "a"
    );
    // The update: a new timestamped dir, a temp symlink renamed over ..data.
    std::fs::create_dir_all(cfgdir.join("..v2")).unwrap();
    std::fs::write(cfgdir.join("..v2/config.yaml"), one_endpoint(&b, "b")).unwrap();
    std::os::unix::fs::symlink("..v2", cfgdir.join("..data_tmp")).unwrap();
    std::fs::rename(cfgdir.join("..data_tmp"), cfgdir.join("..data")).unwrap();
    std::fs::remove_dir_all(cfgdir.join("..v1")).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["b"].is_object()
    })
    .await;
    assert!(ok, "the swap was reloaded: {}", gw.status().await["config"]);
    let r = gw.chat("b", "x").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    assert_eq!(b.requests().await, 1);
}

#[tokio::test]
async fn reload_follows_a_symlinked_config_edited_in_another_directory() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let real = elsewhere.path().join("real.yaml");
    std::fs::write(&real, one_endpoint(&a, "a")).unwrap();
    let link = dir.path().join("config.yaml");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let gw = Gw::start_at(dir.path(), &link, &[]);
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    // Edited in place where it really lives: no event in the link's directory.
    std::fs::write(&real, one_endpoint(&b, "b")).unwrap();
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["b"].is_object()
    })
    .await;
    assert!(ok, "the edit was reloaded: {}", gw.status().await["config"]);
    assert_eq!(
        header(&gw.chat("b", "x").await, "x-autohedge-endpoint"),
        "b"
    );
}

#[tokio::test]
async fn a_stream_of_writes_does_not_postpone_a_reload_forever() {
    let a = MockUp::openai("name: a").await;
    let b = MockUp::openai("name: b").await;
    let gw = Gw::start(&one_endpoint(&a, "a"));
    // Rewrite the file every 20 ms (inside the 50 ms debounce) until told to stop (at most
    // 60 s), ending on b's table.
    let path = gw.config_path.clone();
    let (ca, cb) = (one_endpoint(&a, "a"), one_endpoint(&b, "b"));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = std::thread::spawn({
        let stop = stop.clone();
        move || {
            let until = std::time::Instant::now() + Duration::from_secs(60);
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && std::time::Instant::now() < until
            {
                let text = if i.is_multiple_of(2) { &cb } else { &ca };
                std::fs::write(&path, format!("{text}# write {i}\n")).unwrap();
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    });
    // Reloads happen while the writes go on (bounded debounce), not only after they stop: in
    // this order, a reload, then the writes stop. (The wait is generous: a reload must come.)
    let ok = eventually(Duration::from_secs(30), || async {
        gw.status().await["config"]["reloads"].as_u64().unwrap_or(0) >= 1
    })
    .await;
    let during = !writer.is_finished();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    assert!(
        ok && during,
        "no reload while the writes went on: {}",
        gw.status().await["config"]
    );
}

#[tokio::test]
async fn replacing_a_rejected_keys_value_clears_it_on_reload() {
    let a = MockUp::openai("name: a\nkeys: [sk-new-value-NEW1]").await;
    let dir = tempfile::tempdir().unwrap();
    let keydir = tempfile::tempdir().unwrap();
    let keyfile = keydir.path().join("key");
    std::fs::write(&keyfile, "sk-old-value-OLD1").unwrap();
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\", api_key: \"file:{}\" }}\n",
        a.base(),
        keyfile.display()
    );
    let gw = Gw::start_in(dir.path(), &cfg, &[]);
    // The probe or the request sends the old key and gets 401: auth_failed.
    assert_eq!(gw.chat("a", "x").await.status(), 503);
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["state"] == "auth_failed"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]["a"]);
    let seen = a.stats().await;
    let calls = seen["by_path"]["/v1/models"].as_u64().unwrap_or(0)
        + seen["by_path"]["/v1/chat/completions"]
            .as_u64()
            .unwrap_or(0);
    assert!(calls >= 1, "the old key reached the upstream: {seen}");
    let why = gw.status().await["endpoints"]["a"]["auth_failed"].clone();
    assert!(
        why.as_str()
            .is_some_and(|w| w.contains("Incorrect API key") || w.contains("401")),
        "the upstream rejected it: {why}"
    );
    // The file (outside the watched directory) gets the new value; SIGHUP reloads.
    std::fs::write(&keyfile, "sk-new-value-NEW1").unwrap();
    gw.hup();
    let ok = eventually(Duration::from_secs(5), || async {
        gw.status().await["endpoints"]["a"]["state"] == "healthy"
    })
    .await;
    assert!(ok, "{}", gw.status().await["endpoints"]["a"]);
    assert_eq!(gw.chat("a", "x").await.status(), 200);
    let tails = a.stats().await["key_tails"].clone();
    assert_eq!(
        tails.as_array().unwrap().last(),
        Some(&json!("NEW1")),
        "{tails}"
    );
    let mut gw = gw;
    gw.stop();
    let events = audit_rows(
        &gw,
        "SELECT event, reason FROM endpoint_events WHERE endpoint = 'a' ORDER BY id",
    );
    assert_eq!(
        events,
        vec![
            vec![json!("auth_failed"), events[0][1].clone()],
            vec![
                json!("auth_cleared"),
                json!("a rejected key's value was replaced")
            ],
        ],
        "{events:?}"
    );
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
    // And a 429 from the old server: `e` cools down (`default_cooldown`, 30 s).
    let r = chat_with(&gw, "cool", "chat", "ratelimited").await;
    assert_eq!(header(&r, "x-autohedge-endpoint"), "big");
    assert_eq!(old.requests(), 2);
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["e"]["state"], "cooldown", "{st}");
    assert!(
        st["endpoints"]["e"]["cooldown_remaining_ms"]
            .as_u64()
            .unwrap()
            > 20_000,
        "{st}"
    );

    reload(&gw, &cfg(&new.base), |st| {
        st["endpoints"]["e"]["learned_context_window"].is_null()
    })
    .await;
    // The cooldown went with the window (both are swapped out at once).
    let st = gw.status().await;
    assert_eq!(st["endpoints"]["e"]["cooldown_remaining_ms"], 0, "{st}");
    assert_ne!(st["endpoints"]["e"]["state"], "cooldown", "{st}");
    // The new server gets, at once, a prompt the old one's window would have sent elsewhere —
    // and the old one's cooldown kept from `e` for another 30 s. (The endpoint's state is made
    // fresh just before the new table is swapped in: a request in that instant still goes by
    // the old table, so the first to reach the new server is awaited, each served by `e`.)
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

/// A loopback upstream that holds every chat answer until `release`: `posts` counts the POSTs
/// that reached it (each answered, once released, with a chat completion saying "from the old
/// config"); GETs get a one-model list at once, so probes pass.
struct HeldUpstream {
    addr: std::net::SocketAddr,
    posts: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    up: RawUp,
}

impl HeldUpstream {
    async fn start() -> HeldUpstream {
        use std::sync::atomic::Ordering;
        let posts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = posts.clone();
        // One request a connection.
        let up = RawUp::start(move |req| {
            let answer = |body: &str| {
                Answer::WriteClose(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .into_bytes(),
                )
            };
            if req.method == "GET" {
                return answer(
                    r#"{"object":"list","data":[{"id":"held-model","object":"model","created":0,"owned_by":"held"}]}"#,
                );
            }
            counter.fetch_add(1, Ordering::SeqCst);
            Answer::Gated(Box::new(answer(
                r#"{"id":"chatcmpl-held","object":"chat.completion","created":1700000000,"model":"held-model","choices":[{"index":0,"message":{"role":"assistant","content":"from the old config"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#,
            )))
        });
        HeldUpstream {
            addr: up.addr,
            posts,
            up,
        }
    }

    fn posts(&self) -> usize {
        self.posts.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A request in flight when `config.yaml` is rewritten finishes on the config it started with:
/// its endpoint `old` and route `chat: [old]` are gone from the new file (the route now names
/// `fresh`), yet it is answered by `old`, 200, and recorded as `old`'s. A request after the
/// reload follows the new file: `chat` goes to `fresh`, and `old` is no model any more.
///
/// The order is the test's, not the clock's: the upstream holds the first request's answer
/// until the reload is seen installed (`/status` `config.reloads`) and a request has followed
/// the new config; only then is the answer released.
///
/// docs/configuration.md ("Live reload"): "Edit `config.yaml` while the gateway runs (or send
/// SIGHUP): the file is watched … parsed and validated, then swapped in atomically. … In-flight
/// requests finish on the snapshot they started with; endpoint state and stats survive for
/// endpoints that still exist".
///
/// Fails if: a request reads the live table (`state.config.load()`) after it started instead of
/// the snapshot it took, or the install (`AppState::install`, `registry.sync`) tears down a
/// removed endpoint's clients or connections under the requests still using them: the held
/// request then fails (502/503/504), or is sent again to `fresh` (`fresh` gets two requests),
/// instead of `old`'s 200.
#[tokio::test]
async fn a_request_in_flight_finishes_on_the_config_it_started_with() {
    use serde_json::{Value, json};
    use std::time::Duration;

    let old = HeldUpstream::start().await;
    let fresh = MockUp::openai("name: fresh").await;
    let before = format!(
        "models:\n  old: {{ type: openai, base_url: \"http://{}/v1\", model: held-model, timeouts: {{ first_token: 120s, total: 300s }} }}\nroutes:\n  chat: [old]\nhealth: {{ probe_interval: 1h }}\n",
        old.addr
    );
    let after = format!(
        "models:\n  fresh: {{ type: openai, base_url: \"{}\" }}\nroutes:\n  chat: [fresh]\nhealth: {{ probe_interval: 1h }}\n",
        fresh.base()
    );
    let mut gw = Gw::start(&before);
    gw.ready().await;
    let reloads_before = gw.status().await["config"]["reloads"].as_u64().unwrap_or(0);

    // A request starts under the old config and reaches `old`, which holds its answer.
    let url = gw.url("/v1/chat/completions");
    let in_flight = tokio::spawn(async move {
        reqwest::Client::new()
            .post(url)
            .header("x-request-id", "in-flight")
            .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "x"}]}))
            .send()
            .await
            .unwrap()
    });
    let reached = eventually(Duration::from_secs(10), || async { old.posts() == 1 }).await;
    assert!(reached, "the first request reached the old endpoint");

    // The file is rewritten: `old` gone, `chat` renamed onto `fresh`. The reload is installed.
    std::fs::write(&gw.config_path, &after).unwrap();
    let installed = eventually(Duration::from_secs(10), || async {
        let st = gw.status().await;
        st["config"]["reloads"].as_u64().unwrap_or(0) > reloads_before
            && st["endpoints"].get("fresh").is_some()
            && st["endpoints"].get("old").is_none()
    })
    .await;
    let st = gw.status().await;
    assert!(installed, "the new config was installed: {}", st["config"]);
    assert!(
        st["config"]["last_reload_error"].is_null(),
        "{}",
        st["config"]
    );

    // A request after the reload follows the new config …
    let r = gw
        .chat_id(
            "after-reload",
            json!({"model": "chat", "messages": [{"role": "user", "content": "y"}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "fresh");
    assert_eq!(fresh.requests().await, 1);
    let r = gw.chat("old", "z").await;
    assert_eq!(r.status(), 404, "`old` is no model under the new config");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found", "{v}");
    assert_eq!(old.posts(), 1, "nothing new reached the old endpoint");
    assert!(!in_flight.is_finished(), "the first request is still held");

    // … while the one in flight finishes as the old config said: served by `old`.
    old.up.open_gate();
    let r = in_flight.await.unwrap();
    assert_eq!(r.status(), 200, "the in-flight request was served");
    assert_eq!(header(&r, "x-autohedge-endpoint"), "old");
    assert_eq!(header(&r, "x-autohedge-attempts"), "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"], "from the old config",
        "{v}"
    );
    assert_eq!(
        fresh.requests().await,
        1,
        "the in-flight request was not sent to fresh"
    );

    gw.stop();
    let rows: Vec<String> = audit_rows(
        &gw,
        "SELECT request_id || ':' || endpoint || ':' || status FROM requests WHERE request_id IN ('in-flight', 'after-reload') ORDER BY request_id",
    )
    .into_iter()
    .map(|r| r[0].as_str().unwrap_or("").to_string())
    .collect();
    assert_eq!(rows, vec!["after-reload:fresh:200", "in-flight:old:200"]);
}
