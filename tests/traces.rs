//! OpenTelemetry traces (`telemetry.otlp`): what reaches a collector over OTLP/HTTP, how each
//! request's spans hang together with the client's and the upstream's, and that a collector that
//! refuses or hangs costs spans (counted), never a request.

mod common;

use common::otlp::{Collector, Mode, attr, hex};
use common::*;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use serde_json::json;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traced(eps: &str, route: &str, otlp: &str) -> String {
    format!(
        "{eps}routes:\n{route}auth:\n  keys:\n    - {{ name: team-a, key: env:KEY_A }}\nhealth: {{ probe_interval: 1h }}\ntelemetry:\n  otlp: {{ {otlp} }}\n"
    )
}

const KEY_A: &str = "sk-team-a-secret-000001";

async fn chat(gw: &Gw, body: serde_json::Value, traceparent: Option<&str>) -> reqwest::Response {
    let mut rb = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .bearer_auth(KEY_A)
        .json(&body);
    if let Some(t) = traceparent {
        rb = rb
            .header("traceparent", t)
            .header("tracestate", "congo=t61rcWkgMzE");
    }
    rb.send().await.unwrap()
}

/// A request that fails over (a's 503, then b): one trace, the client's, continued — the server
/// span a child of the client's span, a client span per upstream call under it (a's in error
/// with its outcome, b's with the answer's model and tokens), GenAI and `autohedge.*`
/// attributes; each upstream got its own call's span as `traceparent`; the audit row and the
/// access line carry the trace id; no key anywhere in what was exported.
#[tokio::test]
async fn a_failover_is_one_trace_under_the_clients_span_with_a_span_per_call() {
    let a = MockUp::openai("name: a\nrules: [{status: 503, error: overloaded}]").await;
    let b = MockUp::openai("name: b").await;
    let col = Collector::start().await;
    let cfg = traced(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\", model: model-a, api_key: env:UP_KEY }}\n  b: {{ type: vllm, base_url: \"{}\", model: model-b }}\n",
            a.base(),
            b.base()
        ),
        "  r: [a, b]\n",
        &format!(
            "endpoint: \"{}\", headers: {{ x-collector-key: env:COLLECTOR_KEY }}, service_name: gw-test",
            col.url()
        ),
    );
    let mut gw = Gw::start_with_env(
        &cfg,
        &[
            ("KEY_A", KEY_A),
            ("UP_KEY", "sk-upstream-secret-77"),
            ("COLLECTOR_KEY", "collector-secret-99"),
        ],
    );
    gw.ready().await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = chat(
        &gw,
        json!({"model": "r", "max_tokens": 20, "messages": [{"role": "user", "content": "hello"}]}),
        Some(&parent),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "b");
    let request_id = header(&r, "x-request-id");
    let spans = col.trace(CLIENT_TRACE, 3).await;
    assert_eq!(spans.len(), 3, "server span and two calls: {spans:#?}");
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .expect("a server span");
    assert_eq!(server.name, "POST /v1/chat/completions");
    assert_eq!(
        hex(&server.parent_span_id),
        CLIENT_SPAN,
        "continues the client's span"
    );
    assert_eq!(
        attr(server, "gen_ai.operation.name").as_deref(),
        Some("chat")
    );
    assert_eq!(attr(server, "gen_ai.request.model").as_deref(), Some("r"));
    assert_eq!(
        attr(server, "gen_ai.response.model").as_deref(),
        Some("model-b")
    );
    assert_eq!(
        attr(server, "gen_ai.provider.name").as_deref(),
        Some("vllm")
    );
    assert_eq!(
        attr(server, "gen_ai.request.max_tokens").as_deref(),
        Some("20")
    );
    assert!(attr(server, "gen_ai.usage.input_tokens").is_some());
    assert!(attr(server, "gen_ai.usage.output_tokens").is_some());
    assert_eq!(
        attr(server, "autohedge.request_id"),
        Some(request_id.clone())
    );
    assert_eq!(
        attr(server, "autohedge.client_key").as_deref(),
        Some("team-a")
    );
    assert_eq!(attr(server, "autohedge.endpoint").as_deref(), Some("b"));
    assert_eq!(
        attr(server, "http.response.status_code").as_deref(),
        Some("200")
    );
    assert_eq!(
        attr(server, "gen_ai.response.finish_reasons").as_deref(),
        Some("stop")
    );
    let calls: Vec<_> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    assert_eq!(calls.len(), 2);
    for c in &calls {
        assert_eq!(
            c.parent_span_id, server.span_id,
            "{}: under the server span",
            c.name
        );
        assert!(c.start_time_unix_nano >= server.start_time_unix_nano);
        assert!(c.end_time_unix_nano <= server.end_time_unix_nano + 1_000_000);
    }
    let call_a = calls
        .iter()
        .find(|s| attr(s, "autohedge.endpoint").as_deref() == Some("a"))
        .unwrap();
    let call_b = calls
        .iter()
        .find(|s| attr(s, "autohedge.endpoint").as_deref() == Some("b"))
        .unwrap();
    assert_eq!(call_a.name, "chat model-a");
    assert_eq!(
        call_a.status.as_ref().map(|s| (s.code, s.message.as_str())),
        Some((StatusCode::Error as i32, "server_error"))
    );
    assert_eq!(
        attr(call_a, "autohedge.outcome").as_deref(),
        Some("server_error")
    );
    assert_eq!(attr(call_a, "autohedge.attempt").as_deref(), Some("1"));
    assert_eq!(
        attr(call_a, "http.response.status_code").as_deref(),
        Some("503")
    );
    assert_eq!(call_b.name, "chat model-b");
    assert_eq!(attr(call_b, "autohedge.attempt").as_deref(), Some("2"));
    assert_eq!(
        attr(call_b, "gen_ai.response.model").as_deref(),
        Some("model-b")
    );
    assert_ne!(
        call_b.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32)
    );
    // Each upstream saw its own call's span as the parent of whatever it traces.
    for (up, span) in [(&a, call_a), (&b, call_b)] {
        let seen = up.stats().await["traceparents"].clone();
        let want = format!("00-{CLIENT_TRACE}-{}-01", hex(&span.span_id));
        assert!(
            seen.as_array().unwrap().iter().any(|t| t == &json!(want)),
            "{want} in {seen}"
        );
    }
    // The resource names the service; the export carried the configured header.
    assert_eq!(
        col.resource().get("service.name").map(String::as_str),
        Some("gw-test")
    );
    assert!(
        col.headers()
            .iter()
            .all(|h| h.get("x-collector-key").map(String::as_str) == Some("collector-secret-99"))
    );
    // The audit row and the access line carry the trace id: one finds the other.
    let st = gw.status().await;
    assert_eq!(st["telemetry"]["otlp"]["spans_dropped"], 0, "{st}");
    gw.stop();
    let conn = rusqlite::Connection::open(gw.db()).unwrap();
    let trace_id: String = conn
        .query_row(
            "SELECT trace_id FROM requests WHERE request_id = ?1",
            [&request_id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(trace_id, CLIENT_TRACE);
    assert!(
        gw.log()
            .lines()
            .any(|l| l.contains(&request_id) && l.contains(&format!("trace_id={CLIENT_TRACE}"))),
        "{}",
        gw.log()
    );
    // No secret in any span.
    let dump = format!("{:?}", col.spans());
    for secret in [KEY_A, "sk-upstream-secret-77", "collector-secret-99"] {
        assert!(!dump.contains(secret), "{secret} exported");
    }
}

/// A hedged request: both copies are client spans of one trace, the hedge marked, the loser
/// cancelled (not an error); a new trace (no client `traceparent`) has no parent.
#[tokio::test]
async fn a_hedged_request_shows_both_copies() {
    let slow = MockUp::openai("name: slow\nrules: [{delay: 1500ms}]").await;
    let fast = MockUp::openai("name: fast").await;
    let col = Collector::start().await;
    let cfg = traced(
        &format!(
            "models:\n  slow: {{ type: openai, base_url: \"{}\" }}\n  fast: {{ type: openai, base_url: \"{}\" }}\n",
            slow.base(),
            fast.base()
        ),
        "  chat:\n    chain: [slow, fast]\n    hedge: { after: 150ms, max_extra: 100% }\n",
        &format!("endpoint: \"{}\"", col.url()),
    );
    let mut gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A)]);
    gw.ready().await;
    let r = chat(
        &gw,
        json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        None,
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-autohedge-endpoint"), "fast");
    let request_id = header(&r, "x-request-id");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let server = loop {
        if let Some(s) = col.spans().into_iter().find(|s| {
            s.kind == SpanKind::Server as i32
                && attr(s, "autohedge.request_id").as_deref() == Some(&request_id)
        }) {
            break s;
        }
        assert!(std::time::Instant::now() < deadline, "no server span");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(server.parent_span_id.is_empty(), "a new trace is a root");
    assert_eq!(attr(&server, "autohedge.hedged").as_deref(), Some("true"));
    let spans = col.trace(&hex(&server.trace_id), 3).await;
    let calls: Vec<_> = spans
        .iter()
        .filter(|s| s.kind == SpanKind::Client as i32)
        .collect();
    assert_eq!(calls.len(), 2, "{spans:#?}");
    let hedge = calls
        .iter()
        .find(|s| attr(s, "autohedge.hedged").as_deref() == Some("true"))
        .expect("the hedged copy");
    assert_eq!(attr(hedge, "autohedge.endpoint").as_deref(), Some("fast"));
    let first = calls
        .iter()
        .find(|s| attr(s, "autohedge.hedged").as_deref() == Some("false"))
        .expect("the first copy");
    assert_eq!(attr(first, "autohedge.endpoint").as_deref(), Some("slow"));
    assert_eq!(
        attr(first, "autohedge.outcome").as_deref(),
        Some("hedge_cancelled")
    );
    assert_ne!(
        first.status.as_ref().map(|s| s.code),
        Some(StatusCode::Error as i32),
        "a cancelled copy is no error"
    );
    gw.stop();
}

/// A stream's server span ends with its last event, not when its headers came: it outlasts its
/// first chunk by the time the upstream took to send the rest.
#[tokio::test]
async fn a_streams_span_ends_with_its_last_event() {
    let up = MockUp::openai("name: s\nchunk_delay: 40ms\nreply: \"one two three four five\"").await;
    let col = Collector::start().await;
    let cfg = traced(
        &format!(
            "models:\n  s: {{ type: openai, base_url: \"{}\" }}\n",
            up.base()
        ),
        "  r: [s]\n",
        &format!("endpoint: \"{}\"", col.url()),
    );
    let mut gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A)]);
    gw.ready().await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = chat(
        &gw,
        json!({"model": "r", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        Some(&parent),
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("[DONE]"), "{text}");
    let spans = col.trace(CLIENT_TRACE, 2).await;
    let server = spans
        .iter()
        .find(|s| s.kind == SpanKind::Server as i32)
        .unwrap();
    let ttft: f64 = attr(server, "gen_ai.response.time_to_first_chunk")
        .expect("time to first chunk")
        .parse()
        .unwrap();
    let length = (server.end_time_unix_nano - server.start_time_unix_nano) as f64 / 1e9;
    assert!(
        length > ttft + 0.1,
        "the span ({length:.3} s) covers the stream, not only its first chunk ({ttft:.3} s)"
    );
    let call = spans
        .iter()
        .find(|s| s.kind == SpanKind::Client as i32)
        .unwrap();
    assert_eq!(
        attr(server, "gen_ai.response.finish_reasons").as_deref(),
        Some("stop"),
        "read from the stream's last content chunk"
    );
    let call_length = (call.end_time_unix_nano - call.start_time_unix_nano) as f64 / 1e9;
    assert!(
        call_length > ttft + 0.1,
        "the call's span lasts the stream too"
    );
    gw.stop();
}

/// A collector that refuses, then one that hangs: every request is answered at once all the
/// same (200, none waiting on the export's 5 s timeout), and the spans that could not go are
/// counted in `/status` and `/metrics`. Without `telemetry`, a client's `traceparent` goes to the
/// upstream as it came, and nothing is exported.
#[tokio::test]
async fn a_collector_that_refuses_or_hangs_costs_spans_never_a_request() {
    let up = MockUp::openai("name: a").await;
    let col = Collector::start().await;
    let cfg = traced(
        &format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\" }}\n",
            up.base()
        ),
        "  r: [a]\n",
        &format!("endpoint: \"{}\", max_queue_spans: 50", col.url()),
    );
    let mut gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A)]);
    gw.ready().await;
    let body = json!({"model": "r", "messages": [{"role": "user", "content": "hi"}]});
    // First it works: spans arrive.
    assert_eq!(chat(&gw, body.clone(), None).await.status(), 200);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while col.spans().is_empty() {
        assert!(std::time::Instant::now() < deadline, "spans never arrived");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    for mode in [Mode::Refuse, Mode::Hang] {
        col.set(mode);
        // 100 requests one after another: a request that waited on an export would take the
        // exporter's 5 s timeout (the collector hangs) — none comes near it.
        let mut slowest = std::time::Duration::ZERO;
        for _ in 0..100 {
            let t = std::time::Instant::now();
            assert_eq!(chat(&gw, body.clone(), None).await.status(), 200);
            slowest = slowest.max(t.elapsed());
        }
        assert!(
            slowest < std::time::Duration::from_secs(4),
            "{mode:?}: the slowest request took {slowest:?}"
        );
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let st = gw.status().await;
        let o = &st["telemetry"]["otlp"];
        if o["spans_dropped"].as_u64().unwrap_or(0) >= 100
            && o["failed_exports"].as_u64() >= Some(1)
        {
            assert!(o["last_error"].is_string(), "{o}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{o}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let metrics = gw.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("autohedge_otlp_spans_dropped_total") && !l.ends_with(" 0")),
        "{metrics}"
    );
    gw.stop();

    // No `telemetry:`: the client's traceparent reaches the upstream unchanged.
    let cfg = format!(
        "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nhealth: {{ probe_interval: 1h }}\n",
        up.base()
    );
    let mut gw = Gw::start(&cfg);
    gw.ready().await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .header("traceparent", &parent)
        .json(&json!({"model": "a", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = up.stats().await["traceparents"].clone();
    assert_eq!(seen.as_array().unwrap().last(), Some(&json!(parent)));
    gw.stop();
}

/// Key A floods requests while the collector hangs (the exporter holds one batch for its 5 s
/// timeout): the queue takes A's spans up to half its spans (or, with long prompts captured,
/// half its bytes) and drops the rest (counted); key B's spans, sent after the flood, are all
/// queued and all reach the collector once it answers again.
#[tokio::test]
async fn one_keys_flood_of_spans_drops_none_of_another_keys() {
    const KEY_B: &str = "sk-team-b-secret-000002";
    for (limits, prompt) in [
        ("max_queue_spans: 40", "hi".to_string()),
        (
            "max_queue_spans: 100000, max_queue_bytes: 1MiB",
            "long prompt ".repeat(1500),
        ),
    ] {
        let up = MockUp::openai("name: a").await;
        let col = Collector::start().await;
        let cfg = format!(
            "models:\n  a: {{ type: openai, base_url: \"{}\" }}\nauth:\n  keys:\n    - {{ name: team-a, key: env:KEY_A }}\n    - {{ name: team-b, key: env:KEY_B }}\nhealth: {{ probe_interval: 1h }}\ntelemetry:\n  otlp: {{ endpoint: \"{}\", capture_content: true, {limits} }}\n",
            up.base(),
            col.url()
        );
        let mut gw = Gw::start_with_env(&cfg, &[("KEY_A", KEY_A), ("KEY_B", KEY_B)]);
        gw.ready().await;
        let send = |key: &'static str, content: String| {
            let gw = &gw;
            async move {
                let r = reqwest::Client::new()
                    .post(gw.url("/v1/chat/completions"))
                    .bearer_auth(key)
                    .json(
                        &json!({"model": "a", "messages": [{"role": "user", "content": content}]}),
                    )
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200);
            }
        };
        col.set(Mode::Hang);
        send(KEY_A, "first".into()).await;
        // The export task takes the first request's spans and waits on the hung collector.
        tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
        for _ in 0..80 {
            send(KEY_A, prompt.clone()).await;
        }
        let dropped = |st: &serde_json::Value| st["telemetry"]["otlp"]["spans_dropped"].as_u64();
        let after_flood = dropped(&gw.status().await).unwrap();
        assert!(
            after_flood >= 60,
            "{limits}: A's flood was dropped ({after_flood})"
        );
        for i in 0..5 {
            send(KEY_B, format!("victim request {i}")).await;
        }
        let st = gw.status().await;
        assert_eq!(
            dropped(&st),
            Some(after_flood),
            "{limits}: none of B's dropped: {}",
            st["telemetry"]
        );
        col.set(Mode::Accept);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let b_servers = col
                .spans()
                .iter()
                .filter(|s| {
                    s.kind == SpanKind::Server as i32
                        && attr(s, "autohedge.client_key").as_deref() == Some("team-b")
                })
                .count();
            if b_servers == 5 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{limits}: {b_servers} of B's 5 request spans reached the collector: {}",
                gw.status().await["telemetry"]
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        gw.stop();
    }
}
