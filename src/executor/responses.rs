//! A `/v1/responses` request's own part of the journey: its gateway response id, the
//! conversation it continues (`previous_response_id`: the endpoint it is pinned to, and the
//! whole conversation replayed as input where the gateway kept it), and the turn it leaves
//! behind for the next one ([`keep`]). The rest of the journey is the chat path's: routing,
//! hedging, the context guard, client limits and the audit row.

use std::collections::BTreeSet;
use std::sync::Arc;

use serde_json::Value;

use crate::config::{Config, Endpoint};
use crate::error::ApiError;
use crate::routing::conversations::{Turn, new_id};
use crate::state::AppState;
use crate::wire::responses::{Meta, input_items};
use crate::wire::{Inbound, Op};

/// What a Responses request carries through the executor.
#[derive(Debug)]
pub struct ResponsesCtx {
    /// The gateway's id for the response (every endpoint's answer is given it).
    pub id: Arc<str>,
    /// The Response object's echo of the request, for answers the gateway writes itself.
    pub meta: Meta,
    /// This turn's own input items (the client's `input`), kept with its output.
    pub turn_input: Arc<Vec<Value>>,
    /// `store: false`: nothing of this turn is kept (and no later turn can refer to it).
    pub store: bool,
    /// The gateway id of the turn this one continues.
    pub previous: Option<String>,
    /// The endpoint that turn was produced on.
    pub pinned: Option<String>,
    /// The address of it that turn was produced at (an endpoint of several).
    pub pinned_address: Option<String>,
    /// That turn was passed through: its endpoint holds the conversation under its own id,
    /// which the request now names as its `previous_response_id`.
    pub native_pin: bool,
    /// The whole conversation as `input` (no `previous_response_id`), for any other endpoint;
    /// `None` when the gateway did not keep it.
    pub replay: Option<Arc<Inbound>>,
}

/// Resolves a Responses request before it is routed: its response id, and, when it continues a
/// conversation, the pin and the replay. The chain comes back with the pinned endpoint first.
/// Errors: 404 `previous_response_not_found` (unknown, expired, `store: false`, or another client
/// key's), 403 `model_not_allowed` (the key may not use the endpoint the conversation is on).
pub fn plan(
    app: &AppState,
    cfg: &Config,
    inbound: &mut Inbound,
    client: Option<&str>,
    allowed: Option<&BTreeSet<String>>,
    chain: Arc<[String]>,
) -> Result<(Arc<[String]>, ResponsesCtx), ApiError> {
    let id: Arc<str> = Arc::from(new_id());
    let body = inbound.body();
    let mut ctx = ResponsesCtx {
        meta: Meta::new(&id, &inbound.model, body),
        id,
        turn_input: Arc::new(input_items(body)),
        store: body.get("store").and_then(Value::as_bool) != Some(false),
        previous: None,
        pinned: None,
        pinned_address: None,
        native_pin: false,
        replay: None,
    };
    let Some(prev) = body
        .get("previous_response_id")
        .and_then(Value::as_str)
        .map(str::to_string)
    else {
        return Ok((chain, ctx));
    };
    let found = app
        .conversations
        .find(&prev, client, cfg.responses.history_ttl)
        .ok_or_else(|| ApiError::PreviousResponseNotFound(prev.clone()))?;
    let pinned = found.turn.endpoint.clone();
    if allowed.is_some_and(|a| !a.contains(&pinned)) {
        return Err(ApiError::ModelNotAllowed {
            model: pinned,
            client: client.unwrap_or_default().to_string(),
        });
    }
    if let Some(history) = found.history {
        let mut b = inbound.body().clone();
        b.remove("previous_response_id");
        let mut input = history;
        input.extend(ctx.turn_input.iter().cloned());
        b.insert("input".into(), Value::Array(input));
        ctx.replay = Some(Arc::new(Inbound::new(
            Op::Responses,
            inbound.model.clone(),
            inbound.stream,
            b,
            inbound.needs.clone(),
        )));
    }
    match found.turn.upstream_id {
        Some(up) => {
            ctx.native_pin = true;
            inbound
                .body_mut()
                .insert("previous_response_id".into(), Value::String(up));
        }
        None => match &ctx.replay {
            // Answered by translation: the gateway holds the conversation, so every endpoint,
            // the pinned one first, gets it replayed.
            Some(r) => *inbound = (**r).clone(),
            None => return Err(ApiError::PreviousResponseNotFound(prev)),
        },
    }
    let mut names = vec![pinned.clone()];
    names.extend(chain.iter().filter(|n| **n != pinned).cloned());
    ctx.previous = Some(prev);
    ctx.pinned = Some(pinned);
    ctx.pinned_address = found.turn.address.clone();
    Ok((names.into(), ctx))
}

impl ResponsesCtx {
    /// The request `ep` gets: the pinned form for the endpoint that holds the conversation
    /// (when it is spoken to natively and has not said it lost it: `lost`), else the replay;
    /// `None` when neither exists (the conversation lives on another endpoint and was not kept).
    pub fn request_for(
        &self,
        req: &Arc<Inbound>,
        ep: &Endpoint,
        translate: bool,
        lost: bool,
    ) -> Option<Arc<Inbound>> {
        let Some(pinned) = &self.pinned else {
            return Some(req.clone());
        };
        if self.native_pin && ep.name == *pinned && !translate && !lost {
            return Some(req.clone());
        }
        self.replay.clone()
    }
}

/// Keeps the turn a served response makes: its pin (the endpoint and address that produced it,
/// the upstream's id) always, unless
/// `store: false`; its input and output items and the Response object when the gateway answered
/// by translation (it is then the only one that has them) or `responses.history: keep`.
pub fn keep(
    app: &AppState,
    cfg: &Config,
    ctx: &ResponsesCtx,
    client: Option<&str>,
    (endpoint, address): (&str, Option<&str>),
    upstream_id: Option<String>,
    response: &Value,
) {
    if !ctx.store {
        return;
    }
    let translated = upstream_id.is_none();
    let (items, kept) = if translated || cfg.responses.keep_history {
        let mut items: Vec<Value> = ctx.turn_input.as_ref().clone();
        if let Some(out) = response.get("output").and_then(Value::as_array) {
            items.extend(out.iter().cloned());
        }
        (Some(Arc::new(items)), Some(Arc::new(response.clone())))
    } else {
        (None, None)
    };
    let turn = Turn {
        endpoint: endpoint.to_string(),
        upstream_id,
        client: client.map(str::to_string),
        previous: ctx.previous.clone(),
        address: address.map(str::to_string),
        items,
        response: kept,
    };
    // With `cluster:`, the other replicas can continue it too (stored off the request path).
    if let Some(cluster) = app.cluster.get()
        && let Ok(rt) = tokio::runtime::Handle::try_current()
    {
        let (cluster, id, json) = (cluster.clone(), ctx.id.to_string(), turn.to_json());
        let (bounds, client) = (cfg.responses.bounds(), client.map(str::to_string));
        rt.spawn(async move { cluster.put_turn(&id, client.as_deref(), json, bounds).await });
    }
    app.conversations
        .keep(&ctx.id, turn, cfg.responses.bounds());
}

/// The most turns of one conversation read from the shared store.
const SHARED_TURNS: usize = 256;

/// With `cluster:`, brings the conversation `id` ends (a turn another replica served) from the
/// shared store into this replica's, turn by turn back to its first or to one kept here; all of
/// it within `cluster.timeout`. What does not arrive in time is simply not there: the request
/// then finds the pin without the history, or nothing.
pub async fn fetch_shared(app: &AppState, cfg: &Config, id: &str) {
    // Ids the gateway gives are plain tokens; anything else is no key to look up.
    let Some(cluster) = app.cluster.get().filter(|_| plain_id(id)) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + cluster.settings().timeout;
    let mut at = Some(id.to_string());
    for _ in 0..SHARED_TURNS {
        let Some(cur) = at.take().filter(|c| !app.conversations.has(c)) else {
            return;
        };
        let Some(text) = cluster
            .get_turn(&cur, cfg.responses.history_max_bytes, deadline)
            .await
        else {
            return;
        };
        let Some(turn) = Turn::from_json(&text) else {
            return;
        };
        at = turn.previous.clone();
        app.conversations.keep(&cur, turn, cfg.responses.bounds());
    }
}

/// An upstream's id is put in a URL path only when it is a plain token.
fn plain_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 256
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `GET` or `DELETE` of the response the endpoint `ep` holds as `upstream_id`
/// (`{base}/responses/{id}`), with one of its keys, within its `timeouts.total`: the status and
/// the JSON answer, or `None` when it could not be asked or did not answer.
pub async fn upstream_call(
    app: &AppState,
    cfg: &Config,
    ep: &Endpoint,
    upstream_id: &str,
    delete: bool,
) -> Option<(u16, Value)> {
    use crate::routing::registry::KeyPick;
    if !plain_id(upstream_id) {
        return None;
    }
    let base = match ep.discover {
        true => reqwest::Url::parse(&crate::config::url_for(
            ep.kind,
            &app.registry.discovered_base(&ep.name)?,
            Op::Responses,
        ))
        .ok()?,
        false => ep.urls[Op::Responses as usize].clone(),
    };
    let url = format!("{}/{upstream_id}", base.as_str().trim_end_matches('/'));
    let mut rb = if delete {
        ep.client.delete(url)
    } else {
        ep.client.get(url)
    };
    if let KeyPick::Use(i) = app.registry.pick_key(ep)
        && let Some(k) = ep.keys.get(i).and_then(|k| k.value.as_ref())
    {
        rb = rb.bearer_auth(k.expose());
    }
    for (k, v) in &ep.headers {
        rb = rb.header(k.as_str(), v.expose());
    }
    let resp = tokio::time::timeout(ep.timeouts.total, rb.send())
        .await
        .ok()?
        .ok()?;
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(
        ep.timeouts.total,
        crate::upstream::reqwest_body(resp, cfg.max_response_bytes),
    )
    .await
    .ok()?
    .ok()?;
    let v = serde_json::from_slice(&body).unwrap_or(Value::Null);
    Some((status, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_plain_upstream_id_goes_into_a_url() {
        assert!(plain_id("resp_955031acc59e3a4c"));
        assert!(plain_id("resp-ABC_09"));
        for hostile in [
            "",
            "../admin",
            "resp/../../x",
            "resp?x=1",
            "resp#x",
            "resp x",
            "resp%2F",
            "résp",
            &"a".repeat(257),
        ] {
            assert!(!plain_id(hostile), "{hostile:?}");
        }
    }
}
