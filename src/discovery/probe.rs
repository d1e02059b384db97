//! Background active probes, cheap by default and off the request path; they never bill a token.
//! - `openai`: `GET /models` with the endpoint's key — 401 means a revoked key, 403 an
//!   organisation or permission problem, 429 rate limiting (the `x-ratelimit-*` headers are
//!   recorded); an empty model list is suspicious (degraded), not healthy.
//! - `vllm`: `GET /health` plus `/metrics`: a waiting queue or KV-cache usage over
//!   `health.vllm_max_waiting` / `vllm_max_kv_cache` → degraded.
//! - `ollama`: `/api/tags` (the configured model must be present) and `/api/ps` (loaded?).
//!
//! Each result feeds the endpoint's health state machine (`health::Health`) and is shown in
//! `/status` under `endpoints.<name>.probe`. Probes run concurrently, each under
//! `health.probe_timeout`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::join_all;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::config::{Endpoint, EndpointKind, HealthPolicy};
use crate::routing::health::ProbeResult;
pub use crate::routing::observed::ProbeReport;
use crate::state::AppState;
use crate::upstream::metrics;

/// The endpoint's `headers:` on a probe request: probes must look like the traffic they vouch
/// for (an `OpenAI-Organization`, a gateway token in front of a local server).
fn with_headers(ep: &Endpoint, mut rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    for (k, v) in &ep.headers {
        rb = rb.header(k.as_str(), v.expose());
    }
    rb
}

async fn get(ep: &Endpoint, url: &str, timeout: Duration) -> Result<(u16, String), String> {
    get_with(with_headers(ep, ep.client.get(url)), timeout)
        .await
        .map(|(s, _, t)| (s, t))
}

async fn get_with(
    rb: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<(u16, reqwest::header::HeaderMap, String), String> {
    let fut = async {
        let r = rb.send().await.map_err(|e| {
            // Counted, so the round's verdicts can be set aside (see `run`).
            crate::upstream::out_of_files(&e);
            e.to_string()
        })?;
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = crate::upstream::reqwest_body(r, PROBE_BODY_LIMIT)
            .await
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&body).into_owned();
        Ok::<_, String>((status, headers, text))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("no answer within {}ms", timeout.as_millis()))?
}

/// The most of a probe's answer read (`/models`, `/metrics`, `/api/tags`, a custom check, the
/// semantic probe's reply): a vLLM `/metrics` is tens of KB, a model list a few; an answer that
/// grows past this is a failed probe, not a growing heap.
const PROBE_BODY_LIMIT: usize = 8 * 1024 * 1024;

/// GPU memory share above which a backend is degraded: past ~92% an allocator spike (a long
/// prompt, a new sequence) risks an out-of-memory error mid-request.
const GPU_MEMORY_DEGRADED: f64 = 0.92;

/// A backend reporting less uptime than this has just (re)started: warming.
const WARMING_UPTIME_SECS: f64 = 60.0;

/// What the prober remembers between rounds for one endpoint (KV-cache trend).
#[derive(Default, Debug)]
pub struct Memory {
    kv: std::collections::VecDeque<f64>,
    purged: bool,
}

/// Evaluates a custom `health_check` body.
pub fn judge_custom(
    hc: &crate::config::RawHealthCheck,
    status: u16,
    body: &str,
    mem: &mut Memory,
) -> (ProbeResult, bool) {
    if !(200..300).contains(&status) {
        return (
            ProbeResult::Unhealthy(format!("health_check: {status}")),
            false,
        );
    }
    let Ok(v) = serde_json::from_str::<Value>(body) else {
        return (
            ProbeResult::Unhealthy("health_check: body is not JSON".into()),
            false,
        );
    };
    for (k, want) in &hc.expect {
        if v.get(k) != Some(want) {
            return (
                ProbeResult::Unhealthy(format!(
                    "health_check: {k} = {}, expected {want}",
                    v.get(k).unwrap_or(&Value::Null)
                )),
                false,
            );
        }
    }
    // KV cache growing across the last K probes with no fall: a leak the purge hook can clear.
    let mut purge = false;
    if let Some(kv) = v.get("kv_cache_size_mb").and_then(Value::as_f64) {
        let k = hc.kv_growth_probes.unwrap_or(5).max(2);
        if mem.kv.back().is_some_and(|last| kv < *last) {
            mem.purged = false;
            mem.kv.clear();
        }
        mem.kv.push_back(kv);
        while mem.kv.len() > k {
            mem.kv.pop_front();
        }
        let growing = mem.kv.len() == k
            && mem
                .kv
                .iter()
                .zip(mem.kv.iter().skip(1))
                .all(|(a, b)| b >= a)
            && mem.kv.back() > mem.kv.front();
        if growing && !mem.purged && hc.purge.is_some() {
            mem.purged = true;
            purge = true;
        }
    }
    if let Some(up) = v.get("uptime_seconds").and_then(Value::as_f64)
        && up < WARMING_UPTIME_SECS
    {
        return (
            ProbeResult::Warming(format!("uptime {up:.0}s (under {WARMING_UPTIME_SECS:.0}s)")),
            purge,
        );
    }
    if let (Some(used), Some(total)) = (
        v.get("gpu_memory_used_mb").and_then(Value::as_f64),
        hc.gpu_memory_total_mb,
    ) && total > 0.0
        && used / total > GPU_MEMORY_DEGRADED
    {
        return (
            ProbeResult::Degraded(format!(
                "GPU memory {:.0}% used (over {:.0}%)",
                100.0 * used / total,
                100.0 * GPU_MEMORY_DEGRADED
            )),
            purge,
        );
    }
    (ProbeResult::Healthy, purge)
}

fn absolute(url: &str, root: &str) -> String {
    if url.starts_with("http://") || url.starts_with("https://") {
        url.to_string()
    } else {
        format!("{root}{url}")
    }
}

/// A custom check: returns the report and whether the purge hook should be called.
async fn probe_custom(
    ep: &Endpoint,
    root: &str,
    hc: &crate::config::RawHealthCheck,
    hp: &HealthPolicy,
    mem: &mut Memory,
) -> (ProbeReport, bool) {
    let at = SystemTime::now();
    let timeout = hc.timeout.map(|d| d.0).unwrap_or(hp.probe_timeout);
    let method = reqwest::Method::from_bytes(hc.method.as_bytes()).unwrap_or(reqwest::Method::GET);
    let r = get_with(
        with_headers(ep, ep.client.request(method, absolute(&hc.url, root))),
        timeout,
    )
    .await;
    let (result, purge, detail) = match r {
        Err(e) => (
            ProbeResult::Unhealthy(format!("health_check: {e}")),
            false,
            json!({"error": e}),
        ),
        Ok((status, _, body)) => {
            let (res, purge) = judge_custom(hc, status, &body, mem);
            (res, purge, check_detail(ep, status, &body))
        }
    };
    (ProbeReport::new(at, result, detail), purge)
}

/// The most of a custom check's answer shown in `/status` (`probe.detail`).
const CHECK_DETAIL_LIMIT: usize = 4096;

/// What `/status` shows of a custom check's answer: its JSON when it is small, with the
/// endpoint's secrets (keys, credential headers) redacted — a debug endpoint may echo what it
/// was sent; else only the status and the size. Before, the whole answer (up to the probe's
/// 8 MiB) was shown as it came.
fn check_detail(ep: &Endpoint, status: u16, body: &str) -> Value {
    if body.len() > CHECK_DETAIL_LIMIT {
        return json!({"status": status, "bytes": body.len(), "note": "answer too large to show"});
    }
    let body = crate::upstream::classify::redact_exact(
        bytes::Bytes::copy_from_slice(body.as_bytes()),
        &ep.secret_values(),
    );
    serde_json::from_slice::<Value>(&body).unwrap_or(json!({"status": status}))
}

/// The opt-in semantic probe: one real one-token completion that must return message content.
async fn probe_semantic(
    ep: &Endpoint,
    base: &str,
    key: Option<&str>,
    timeout: Duration,
) -> Result<(), String> {
    let mut body = serde_json::Map::new();
    body.insert("model".into(), json!(ep.upstream_model));
    body.insert(
        "messages".into(),
        json!([{"role": "user", "content": "Reply with one word: ok"}]),
    );
    body.insert("max_tokens".into(), json!(1));
    let secret = key.map(|k| crate::config::Secret::new(k.to_string()));
    let req = crate::wire::Inbound::new(
        crate::wire::Op::Chat,
        ep.upstream_model.clone(),
        false,
        body,
        Default::default(),
    );
    let (rb, _) = crate::upstream::request(
        ep,
        &req,
        false,
        secret.as_ref(),
        crate::upstream::Ids::request("autohedge-semantic-probe"),
        Some(base),
        false,
    )
    .map_err(|u| u.0)?;
    let fut = async {
        let r = rb.send().await.map_err(|e| e.shown)?;
        let status = r.status;
        let answer = r.bytes(PROBE_BODY_LIMIT).await.map_err(|e| e.to_string())?;
        let v: Value = serde_json::from_slice(&answer).map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("semantic probe: {status}"));
        }
        let v = if ep.kind == EndpointKind::Ollama {
            crate::upstream::ollama::response_body(crate::wire::Op::Chat, &ep.name, req.body(), &v)?
        } else {
            v
        };
        match v.pointer("/choices/0/message/content") {
            Some(Value::String(_)) => Ok(()),
            _ => Err("semantic probe: no choices[0].message.content".into()),
        }
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| "semantic probe: timed out".to_string())?
}

/// Probes one endpoint at `base` (its configured or discovered API root) with `key`, the key
/// (index and value) requests would use now.
pub async fn probe(
    ep: &Endpoint,
    base: &str,
    key: Option<(usize, &str)>,
    hp: &HealthPolicy,
) -> Option<ProbeReport> {
    let at = SystemTime::now();
    let timeout = hp.probe_timeout;
    let root = base
        .trim_end_matches('/')
        .trim_end_matches("/v1")
        .to_string();
    match ep.kind {
        EndpointKind::Openai => {
            let mut rb = with_headers(
                ep,
                ep.client
                    .get(format!("{}/models", base.trim_end_matches('/'))),
            );
            if let Some((_, k)) = key {
                rb = rb.bearer_auth(k);
            }
            let r = get_with(rb, timeout).await;
            let (result, detail) = match &r {
                Err(e) => (
                    ProbeResult::Unhealthy(format!("GET /models: {e}")),
                    json!({"error": e}),
                ),
                Ok((status, headers, text)) => {
                    let rl: serde_json::Map<String, Value> = headers
                        .iter()
                        .filter(|(k, _)| k.as_str().starts_with("x-ratelimit-"))
                        .filter_map(|(k, v)| Some((k.to_string(), json!(v.to_str().ok()?))))
                        .collect();
                    let n = serde_json::from_str::<Value>(text)
                        .ok()
                        .and_then(|v| v.get("data").and_then(Value::as_array).map(Vec::len));
                    let result = match status {
                        200 if n.unwrap_or(0) == 0 => ProbeResult::Degraded(
                            "GET /models returned no models (suspicious)".into(),
                        ),
                        200 => ProbeResult::Healthy,
                        401 => ProbeResult::Unhealthy(
                            "GET /models: 401, the API key is revoked or invalid".into(),
                        ),
                        403 => ProbeResult::Unhealthy(
                            "GET /models: 403, organisation or permission problem".into(),
                        ),
                        429 => ProbeResult::Degraded("GET /models: 429, rate limited".into()),
                        s => ProbeResult::Unhealthy(format!("GET /models: {s}")),
                    };
                    (
                        result,
                        json!({"status": status, "models": n, "ratelimit": rl}),
                    )
                }
            };
            let status = r.as_ref().ok().map(|(s, _, _)| *s);
            let mut report = ProbeReport::new(at, result, detail);
            match (status, key) {
                // A server without `GET /models` (or one refusing the method) has no probe: its
                // state comes from live traffic, it is not unhealthy.
                (Some(404 | 405), _) => {
                    report.counts = false;
                    report.ok = true;
                    report.detail["note"] = json!(
                        "no probe: GET /models is not served here; health comes from live traffic"
                    );
                }
                // A rejected key is rejected exactly as a request's 401/403 would: the
                // registry rotates to the next key and marks auth_failed only when none is left.
                (Some(401 | 403), Some((i, _))) => {
                    report.counts = false;
                    report.rejected_key = Some(i);
                }
                _ => {}
            }
            Some(report)
        }
        EndpointKind::Vllm => {
            let health = get(ep, &format!("{root}/health"), timeout).await;
            let load = get(ep, &format!("{root}/metrics"), timeout).await;
            let load = match load {
                Ok((200, text)) => Some(metrics::parse_vllm(&text)),
                _ => None,
            };
            let result = match &health {
                Err(e) => ProbeResult::Unhealthy(format!("GET /health: {e}")),
                Ok((s, _)) if *s != 200 => ProbeResult::Unhealthy(format!("GET /health: {s}")),
                Ok(_) => match &load {
                    Some(l)
                        if l.num_requests_waiting
                            .is_some_and(|w| w > hp.vllm_max_waiting) =>
                    {
                        ProbeResult::Degraded(format!(
                            "{} requests waiting (over {})",
                            l.num_requests_waiting.unwrap_or(0.0),
                            hp.vllm_max_waiting
                        ))
                    }
                    Some(l) if l.kv_cache_usage.is_some_and(|k| k > hp.vllm_max_kv_cache) => {
                        ProbeResult::Degraded(format!(
                            "KV cache {:.0}% used (over {:.0}%)",
                            l.kv_cache_usage.unwrap_or(0.0) * 100.0,
                            hp.vllm_max_kv_cache * 100.0
                        ))
                    }
                    _ => ProbeResult::Healthy,
                },
            };
            Some(ProbeReport::new(
                at,
                result,
                json!({
                    "health": match &health { Ok((s, _)) => json!(s), Err(e) => json!(e) },
                    "load": load.and_then(|l| serde_json::to_value(l).ok()),
                }),
            ))
        }
        EndpointKind::Ollama => {
            let tags = get(ep, &format!("{root}/api/tags"), timeout).await;
            let ps = get(ep, &format!("{root}/api/ps"), timeout).await;
            let names = |r: &Result<(u16, String), String>| -> Option<Vec<String>> {
                let (200, text) = r.as_ref().ok()? else {
                    return None;
                };
                let v: Value = serde_json::from_str(text).ok()?;
                Some(
                    v.get("models")?
                        .as_array()?
                        .iter()
                        .filter_map(|m| {
                            m.get("name")
                                .or_else(|| m.get("model"))
                                .and_then(Value::as_str)
                                .map(str::to_string)
                        })
                        .collect(),
                )
            };
            let want = &ep.upstream_model;
            // `qwen2.5:7b` is listed as itself; a bare `llama3` as `llama3:latest`.
            let matches = |n: &String| n == want || *n == format!("{want}:latest");
            let present = names(&tags).map(|n| n.iter().any(matches));
            let loaded = names(&ps).map(|n| n.iter().any(matches));
            let result = match (&tags, present) {
                (Err(e), _) => ProbeResult::Unhealthy(format!("GET /api/tags: {e}")),
                (_, Some(true)) => ProbeResult::Healthy,
                (_, Some(false)) => {
                    ProbeResult::Unhealthy(format!("model {want} is not pulled on this server"))
                }
                (Ok((s, _)), None) => ProbeResult::Unhealthy(format!("GET /api/tags: {s}")),
            };
            Some(ProbeReport::new(
                at,
                result,
                json!({
                    "model": want,
                    "model_present": present,
                    "model_loaded": loaded,
                    "error": tags.as_ref().err(),
                }),
            ))
        }
    }
}

/// Whether `ep` has no `/responses` route, asked with a request of the gateway's own that
/// carries nothing of any client's: `POST {base}/responses` with the endpoint's own model and
/// no input. A server with the route refuses that body (400, or 401/422 and the like) — naming
/// a model it serves, so a 404 for an unknown model cannot pass for a missing route; one
/// without it answers 404 or 405. `Ok(Some(status))` only for those; `Err` (no answer, no key)
/// says nothing. A client's 404 can be about its own request (an id it named): only this
/// answer marks the endpoint chat-only for everyone.
pub async fn responses_route_missing(
    state: &AppState,
    ep: &Endpoint,
    timeout: Duration,
) -> Result<Option<u16>, String> {
    let base = if ep.discover {
        state
            .registry
            .discovered_base(&ep.name)
            .ok_or("no discovered address")?
    } else {
        ep.base_url.clone()
    };
    let mut rb = with_headers(
        ep,
        ep.client
            .post(format!("{}/responses", base.trim_end_matches('/')))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(serde_json::json!({ "model": ep.upstream_model }).to_string()),
    );
    if let crate::routing::registry::KeyPick::Use(i) = state.registry.current_key(ep)
        && let Some(k) = ep.keys[i].value.as_ref()
    {
        rb = rb.bearer_auth(k.expose());
    } else if ep.needs_key() {
        return Err("no usable key".into());
    }
    let (status, _, _) = get_with(rb, timeout).await?;
    Ok(matches!(status, 404 | 405).then_some(status))
}

/// A vLLM probe's queue (`num_requests_waiting` + `num_requests_running` from its `/metrics`),
/// for the balancer's cost; `None` without a sample. A server's numbers are not trusted: what
/// is not a finite, non-negative number is no sample, and a huge one is read as 100,000.
fn queue_of(detail: &Value) -> Option<u32> {
    let load = detail.get("load")?;
    let read = |k: &str| {
        load.get(k)
            .and_then(Value::as_f64)
            .filter(|x| x.is_finite() && *x >= 0.0)
    };
    let (w, r) = (read("num_requests_waiting"), read("num_requests_running"));
    if w.is_none() && r.is_none() {
        return None;
    }
    Some((w.unwrap_or(0.0) + r.unwrap_or(0.0)).min(100_000.0) as u32)
}

/// Probes every endpoint of the live config every `health.probe_interval` until cancelled.
pub async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    let memory: std::sync::Mutex<std::collections::HashMap<String, Memory>> = Default::default();
    loop {
        let cfg = state.config.load_full();
        let hp = cfg.health;
        let thresholds = cfg.policy.health;
        let eps: Vec<Arc<Endpoint>> = cfg.endpoints.values().cloned().collect();
        let out_of_files_before = crate::upstream::out_of_files_count();
        let st = &state;
        let mem = &memory;
        // Every address of an endpoint of several (`base_urls`, or discovered tasks) each round,
        // each one's verdict its own; else its one address (a discovered endpoint where it runs
        // now; before discovery, not at all).
        let targets: Vec<(&Arc<Endpoint>, Option<String>, bool)> = eps
            .iter()
            .flat_map(|ep| {
                let several = st.registry.address_list(&ep.name);
                if several.len() > 1 {
                    several.into_iter().map(|b| (ep, Some(b), true)).collect()
                } else if ep.discover {
                    vec![(ep, st.registry.discovered_base(&ep.name), false)]
                } else {
                    vec![(ep, Some(ep.base_url.clone()), false)]
                }
            })
            .collect();
        let probed = join_all(targets.into_iter().map(|(ep, base, several)| async move {
            let addr = base.clone();
            // The key requests would use now, not always the first: a revoked first key must not
            // make a probe fail while the second serves.
            let key = match st.registry.current_key(ep) {
                crate::routing::registry::KeyPick::Use(i) => ep.keys[i]
                    .value
                    .as_ref()
                    .map(|v| (i, v.expose().to_string())),
                _ => None,
            };
            if ep.needs_key() && key.is_none() {
                // No usable key: the endpoint is auth_failed already; a keyless probe would
                // only report a 401 about nothing.
                return (ep.name.clone(), addr, several, None);
            }
            let Some(base) = base else {
                return (ep.name.clone(), addr, several, None);
            };
            let root = base.trim_end_matches('/').trim_end_matches("/v1").to_string();
            let mut report = match &ep.health_check {
                Some(hc) => {
                    let mut m = std::mem::take(mem.lock().unwrap_or_else(|e| e.into_inner()).entry(ep.name.clone()).or_default());
                    let (report, purge) = probe_custom(ep, &root, hc, &hp, &mut m).await;
                    mem.lock().unwrap_or_else(|e| e.into_inner()).insert(ep.name.clone(), m);
                    if purge && let Some(hook) = &hc.purge {
                        let method = reqwest::Method::from_bytes(hook.method.as_bytes()).unwrap_or(reqwest::Method::POST);
                        let res = get_with(with_headers(ep, ep.client.request(method, absolute(&hook.url, &root))), hp.probe_timeout).await;
                        let outcome = match res {
                            Ok((s, _, _)) if (200..300).contains(&s) => "ok".to_string(),
                            Ok((s, _, _)) => format!("status {s}"),
                            Err(e) => e,
                        };
                        st.registry.record_event(
                            &ep.name,
                            "kv_cache_purge",
                            &format!("KV cache grew across {} probes with no fall; called {} {}; result: {outcome}", hc.kv_growth_probes.unwrap_or(5), hook.method, hook.url),
                        );
                    }
                    Some(report)
                }
                None => probe(ep, &base, key.as_ref().map(|(i, k)| (*i, k.as_str())), &hp).await,
            };
            if ep.semantic_probe
                && let Some(r) = report.as_mut()
                && matches!(r.result, ProbeResult::Healthy | ProbeResult::Degraded(_))
                && r.counts
                && let Err(e) = probe_semantic(ep, &base, key.as_ref().map(|(_, k)| k.as_str()), hp.probe_timeout.max(Duration::from_secs(10))).await
            {
                r.result = ProbeResult::Unhealthy(e.clone());
                r.ok = false;
                r.detail["semantic_probe"] = json!(e);
            }
            (ep.name.clone(), addr, several, report)
        }))
        .await;
        // An endpoint of several addresses: each address told its own verdict; the endpoint's
        // report is a passing one if any passed (it is unhealthy only when no address serves).
        let mut results: Vec<(String, Option<crate::routing::observed::ProbeReport>)> = Vec::new();
        for (name, addr, several, report) in probed {
            if several
                && let (Some(a), Some(r), Some(ep)) = (&addr, &report, cfg.endpoints.get(&name))
            {
                let tuning = crate::routing::registry::tuning(&cfg, ep);
                // Busy (vLLM's queue over its mark, the KV cache full) is load, which the
                // queue sample below weighs: only a probe that failed counts against it.
                let ok = !matches!(r.result, ProbeResult::Unhealthy(_));
                st.registry.address_probed(&name, a, ok, &tuning);
                if let Some(q) = queue_of(&r.detail) {
                    st.registry.address_queue(&name, a, q);
                }
            }
            match results.iter_mut().find(|(n, _)| *n == name) {
                Some((_, slot)) => {
                    let better = match (&*slot, &report) {
                        (None, Some(_)) => true,
                        (Some(old), Some(new)) => !old.ok && new.ok,
                        _ => false,
                    };
                    if better {
                        *slot = report;
                    }
                }
                None => results.push((name, report)),
            }
        }

        // A connection that could not be made for want of file descriptors in this process says
        // nothing of the endpoint: while that happened, no failed probe is taken as a verdict
        // (the endpoints keep the state they had), or the gateway's own exhaustion would mark
        // every endpoint unhealthy and keep them out after the descriptors came back.
        let starved = crate::upstream::out_of_files_count() != out_of_files_before;
        if starved {
            tracing::warn!(
                "out of file descriptors during this probe round: its failures are set aside"
            );
        }
        for (name, report) in results {
            if let Some(r) = report
                && (!starved || r.ok)
            {
                if let Some(i) = r.rejected_key
                    && let Some(ep) = cfg.endpoints.get(&name)
                {
                    let detail = match &r.result {
                        ProbeResult::Unhealthy(d) => d.clone(),
                        _ => "probe rejected the key".into(),
                    };
                    state.registry.apply(
                        ep,
                        &cfg.policy,
                        crate::routing::registry::Effect::KeyRejected {
                            key: i,
                            detail: format!("probe: {detail}"),
                        },
                    );
                }
                if r.counts {
                    state.registry.observe_probe(&name, &r.result, &thresholds);
                }
                state.registry.set_probe(&name, r);
            }
        }
        // A probe round is done: what the endpoints said is known (a new gateway may serve).
        state.startup.probed();
        // Ejected endpoints recover through the next probe; probe them sooner.
        let interval = if cfg.endpoints.keys().any(|n| state.registry.is_ejected(n)) {
            hp.probe_interval.min(thresholds.eject_base)
        } else {
            hp.probe_interval
        };
        // An ejection while waiting (live traffic's, between rounds) brings the next round to
        // within `eject_base` of it: ejected endpoints are probed sooner, not an interval on.
        let mut until = tokio::time::Instant::now() + interval;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep_until(until) => break,
                _ = state.registry.ejected() => {
                    until = until.min(tokio::time::Instant::now() + thresholds.eject_base);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hc() -> crate::config::RawHealthCheck {
        serde_yaml_ng::from_str(
            "url: /health\nexpect: { status: healthy }\ngpu_memory_total_mb: 10000\nkv_growth_probes: 3\npurge: { url: /purge }\n",
        )
        .unwrap()
    }

    #[test]
    fn custom_health_rules() {
        let mut m = Memory::default();
        let ok = r#"{"status":"healthy","gpu_memory_used_mb":4210,"kv_cache_size_mb":187,"uptime_seconds":3621}"#;
        assert_eq!(judge_custom(&hc(), 200, ok, &mut m).0, ProbeResult::Healthy);
        let hot = r#"{"status":"healthy","gpu_memory_used_mb":9300,"uptime_seconds":3621}"#;
        assert!(matches!(
            judge_custom(&hc(), 200, hot, &mut m).0,
            ProbeResult::Degraded(_)
        ));
        let young = r#"{"status":"healthy","uptime_seconds":12}"#;
        assert!(matches!(
            judge_custom(&hc(), 200, young, &mut m).0,
            ProbeResult::Warming(_)
        ));
        let bad = r#"{"status":"loading"}"#;
        assert!(matches!(
            judge_custom(&hc(), 200, bad, &mut m).0,
            ProbeResult::Unhealthy(_)
        ));
        assert!(matches!(
            judge_custom(&hc(), 503, ok, &mut m).0,
            ProbeResult::Unhealthy(_)
        ));
    }

    #[test]
    fn kv_growth_calls_the_purge_hook_once() {
        let mut m = Memory::default();
        let body = |kv: u32| {
            format!(r#"{{"status":"healthy","kv_cache_size_mb":{kv},"uptime_seconds":999}}"#)
        };
        assert!(!judge_custom(&hc(), 200, &body(100), &mut m).1);
        assert!(!judge_custom(&hc(), 200, &body(150), &mut m).1);
        assert!(
            judge_custom(&hc(), 200, &body(200), &mut m).1,
            "grew across 3 probes"
        );
        assert!(!judge_custom(&hc(), 200, &body(250), &mut m).1, "once");
        // A fall re-arms it.
        assert!(!judge_custom(&hc(), 200, &body(50), &mut m).1);
        assert!(!judge_custom(&hc(), 200, &body(60), &mut m).1);
        assert!(judge_custom(&hc(), 200, &body(70), &mut m).1);
    }
}
