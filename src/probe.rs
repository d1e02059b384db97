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
use crate::health::ProbeResult;
use crate::state::AppState;
use crate::upstream::metrics;

/// What one probe found.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    pub at: SystemTime,
    pub ok: bool,
    pub detail: Value,
    pub result: ProbeResult,
}

async fn get(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    get_with(client.get(url), timeout)
        .await
        .map(|(s, _, t)| (s, t))
}

async fn get_with(
    rb: reqwest::RequestBuilder,
    timeout: Duration,
) -> Result<(u16, reqwest::header::HeaderMap, String), String> {
    let fut = async {
        let r = rb.send().await.map_err(|e| e.to_string())?;
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.map_err(|e| e.to_string())?;
        Ok::<_, String>((status, headers, text))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("no answer within {}ms", timeout.as_millis()))?
}

/// Probes one endpoint at `base` (its configured or discovered API root).
pub async fn probe(
    ep: &Endpoint,
    base: &str,
    key: Option<&str>,
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
            let mut rb = ep
                .client
                .get(format!("{}/models", base.trim_end_matches('/')));
            if let Some(k) = key {
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
            Some(ProbeReport {
                at,
                ok: result == ProbeResult::Healthy,
                detail,
                result,
            })
        }
        EndpointKind::Vllm => {
            let health = get(&ep.client, &format!("{root}/health"), timeout).await;
            let load = get(&ep.client, &format!("{root}/metrics"), timeout).await;
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
            Some(ProbeReport {
                at,
                ok: result == ProbeResult::Healthy,
                detail: json!({
                    "health": match &health { Ok((s, _)) => json!(s), Err(e) => json!(e) },
                    "load": load.and_then(|l| serde_json::to_value(l).ok()),
                }),
                result,
            })
        }
        EndpointKind::Ollama => {
            let tags = get(&ep.client, &format!("{root}/api/tags"), timeout).await;
            let ps = get(&ep.client, &format!("{root}/api/ps"), timeout).await;
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
            Some(ProbeReport {
                at,
                ok: result == ProbeResult::Healthy,
                detail: json!({
                    "model": want,
                    "model_present": present,
                    "model_loaded": loaded,
                    "error": tags.as_ref().err(),
                }),
                result,
            })
        }
    }
}

/// Probes every endpoint of the live config every `health.probe_interval` until cancelled.
pub async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    loop {
        let cfg = state.config.load_full();
        let hp = cfg.health;
        let thresholds = cfg.policy.health;
        let eps: Vec<Arc<Endpoint>> = cfg.endpoints.values().cloned().collect();
        let st = &state;
        let results = join_all(eps.iter().map(|ep| async move {
            // A discovered endpoint is probed where it runs now; before discovery, not at all.
            let base = if ep.discover {
                st.registry.discovered_base(&ep.name)
            } else {
                Some(ep.base_url.clone())
            };
            let key = ep
                .keys
                .iter()
                .find_map(|k| k.value.as_ref().map(|v| v.expose().to_string()));
            let report = match base {
                Some(b) => probe(ep, &b, key.as_deref(), &hp).await,
                None => None,
            };
            (ep.name.clone(), report)
        }))
        .await;
        for (name, report) in results {
            if let Some(r) = report {
                state.registry.observe_probe(&name, &r.result, &thresholds);
                state.registry.set_probe(&name, r);
            }
        }
        // Ejected endpoints recover through the next probe; probe them sooner.
        let interval = if cfg.endpoints.keys().any(|n| state.registry.is_ejected(n)) {
            hp.probe_interval.min(thresholds.eject_base)
        } else {
            hp.probe_interval
        };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}
