//! A committed stream: the client already has bytes, so nothing can fail over any more.
//! `PassThrough` forwards the upstream's bytes as they arrive (buffered preamble first), watches
//! them — without holding them — for usage, `[DONE]` and in-band errors, and ends the stream with
//! an OpenAI-style error event when the upstream breaks, stalls or runs out of time.
//! `StreamGuard` owns the audit row and writes it exactly once: at the end, on a failure, or when
//! the client leaves (the body is dropped).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::time::{Instant, timeout_at};

use super::attempt::{ByteStream, chunk_text_chars, error_chain};
use super::respond::fill_usage;
use crate::config::{Config, Endpoint};
use crate::error::stream_error_event;
use crate::outcome::Outcome;
use crate::registry::Effect;
use crate::state::AppState;
use crate::store::{AttemptRow, Record, RequestRow};
use crate::upstream::{self, classify};
use crate::wire::sse::SseParser;
use crate::wire::{self, ChunkKind, Op, Usage};

/// Owns a committed stream's audit row and reports the outcome exactly once: when the stream
/// ends, fails, or is dropped because the client went away.
pub(super) struct StreamGuard {
    pub app: Arc<AppState>,
    pub cfg: Arc<Config>,
    pub ep: Arc<Endpoint>,
    pub row: Option<RequestRow>,
    pub started: Instant,
    pub ttft: Duration,
    pub usage: Option<Usage>,
    pub out_chars: usize,
    pub prompt_estimate: u64,
    /// Exact counts a translating adapter saw (Ollama's final object).
    pub usage_tap: Option<upstream::ollama::UsageTap>,
    pub op: Op,
}

impl StreamGuard {
    pub(super) fn finish(&mut self, failure: Option<(Outcome, String)>) {
        let Some(mut row) = self.row.take() else {
            return;
        };
        // In-band error texts are upstream bytes: redacted like every other upstream error.
        let failure = failure.map(|(class, detail)| {
            let secrets: Vec<&str> = self
                .ep
                .keys
                .iter()
                .filter_map(|k| k.value.as_ref().map(|s| s.expose()))
                .collect();
            (class, classify::redact(&detail, &secrets))
        });
        row.latency_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let out_estimate = wire::estimate_tokens(self.out_chars);
        let tapped = self
            .usage_tap
            .as_ref()
            .and_then(|t| t.lock().ok().and_then(|u| *u));
        fill_usage(
            &mut row,
            &self.ep,
            self.usage.or(tapped),
            self.prompt_estimate,
            out_estimate,
            self.op,
        );
        self.app.registry.record_tokens(
            &self.ep.name,
            row.tokens_in.unwrap_or(0),
            row.tokens_out.unwrap_or(0),
            row.tokens_estimated,
        );
        let ttft_ms = self.ttft.as_secs_f64() * 1000.0;
        match failure {
            None => {
                self.app.registry.apply(
                    &self.ep,
                    &self.cfg.policy,
                    Effect::Success {
                        latency_ms: ttft_ms,
                    },
                );
            }
            Some((class @ (Outcome::ClientClosed | Outcome::Shutdown), _)) => {
                // The client left, or shutdown cut the stream: not the endpoint's fault, but
                // the record says so.
                row.error_class = Some(class.as_str().into());
            }
            Some((class, detail)) => {
                row.error_class = Some(class.as_str().into());
                let n = row.attempts.len() as u32 + 1;
                row.attempts.push(AttemptRow {
                    seq: n,
                    endpoint: self.ep.name.clone(),
                    class,
                    status: Some(200),
                    error: Some(detail.clone()),
                    latency_ms: row.latency_ms,
                    panic_mode: false,
                });
                tracing::warn!(request_id = %row.request_id, endpoint = %self.ep.name, class = class.as_str(), error = %detail, "stream failed after commit");
                self.app.registry.apply(
                    &self.ep,
                    &self.cfg.policy,
                    Effect::Failure { class, detail },
                );
            }
        }
        self.app.store.send(Record::Request(Box::new(row)));
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.row.is_some() {
            self.finish(Some((
                Outcome::ClientClosed,
                "client disconnected mid-stream".into(),
            )));
        }
    }
}

pub(super) struct PassThrough {
    pub prelude: VecDeque<Bytes>,
    pub rest: ByteStream,
    pub parser: SseParser,
    pub done_seen: bool,
    pub finished: bool,
    pub idle: Duration,
    pub deadline: Instant,
    pub guard: StreamGuard,
    /// Cancelled when shutdown cuts the requests still running.
    pub stop: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
}

impl PassThrough {
    /// Watches the passing bytes for usage, `[DONE]` and in-band errors without holding them.
    fn scan(&mut self, b: &Bytes) -> Option<String> {
        let events = match self.parser.push(b) {
            Ok(e) => e,
            Err(e) => return Some(e.0),
        };
        let mut err = None;
        for ev in events {
            if ev.data.trim() == "[DONE]" {
                self.done_seen = true;
                continue;
            }
            if let Ok(v) = serde_json::from_str::<Value>(&ev.data) {
                if let Some(u) = wire::usage_of(&v) {
                    self.guard.usage = Some(u);
                }
                match wire::classify_chunk(&v) {
                    ChunkKind::Error(m) => err = Some(m),
                    ChunkKind::Content => self.guard.out_chars += chunk_text_chars(&v),
                    ChunkKind::Preamble => {}
                }
            }
        }
        err
    }
}

pub(super) async fn pump(
    mut st: PassThrough,
) -> Option<(Result<Bytes, std::io::Error>, PassThrough)> {
    if let Some(b) = st.prelude.pop_front() {
        if st.prelude.is_empty() && st.done_seen && !st.finished {
            // `[DONE]` came with the first chunks: the stream is complete for the client.
            st.finished = true;
            st.guard.finish(None);
        }
        return Some((Ok(b), st));
    }
    if st.finished {
        return None;
    }
    let wait_until = (Instant::now() + st.idle).min(st.deadline);
    let next = tokio::select! {
        r = timeout_at(wait_until, st.rest.next()) => r,
        _ = &mut st.stop => {
            st.finished = true;
            st.guard.finish(Some((Outcome::Shutdown, "cut by shutdown after shutdown_grace".into())));
            let ev = stream_error_event("The gateway is shutting down.", "shutdown");
            return Some((Ok(Bytes::from(ev)), st));
        }
    };
    match next {
        Ok(Some(Ok(b))) => {
            if let Some(err) = st.scan(&b) {
                // The upstream's own error event passes through to the client as sent.
                st.finished = true;
                st.guard.finish(Some((Outcome::InBand, err)));
            } else if st.done_seen {
                // `data: [DONE]` ends the stream for the client; whatever the upstream does
                // with its connection afterwards is not the client's problem, nor a failure.
                st.finished = true;
                st.guard.finish(None);
            }
            Some((Ok(b), st))
        }
        Ok(None) => {
            st.finished = true;
            if st.done_seen {
                st.guard.finish(None);
                None
            } else {
                st.guard.finish(Some((
                    Outcome::StreamTruncated,
                    "upstream closed the stream without [DONE]".into(),
                )));
                let ev = stream_error_event(
                    "The upstream closed the stream before it finished.",
                    "stream_truncated",
                );
                Some((Ok(Bytes::from(ev)), st))
            }
        }
        Ok(Some(Err(e))) => {
            st.finished = true;
            let detail = error_chain(&*e);
            st.guard.finish(Some((Outcome::StreamBroken, detail)));
            let ev = stream_error_event(
                "The upstream connection failed mid-stream.",
                "stream_broken",
            );
            Some((Ok(Bytes::from(ev)), st))
        }
        Err(_) => {
            st.finished = true;
            let total = Instant::now() >= st.deadline;
            let (outcome, msg) = if total {
                (
                    Outcome::StreamTimeout,
                    "The stream exceeded timeouts.total.",
                )
            } else {
                (Outcome::StreamStalled, "The upstream stalled mid-stream.")
            };
            st.guard.finish(Some((outcome, msg.into())));
            Some((
                Ok(Bytes::from(stream_error_event(msg, outcome.as_str()))),
                st,
            ))
        }
    }
}
