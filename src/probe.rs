//! Background probes of what each backend says about itself, off the request path: vLLM's
//! `/health` and `/metrics` (queue and KV-cache load), Ollama's `/api/tags` (is the configured
//! model present?) and `/api/ps` (is it loaded?). Results are shown in `/status` under
//! `endpoints.<name>.probe`. Probes run concurrently, each under `health.probe_timeout`, and never
//! bill a token.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::join_all;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::config::{Endpoint, EndpointKind};
use crate::state::AppState;
use crate::upstream::metrics;

/// What one probe found.
#[derive(Clone, Debug)]
pub struct ProbeReport {
    pub at: SystemTime,
    pub ok: bool,
    pub detail: Value,
}

fn root(ep: &Endpoint) -> &str {
    ep.base_url.trim_end_matches('/').trim_end_matches("/v1")
}

async fn get(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<(u16, String), String> {
    let fut = async {
        let r = client.get(url).send().await.map_err(|e| e.to_string())?;
        let status = r.status().as_u16();
        let text = r.text().await.map_err(|e| e.to_string())?;
        Ok::<_, String>((status, text))
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| format!("no answer within {}ms", timeout.as_millis()))?
}

/// Probes one endpoint. OpenAI-type endpoints have no free self-description here; they report
/// nothing (the health issue adds a keyed `/models` probe).
pub async fn probe(ep: &Endpoint, timeout: Duration) -> Option<ProbeReport> {
    let at = SystemTime::now();
    match ep.kind {
        EndpointKind::Openai => None,
        EndpointKind::Vllm => {
            let base = root(ep);
            let health = get(&ep.client, &format!("{base}/health"), timeout).await;
            let load = get(&ep.client, &format!("{base}/metrics"), timeout).await;
            let alive = matches!(health, Ok((200, _)));
            let load = match load {
                Ok((200, text)) => serde_json::to_value(metrics::parse_vllm(&text)).ok(),
                _ => None,
            };
            Some(ProbeReport {
                at,
                ok: alive,
                detail: json!({
                    "health": match &health { Ok((s, _)) => json!(s), Err(e) => json!(e) },
                    "load": load,
                }),
            })
        }
        EndpointKind::Ollama => {
            let base = root(ep);
            let tags = get(&ep.client, &format!("{base}/api/tags"), timeout).await;
            let ps = get(&ep.client, &format!("{base}/api/ps"), timeout).await;
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
            Some(ProbeReport {
                at,
                ok: present == Some(true),
                detail: json!({
                    "model": want,
                    "model_present": present,
                    "model_loaded": loaded,
                    "error": tags.as_ref().err(),
                }),
            })
        }
    }
}

/// Probes every endpoint of the live config every `health.probe_interval` until cancelled.
pub async fn run(state: Arc<AppState>, cancel: CancellationToken) {
    loop {
        let cfg = state.config.load_full();
        let timeout = cfg.health.probe_timeout;
        let eps: Vec<Arc<Endpoint>> = cfg.endpoints.values().cloned().collect();
        let results = join_all(
            eps.iter()
                .map(|ep| async move { (ep.name.clone(), probe(ep, timeout).await) }),
        )
        .await;
        for (name, report) in results {
            if let Some(r) = report {
                state.registry.set_probe(&name, r);
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(cfg.health.probe_interval) => {}
        }
    }
}
