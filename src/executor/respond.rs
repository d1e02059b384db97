//! How a request ends: the response the client gets (served, passed-through client error, 503
//! with every attempt, 504 at the request deadline), its `x-autohedge-*` headers, and the one audit
//! row that goes with it.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::time::Instant;

use super::Run;
use super::attempt::Success;
use super::stream::{Continuation, PassThrough, StreamGuard, StreamResponses, pump};
use super::usage::fill_usage;
use crate::config::Endpoint;
use crate::error::{ApiError, AttemptReport};
use crate::routing::outcome::Outcome;
use crate::store::{AttemptRow, RequestRow};
use crate::upstream::classify;
use crate::wire;

impl Run {
    /// The 504 when `routing_policy.request_timeout` passed before anything was served.
    pub(super) fn request_timed_out(&mut self) -> Response {
        for (ep, t0, trace) in self.in_flight() {
            let panic_mode = self.panic_mode.contains(&ep.name);
            self.attempts.push(AttemptReport {
                endpoint: ep.name.clone(),
                status: None,
                class: Outcome::Timeout,
                latency_ms: t0.elapsed().as_secs_f64() * 1000.0,
                error: Some("cut off by routing_policy.request_timeout".into()),
                panic_mode,
                own_key: false,
                internal: None,
                address: None,
                trace,
            });
        }
        let err = ApiError::RequestTimeout {
            message: format!(
                "No upstream served this request for model `{}` within routing_policy.request_timeout ({}ms); see attempts.",
                self.req.model,
                self.cfg.policy.request_timeout.as_millis()
            ),
            attempts: self.attempts.clone(),
        };
        tracing::warn!(request_id = %self.request_id, model = %self.req.model, attempts = self.attempts.len(), "request timed out");
        let class = err.class();
        self.gateway_error(err, class)
    }

    /// The gateway's own error as the response, with the request's audit row (its status and
    /// `error_class`) and the `x-autohedge-*` headers.
    pub(super) fn gateway_error(&mut self, err: ApiError, error_class: &str) -> Response {
        let row = self.base_row(None, err.status().as_u16(), Some(error_class.into()));
        if self.audit.is_some() {
            self.audit_response = Some(Bytes::from(err.body().to_string()));
        }
        self.send_row(row);
        let mut resp = err.into_response();
        self.headers(&mut resp, None);
        resp
    }

    pub(super) fn base_row(
        &self,
        endpoint: Option<&str>,
        status: u16,
        error_class: Option<String>,
    ) -> RequestRow {
        let attempts = attempt_rows(self.attempts.iter().cloned());
        self.row(
            self.request_id.clone(),
            endpoint,
            status,
            error_class,
            attempts,
        )
    }

    /// [`Self::base_row`] for the request's last step, when nothing reads the attempts or the
    /// request id again (a full answer, its headers already set): they move into the row
    /// instead of being copied.
    fn take_row(&mut self, endpoint: Option<&str>, status: u16) -> RequestRow {
        let attempts = attempt_rows(std::mem::take(&mut self.attempts));
        let id = std::mem::take(&mut self.request_id);
        self.row(id, endpoint, status, None, attempts)
    }

    fn row(
        &self,
        request_id: String,
        endpoint: Option<&str>,
        status: u16,
        error_class: Option<String>,
        attempts: Vec<AttemptRow>,
    ) -> RequestRow {
        RequestRow {
            request_id,
            ts: self.started_wall,
            operation: self.req.op.name(),
            requested_model: Some(self.req.model.clone()),
            endpoint: endpoint.map(str::to_string),
            status,
            error_class,
            stream: self.req.stream,
            latency_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            ttft_ms: None,
            tokens_in: None,
            tokens_out: None,
            tokens_estimated: false,
            cost_usd: None,
            prompt_tokens_counted: self.counted_prompt,
            truncated_messages: self.truncation.map(|t| t.0 as u64).unwrap_or(0),
            truncated_tokens: self.truncation.map(|t| t.1).unwrap_or(0),
            sanitized_chars: self.sanitized,
            hedges: self.hedges_sent,
            hedge_won: self.hedge_won,
            continued_from: None,
            client_key: self.client.clone(),
            response_id: self.responses.as_ref().map(|r| r.id.to_string()),
            previous_response_id: self.responses.as_ref().and_then(|r| r.previous.clone()),
            attempts,
            trace: self.trace.clone(),
            replay_of: self.replay_of.clone(),
            served_from: None,
            bodies: None,
        }
    }

    pub(super) fn headers(&self, resp: &mut Response, endpoint: Option<&str>) {
        use crate::wire::names;
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            h.insert(names::X_REQUEST_ID, v);
        }
        // The endpoint's name as a header value was built when the config was loaded.
        let ep = endpoint.and_then(|e| match self.cfg.endpoints.get(e) {
            Some(ep) => ep.name_header.clone(),
            None => HeaderValue::from_str(e).ok(),
        });
        if let Some(ep) = ep {
            h.insert(names::X_AUTOHEDGE_ENDPOINT, ep);
        }
        h.insert(names::X_AUTOHEDGE_ATTEMPTS, HeaderValue::from(self.calls));
        if self.hedge_won {
            h.insert(names::X_AUTOHEDGE_HEDGED, HeaderValue::from_static("true"));
        }
        if let Some((m, t)) = self.truncation
            && let Ok(v) = HeaderValue::from_str(&format!("{m}/{t}"))
        {
            h.insert(names::X_AUTOHEDGE_TRUNCATED, v);
        }
    }

    pub(super) fn respond_passthrough(
        &mut self,
        endpoint: &str,
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    ) -> Response {
        let class = classify::classify_status(status.as_u16(), &String::from_utf8_lossy(&body));
        let row = self.base_row(Some(endpoint), status.as_u16(), Some(class.as_str().into()));
        if self.audit.is_some() {
            self.audit_response = Some(body.clone());
        }
        self.send_row(row);
        let mut resp = (status, body).into_response();
        for (k, v) in headers.iter() {
            resp.headers_mut().insert(k.clone(), v.clone());
        }
        if !resp.headers().contains_key(header::CONTENT_TYPE) {
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        self.headers(&mut resp, Some(endpoint));
        resp
    }

    /// Where every attempt failed: the answer kept for this very request (`last_resort:`),
    /// with `x-autohedge-served-from: last_resort` and its `age`; its row says so
    /// (`error_class: last_resort`, status 200) with the failed attempts before it. Nothing
    /// is billed.
    pub(super) async fn served_from_last_resort(&mut self) -> Option<Response> {
        let slot = self.last_resort.as_deref()?;
        let (kept, age) = slot
            .find((&self.app.last_resort, self.app.cluster.get()))
            .await?;
        tracing::warn!(request_id = %self.request_id, model = %self.req.model, attempts = self.attempts.len(), age_s = age.as_secs(), "all upstreams failed; served the last resort");
        metrics::counter!("autohedge_last_resort_served_total").increment(1);
        let mut row = self.base_row(None, 200, Some("last_resort".into()));
        row.served_from = Some("last_resort");
        self.send_row(row);
        Some(self.kept_response(kept, age, "last_resort"))
    }

    /// Before any attempt: the answer kept for this very request of `temperature: 0`
    /// (`cache:`), with `x-autohedge-served-from: cache` and its `age`; its row: status 200,
    /// no endpoint, no attempt, nothing billed.
    pub(super) fn served_from_cache(&mut self) -> Option<Response> {
        let slot = self.last_resort.as_deref()?;
        let (kept, age) = slot.cached(&self.app.last_resort, self.req.body())?;
        metrics::counter!("autohedge_cache_served_total").increment(1);
        let mut row = self.base_row(None, 200, None);
        row.served_from = Some("cache");
        self.send_row(row);
        Some(self.kept_response(kept, age, "cache"))
    }

    /// A kept answer as the response, with the request's headers, `x-autohedge-served-from:
    /// {from}` and `age`.
    fn kept_response(
        &self,
        kept: super::last_resort::Kept,
        age: std::time::Duration,
        from: &'static str,
    ) -> Response {
        let mut resp = match kept {
            super::last_resort::Kept::Full { content_type, body } => {
                let mut r = Response::new(Body::from(body));
                r.headers_mut().insert(header::CONTENT_TYPE, content_type);
                r
            }
            super::last_resort::Kept::Stream(events) => {
                let mut r = Response::new(Body::from(events));
                let h = r.headers_mut();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                );
                h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                r
            }
        };
        self.headers(&mut resp, None);
        let h = resp.headers_mut();
        h.insert(
            crate::wire::names::X_AUTOHEDGE_SERVED_FROM,
            HeaderValue::from_static(from),
        );
        h.insert(header::AGE, HeaderValue::from(age.as_secs()));
        resp
    }

    pub(super) fn all_failed(&mut self) -> Response {
        let real: Vec<&AttemptReport> = self
            .attempts
            .iter()
            .filter(|a| !a.class.is_skip())
            .collect();
        let message = if real.is_empty() {
            format!(
                "No endpoint could take this request for model `{}`: every candidate was skipped (see attempts).",
                self.req.model
            )
        } else {
            format!(
                "All {} upstream attempts for model `{}` failed (see attempts).",
                real.len(),
                self.req.model
            )
        };
        let err = ApiError::AllFailed {
            message,
            attempts: self.attempts.clone(),
        };
        tracing::warn!(request_id = %self.request_id, model = %self.req.model, attempts = self.attempts.len(), "all upstreams failed");
        let class = err.class();
        self.gateway_error(err, class)
    }

    pub(super) fn respond(&mut self, ep: Arc<Endpoint>, success: Success) -> Response {
        match success {
            Success::Full {
                status,
                content_type,
                body,
                usage,
                out_chars,
                produced,
                address,
                ..
            } => {
                if let (Some(p), Some(ctx)) = (&produced, self.responses.clone())
                    && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body)
                {
                    super::responses::keep(
                        &self.app,
                        &self.cfg,
                        &ctx,
                        self.client.as_deref(),
                        (&ep.name, address.as_deref()),
                        p.upstream_id(),
                        &v,
                    );
                }
                // What the answer's spans say of it (a traced, exported request only).
                let answered = self.trace.as_ref().filter(|t| t.export).map(|_| {
                    let capture = self.cfg.otlp.as_ref().is_some_and(|o| o.capture_content);
                    wire::trace::answered(&body, capture)
                });
                let content_type =
                    content_type.unwrap_or(HeaderValue::from_static("application/json"));
                // Never an answer to a shortened conversation (it answers another request), nor
                // one made with the client's own upstream key (its account's, not the gateway's).
                if let Some(slot) = self.last_resort.as_deref()
                    && status.is_success()
                    && self.truncation.is_none()
                    && self.own_key_for(&ep).is_none()
                {
                    slot.keep(
                        (&self.app.last_resort, self.app.cluster.get()),
                        super::last_resort::Kept::Full {
                            content_type: content_type.clone(),
                            body: body.clone(),
                        },
                    );
                }
                if self.audit.is_some() {
                    self.audit_response = Some(body.clone());
                }
                // Built as it is sent: `into_response` would set a content type only to have it
                // replaced.
                let mut resp = Response::new(Body::from(body));
                *resp.status_mut() = status;
                resp.headers_mut()
                    .insert(header::CONTENT_TYPE, content_type);
                self.headers(&mut resp, Some(&ep.name));
                // The last step: the row takes the attempts and the request id.
                let mut row = self.take_row(Some(&ep.name), status.as_u16());
                if let (Some(t), Some((reasons, output))) = (row.trace.as_mut(), answered) {
                    t.finish_reasons = reasons;
                    t.output = output;
                }
                // Walking the body for an estimate is only needed when the upstream sent no usage.
                let prompt_estimate = match (usage, self.counted_prompt) {
                    (Some(_), _) => 0,
                    (None, Some(n)) => n,
                    (None, None) => wire::estimate_tokens(self.req.prompt_chars()),
                };
                let out_estimate = wire::estimate_tokens(out_chars);
                fill_usage(
                    &mut row,
                    &ep,
                    usage,
                    prompt_estimate,
                    out_estimate,
                    self.req.op,
                );
                self.app.registry.record_tokens(
                    &ep.name,
                    row.tokens_in.unwrap_or(0),
                    row.tokens_out.unwrap_or(0),
                    row.tokens_estimated,
                    true,
                );
                self.send_row(row);
                resp
            }
            Success::Stream {
                prelude,
                rest,
                parser,
                done_seen,
                ttft,
                usage,
                out_chars,
                usage_tap,
                produced,
                address,
                ..
            } => {
                let mut row = self.base_row(Some(&ep.name), 200, None);
                // A Responses stream reads its held events again: their numbering, output and
                // (when it ended already) its Response object.
                let (responses, out_chars) = match (produced, self.responses.clone()) {
                    (Some(produced), Some(ctx)) => {
                        let mut r = StreamResponses {
                            ctx,
                            produced,
                            next_seq: 0,
                            done: None,
                            address: address.clone(),
                        };
                        let mut chars = 0;
                        let mut usage = usage;
                        let mut p = crate::wire::sse::SseParser::new();
                        for b in &prelude {
                            for ev in p.push(b).unwrap_or_default() {
                                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&ev.data) {
                                    r.observe(&v, &mut usage, &mut chars);
                                }
                            }
                        }
                        (Some(Box::new(r)), chars)
                    }
                    _ => (None, out_chars),
                };
                row.ttft_ms = Some(self.started.elapsed().as_secs_f64() * 1000.0);
                let guard = StreamGuard {
                    app: self.app.clone(),
                    cfg: self.cfg.clone(),
                    ep: ep.clone(),
                    row: Some(row),
                    started: self.started,
                    ttft,
                    usage,
                    out_chars,
                    prompt_estimate: self
                        .counted_prompt
                        .unwrap_or_else(|| wire::estimate_tokens(self.req.prompt_chars())),
                    usage_tap,
                    op: self.req.op,
                    break_recorded: false,
                    own_key: self.own_key_for(&ep).cloned(),
                    admission: self.admission.take(),
                    // Failed attempts the upstream billed are the request's too.
                    prior: self.billed.take(),
                    responses,
                    address,
                    // As a full answer: never a shortened conversation's, nor one made with the
                    // client's own upstream key.
                    keep: self
                        .last_resort
                        .as_deref()
                        .filter(|_| self.truncation.is_none() && self.own_key_for(&ep).is_none())
                        .map(|s| {
                            Box::new(super::last_resort::Capture::new(
                                s.clone(),
                                self.app.last_resort.inflight(),
                            ))
                        }),
                    whole: false,
                    audit: self.audit.take(),
                    pending: None,
                };
                let cont = self.continuation(&ep, &prelude);
                // The start of an event the first reads left unfinished waits for its end.
                let mut prelude = prelude;
                let held = super::stream::hold_tail(&mut prelude, parser.pending());
                // The StreamGuard owns the row from here on.
                self.row_written = true;
                let idle = ep.timeouts.first_token;
                let deadline =
                    (super::after(Instant::now(), ep.timeouts.total.saturating_sub(ttft)))
                        .min(self.deadline);
                let state = PassThrough {
                    prelude: prelude.into(),
                    rest,
                    parser,
                    done_seen,
                    finished: false,
                    idle,
                    deadline,
                    guard,
                    // One waiter for the stream's life, not one per chunk.
                    stop: Box::pin(self.app.hard_stop.clone().cancelled_owned()),
                    timer: Box::pin(tokio::time::sleep_until(deadline)),
                    cont,
                    held,
                    skim: Default::default(),
                };
                let body = if state.guard.keep.is_some() || state.guard.audit.is_some() {
                    Body::from_stream(futures_util::stream::unfold(
                        Box::new(state),
                        super::stream::pump_kept,
                    ))
                } else {
                    Body::from_stream(futures_util::stream::unfold(Box::new(state), pump))
                };
                let mut resp = Response::new(body);
                let h = resp.headers_mut();
                h.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("text/event-stream"),
                );
                h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                self.headers(&mut resp, Some(&ep.name));
                resp
            }
        }
    }
}

impl Run {
    /// For a route with `continue_streams: true` (chat without tools): the endpoints that could
    /// carry this stream on, and what the committed prelude already streamed.
    fn continuation(&self, serving: &Endpoint, prelude: &[Bytes]) -> Option<Box<Continuation>> {
        let chain = self.continue_chain.as_ref()?;
        let candidates: Vec<Arc<Endpoint>> = chain
            .iter()
            .filter(|n| **n != serving.name)
            .filter_map(|n| self.cfg.endpoints.get(n))
            .filter(|e| e.caps.contains(crate::config::Capability::Continue))
            .cloned()
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let mut cont = Continuation {
            req: self.req.clone(),
            candidates,
            request_id: self.request_id.clone(),
            deadline: self.deadline,
            text: String::new(),
            identity: None,
            finished: false,
            spliced: false,
        };
        let mut parser = crate::wire::sse::SseParser::new();
        for b in prelude {
            for ev in parser.push(b).unwrap_or_default() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&ev.data) {
                    cont.watch(&v);
                }
            }
        }
        Some(Box::new(cont))
    }
}

/// The audit rows of a request's attempts, numbered from 1.
fn attempt_rows(attempts: impl IntoIterator<Item = AttemptReport>) -> Vec<AttemptRow> {
    attempts
        .into_iter()
        .enumerate()
        .map(|(i, a)| AttemptRow {
            seq: i as u32 + 1,
            endpoint: a.endpoint,
            class: a.class,
            status: a.status,
            // The audit row keeps the internal detail (a task's address); the client's body has
            // the redacted one.
            error: a.internal.or(a.error),
            latency_ms: a.latency_ms,
            panic_mode: a.panic_mode,
            own_key: a.own_key,
            address: a.address.as_deref().map(str::to_string),
            trace: a.trace,
        })
        .collect()
}
