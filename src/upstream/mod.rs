//! Protocol adapters: how a validated OpenAI-shaped request becomes an HTTP request to each kind
//! of upstream, and how the answer comes back in OpenAI's wire format. One `match` on the
//! endpoint kind, no trait objects. vLLM and other OpenAI-compatible servers reuse the OpenAI path
//! unchanged (unknown fields pass through); Ollama goes through its native API with the
//! translation in [`ollama`].

pub mod classify;
pub mod metrics;
pub mod ollama;
pub mod tokenize;

use serde_json::{Map, Value};

use crate::config::{Endpoint, EndpointKind, Secret};
use crate::wire::Op;

/// The body sent upstream: the client's body with `model` replaced by the endpoint's id and,
/// when the client asked for more, `max_tokens` capped at the endpoint's configured maximum. Every
/// other field passes through untouched. Serialised straight from the client's map, without
/// copying it.
pub fn body(ep: &Endpoint, op: Op, client: &Map<String, Value>) -> Vec<u8> {
    let cap = match op {
        Op::Chat | Op::Completions => ep.max_tokens,
        Op::Embeddings => None,
    };
    serde_json::to_vec(&Outgoing {
        map: client,
        model: &ep.upstream_model,
        cap,
    })
    .unwrap_or_default()
}

struct Outgoing<'a> {
    map: &'a Map<String, Value>,
    model: &'a str,
    cap: Option<u64>,
}

impl serde::Serialize for Outgoing<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(None)?;
        if !self.map.contains_key("model") {
            m.serialize_entry("model", self.model)?;
        }
        for (k, v) in self.map {
            match (k.as_str(), self.cap, v.as_u64()) {
                ("model", _, _) => m.serialize_entry(k, self.model)?,
                ("max_tokens" | "max_completion_tokens", Some(cap), Some(n)) if n > cap => {
                    m.serialize_entry(k, &cap)?
                }
                _ => m.serialize_entry(k, v)?,
            }
        }
        m.end()
    }
}

/// Builds the request for one attempt, with the endpoint's payload hygiene applied; returns it
/// with the number of characters hygiene changed. `Err` when the request cannot be expressed in
/// the endpoint's protocol (the executor skips the endpoint without holding it against it).
pub fn request(
    ep: &Endpoint,
    op: Op,
    client_body: &Map<String, Value>,
    stream: bool,
    key: Option<&Secret>,
    request_id: &str,
    discovered_base: Option<&str>,
) -> Result<(reqwest::RequestBuilder, u64), ollama::Unsupported> {
    let (client_body, sanitized) = crate::wire::hygiene::apply(client_body, ep.payload_hygiene);
    let payload = match ep.kind {
        EndpointKind::Openai | EndpointKind::Vllm => body(ep, op, &client_body),
        EndpointKind::Ollama => {
            serde_json::to_vec(&ollama::request_body(ep, op, &client_body, stream)?)
                .unwrap_or_default()
        }
    };
    let payload = if ep.payload_hygiene == crate::config::Hygiene::Escape {
        crate::wire::hygiene::escape_wire(payload)
    } else {
        payload
    };
    let url = match discovered_base {
        // A discovered task's address: built per request (it moves as tasks come and go).
        Some(base) => reqwest::Url::parse(&crate::config::url_for(ep.kind, base, op))
            .map_err(|e| ollama::Unsupported(format!("discovered address {base}: {e}")))?,
        // Parsed once per config load; cloning a `Url` skips reqwest's parse (and IDNA) per call.
        None => ep.urls[op as usize].clone(),
    };
    let mut rb = ep
        .client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id)
        .body(payload);
    if let Some(k) = key {
        rb = rb.bearer_auth(k.expose());
    }
    for (k, v) in &ep.headers {
        rb = rb.header(k.as_str(), v.as_str());
    }
    Ok((rb, sanitized))
}
