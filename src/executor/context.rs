//! The context-size side of a request: its prompt counted once per counting method (a backend's
//! `/tokenize` when configured), the overflow policy (`reject` with a 400 that says what would fit,
//! or `truncate` to the largest window that refused it).

use std::sync::Arc;

use axum::response::Response;
use serde_json::Value;

use super::{BLOCKING_COUNT_CHARS, Run};
use crate::config::{Endpoint, Overflow};
use crate::error::ApiError;
use crate::tokens::{self, Count, truncate};
use crate::upstream;
use crate::wire;

impl Run {
    /// `routes.<name>.on_context_overflow`, else the named endpoint's, else the policy's.
    pub(super) fn overflow_policy(&self) -> Overflow {
        self.cfg
            .route_overflow
            .get(&self.req.model)
            .copied()
            .or_else(|| {
                self.cfg
                    .endpoints
                    .get(&self.req.model)
                    .and_then(|e| e.on_context_overflow)
            })
            .unwrap_or(self.cfg.policy.on_context_overflow)
    }

    pub(super) fn requested_max_tokens(&self) -> u64 {
        self.req
            .token_field(wire::TokenField::MaxCompletionTokens)
            .or_else(|| self.req.token_field(wire::TokenField::MaxTokens))
            .flatten()
            .unwrap_or(0)
    }

    /// Prompt tokens as `ep` counts them. Large bodies are counted on the blocking pool so the
    /// async workers keep serving.
    pub(super) async fn prompt_tokens(&mut self, ep: &Endpoint) -> Count {
        if ep.backend_tokenize.is_some() && !self.backend_failed.contains(&ep.name) {
            let key = format!("backend:{}", ep.name);
            if let Some(c) = self.counts.get(&key) {
                return c.clone();
            }
            // Asked once per request: a failing backend costs one timeout, not one per check.
            self.backend_failed.insert(ep.name.clone());
            let t = tokio::time::Instant::now();
            let counted = Box::pin(upstream::tokenize::backend_count(
                ep,
                self.req.op,
                self.req.body(),
            ))
            .await;
            self.waited += t.elapsed();
            if let Some(b) = counted {
                self.backend_failed.remove(&ep.name);
                if let Some(max) = b.max_model_len {
                    self.app.registry.learn_window(ep, max, &self.request_id);
                }
                let count = Count {
                    tokens: b.tokens,
                    exact: true,
                };
                self.counted_prompt.get_or_insert(count.tokens);
                self.counts.insert(key, count.clone());
                return count;
            }
        }
        let counter = &ep.counter;
        if !counter.ready() {
            // Built the first time a prompt needs it (60 ms for o200k, once per process), on
            // the blocking pool; requests that arrive meanwhile wait for the same build.
            counter.built().await;
        }
        let key = counter.method();
        if let Some(c) = self.counts.get(&key) {
            return c.clone();
        }
        let count = if self.req.tokenized_chars() > BLOCKING_COUNT_CHARS {
            let counter = counter.clone();
            let req = self.req.clone();
            crate::tokens::pool::run(move || counter.request(req.op, req.body()))
                .await
                .unwrap_or(Count {
                    tokens: 0,
                    exact: false,
                })
        } else {
            counter.request(self.req.op, self.req.body())
        };
        self.counted_prompt.get_or_insert(count.tokens);
        self.counts.insert(key, count.clone());
        count
    }

    /// The 400 for a request no endpoint's window holds.
    pub(super) async fn reject_overflow(&mut self, chain: &[String]) -> Response {
        let largest = chain
            .iter()
            .filter_map(|n| {
                let ep = self.cfg.endpoints.get(n)?;
                Some((ep.clone(), self.app.registry.effective_window(ep)?))
            })
            .max_by_key(|(_, w)| *w);
        // An upstream's refusal can come before any count (the byte bound fit its window as
        // configured): the message says what the prompt needs, as the largest endpoint counts.
        if self.counted_prompt.is_none()
            && let Some((ep, _)) = &largest
        {
            self.prompt_tokens(ep).await;
        }
        let largest = largest.map(|(ep, w)| (ep.name.clone(), w));
        let counted = self.counted_prompt.unwrap_or(0);
        let max = self.requested_max_tokens();
        let message = match largest {
            Some((name, w)) => format!(
                "This request needs {counted} prompt tokens plus {max} for the completion; the largest context window in its chain is {w} tokens (endpoint `{name}`), of which {:.0}% may be used. Shorten the messages or set on_context_overflow: truncate.",
                self.cfg.policy.context_fill * 100.0
            ),
            None => format!(
                "This request needs {counted} prompt tokens plus {max} for the completion, more than any endpoint in its chain accepts."
            ),
        };
        self.context_error(message)
    }

    /// A 400 `context_length_exceeded` the gateway itself decided, recorded in the audit trail.
    pub(super) fn context_error(&mut self, message: String) -> Response {
        let err = ApiError::InvalidRequest {
            message,
            param: Some("messages"),
            code: Some("context_length_exceeded"),
        };
        self.gateway_error(err, "context_length_exceeded")
    }

    /// Trims the conversation to the largest window that refused it; `Err` is the response when
    /// even the protected part does not fit.
    pub(super) async fn truncate_to_fit(&mut self) -> Result<(), Response> {
        let Some((name, window)) = self.context_skipped.iter().max_by_key(|(_, w)| *w).cloned()
        else {
            return Err(self.all_failed());
        };
        let Some(ep) = self.cfg.endpoints.get(&name).cloned() else {
            return Err(self.all_failed());
        };
        let budget = ((window as f64 * self.cfg.policy.context_fill).floor() as u64)
            .saturating_sub(self.requested_max_tokens());
        let req = self.req.clone();
        let counter = ep.counter.clone();
        let opts = self.cfg.policy.truncation;
        // Counting the tools and the messages is BPE work on all of the request: off the
        // async workers, on the counting threads, as one request's counting (`tokens::scope`).
        let result = crate::tokens::pool::run(move || {
            crate::tokens::scope(|| {
                let body = req.body();
                let messages: &[Value] = body
                    .get("messages")
                    .and_then(Value::as_array)
                    .map_or(&[], Vec::as_slice);
                let tools = body
                    .get("tools")
                    .and_then(Value::as_array)
                    .map(|t| counter.tools(t))
                    .unwrap_or(0);
                truncate::truncate(
                    messages,
                    budget,
                    tokens::REPLY_PRIMING + tools,
                    &counter,
                    opts,
                )
            })
        })
        .await;
        match result {
            Some(Ok(t)) => {
                tracing::debug!(request_id = %self.request_id, endpoint = %name, dropped_messages = t.dropped_messages, dropped_tokens = t.dropped_tokens, "conversation truncated to fit");
                self.truncation = Some((t.dropped_messages, t.dropped_tokens));
                Arc::make_mut(&mut self.req)
                    .body_mut()
                    .insert("messages".into(), Value::Array(t.messages));
                self.counts.clear();
                self.prompt_bound = None;
                Ok(())
            }
            Some(Err(e)) => Err(self.context_error(format!(
                "This conversation cannot be truncated to fit: its system messages and latest {} turns alone need {} tokens, and the largest window allows {budget} for the prompt (endpoint `{name}`, {window} tokens).",
                self.cfg.policy.truncation.keep_turns, e.minimum
            ))),
            None => Err(self.all_failed()),
        }
    }
}

pub(super) fn fmt_window(w: Option<u64>) -> String {
    w.map(|w| w.to_string()).unwrap_or_else(|| "unknown".into())
}
