//! What upstreams taught about an endpoint: a context window smaller than configured, and that
//! it has no `/responses` route (asked by a probe at most once a minute).

use std::time::Duration;

use tokio::time::Instant;

use super::{LearnedWindow, MIN_LEARNED_WINDOW, Registry, lock};
use crate::config::Endpoint;
use crate::routing::observed::Fact;

impl Registry {
    /// The window to plan with: the configured one, lowered by what the upstream said.
    pub fn effective_window(&self, ep: &Endpoint) -> Option<u64> {
        let learned = self
            .get(&ep.name)
            .and_then(|rt| lock(&rt).learned_window.as_ref().map(|l| l.tokens));
        match (ep.context_window, learned) {
            (Some(c), Some(l)) => Some(c.min(l)),
            (c, l) => c.or(l),
        }
    }

    /// Records a limit an upstream stated (a context-length error of the request `request_id`, or
    /// its `/tokenize`), if it teaches anything new and can be true: never below
    /// [`MIN_LEARNED_WINDOW`], nor below the largest request the endpoint served in full within
    /// the stats window.
    /// Whether `/v1/responses` passes through to `ep`: it has the `responses` capability and
    /// has not answered 404 for `/responses`.
    pub fn speaks_responses(&self, ep: &Endpoint) -> bool {
        ep.caps.contains(crate::config::Capability::Responses)
            && self
                .get(&ep.name)
                .is_none_or(|rt| lock(&rt).chat_only.is_none())
    }

    /// Whether a probe of `ep`'s `/responses` route may start now: at most one a minute an
    /// endpoint, however many clients' requests answer 404 (the caller makes it).
    pub fn responses_probe_due(&self, ep: &Endpoint) -> bool {
        const EVERY: Duration = Duration::from_secs(60);
        let Some(rt) = self.get(&ep.name) else {
            return false;
        };
        let mut rt = lock(&rt);
        if rt.chat_only.is_some() {
            return false;
        }
        let now = Instant::now();
        if rt
            .responses_probed
            .is_some_and(|t| now.saturating_duration_since(t) < EVERY)
        {
            return false;
        }
        rt.responses_probed = Some(now);
        true
    }

    /// `ep` has no `/responses` route (a probe of the gateway's own said so, never a client's
    /// answer alone): it speaks only chat, which costs nothing but translation.
    pub fn mark_chat_only(&self, ep: &Endpoint, detail: &str) {
        let Some(rt) = self.get(&ep.name) else {
            return;
        };
        let first = {
            let mut rt = lock(&rt);
            let first = rt.chat_only.is_none();
            rt.chat_only = Some(detail.chars().take(300).collect());
            first
        };
        if first {
            self.event(
                &ep.name,
                "responses_unsupported",
                "a probe with no client content answered 404/405 for /responses: /v1/responses goes to it by translation to chat",
            );
        }
    }

    pub fn learn_window(&self, ep: &Endpoint, tokens: u64, request_id: &str) {
        self.learn_window_from(ep, tokens, request_id, true);
    }

    /// [`Registry::learn_window`]; `share`: learned here (not from another replica).
    pub(super) fn learn_window_from(
        &self,
        ep: &Endpoint,
        tokens: u64,
        request_id: &str,
        share: bool,
    ) {
        let Some(rt) = self.get(&ep.name) else {
            return;
        };
        {
            let mut rt = lock(&rt);
            let current = match (ep.context_window, rt.learned_window.as_ref()) {
                (Some(c), Some(l)) => Some(c.min(l.tokens)),
                (c, l) => c.or(l.map(|l| l.tokens)),
            };
            if current.is_some_and(|c| c <= tokens) {
                return;
            }
            let served = rt.window.counts(Instant::now()).served_max;
            if tokens < MIN_LEARNED_WINDOW || tokens < served {
                drop(rt);
                tracing::warn!(
                    endpoint = %ep.name,
                    request_id,
                    stated = tokens,
                    served,
                    "a stated context limit below what the endpoint holds is not learned"
                );
                return;
            }
            rt.learned_window = Some(LearnedWindow {
                tokens,
                request_id: request_id.to_string(),
            });
        }
        self.store.send(crate::store::Record::LearnedWindow {
            endpoint: ep.name.clone(),
            learned: Some((tokens, request_id.to_string(), ep.fingerprint.clone())),
        });
        if share {
            self.share(Fact::Window {
                endpoint: ep.name.clone(),
                fingerprint: ep.fingerprint.clone(),
                tokens,
                request_id: request_id.to_string(),
            });
        }
        self.event(
            &ep.name,
            "context_window_learned",
            &format!("upstream stated a context limit of {tokens} tokens (request {request_id})"),
        );
    }
}
