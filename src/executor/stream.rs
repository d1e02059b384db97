//! A committed stream: the client already has bytes, so nothing can fail over any more.
//! `PassThrough` forwards the upstream's bytes as they arrive (buffered preamble first), one whole
//! SSE event at a time: the bytes of an event whose blank line has not come yet are held (at most
//! `limits.max_event_bytes`) and dropped if the upstream breaks first, so the client's stream is
//! always whole events and an error event or a continuation starts on a clean boundary. It
//! watches the events for usage, `[DONE]` and in-band errors, and ends the stream with an
//! OpenAI-style error event when the upstream breaks, stalls or runs out of time.
//! `StreamGuard` owns the audit row and writes it exactly once: at the end, on a failure, or when
//! the client leaves (the body is dropped).

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde_json::Value;
use tokio::time::Instant;

use super::attempt::{Attempt, ByteStream, Success, chunk_text_chars, error_chain};
use super::usage::{Leg, fill_usage};
use crate::config::{Config, Endpoint};
use crate::error::stream_error_event;
use crate::routing::outcome::Outcome;
use crate::routing::registry::Effect;
use crate::state::AppState;
use crate::store::{AttemptRow, RequestRow};
use crate::upstream::{self, classify};
use crate::wire::sse::SseParser;
use crate::wire::{self, ChunkKind, Inbound, Op, Usage};

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
    /// The current endpoint's break is already recorded (a continuation was tried).
    pub break_recorded: bool,
    /// The request's own key (`x-encrypted-key`), redacted like the endpoints' own.
    /// The address that served the stream (an endpoint of several).
    pub address: Option<Arc<str>>,
    pub own_key: Option<crate::config::Secret>,
    /// The client key's hold on its limits, settled when the stream ends.
    pub admission: Option<crate::clients::Admission>,
    /// What the broken first leg of a continued stream used and cost, added to the row.
    pub prior: Option<Leg>,
    /// A `/v1/responses` stream's own part: its events' numbering and the turn it leaves.
    pub responses: Option<Box<StreamResponses>>,
    /// What the client got, for the last resort (`last_resort:`): kept when the stream ends
    /// whole, let go at a break, an error or past a key's share.
    pub keep: Option<Box<super::last_resort::Capture>>,
    /// The stream ended with `[DONE]` and nothing failed.
    pub whole: bool,
    /// Its bodies for the audit row (`audit.capture_bodies`): with it, the finished row waits
    /// in `pending` until every byte the client got has gone through `pump_kept`.
    pub audit: Option<Box<super::capture::Audit>>,
    pub pending: Option<(crate::store::RequestRow, Option<crate::clients::Admission>)>,
}

/// What a committed `/v1/responses` stream needs besides the chat path's: its response (for the
/// `response.failed` event that ends it when the upstream cannot), the next `sequence_number`,
/// and the Response object its last event carried (kept as the conversation's turn).
pub(super) struct StreamResponses {
    pub ctx: Arc<super::responses::ResponsesCtx>,
    pub produced: Box<super::attempt::Produced>,
    pub next_seq: u64,
    pub done: Option<Value>,
    /// The address that served it (an endpoint of several): its next turn goes back there.
    pub address: Option<Arc<str>>,
}

impl StreamResponses {
    /// Reads one event of the stream: its number, its output, its end.
    pub(super) fn observe(&mut self, v: &Value, usage: &mut Option<Usage>, out_chars: &mut usize) {
        if let Some(n) = v.get("sequence_number").and_then(Value::as_u64) {
            self.next_seq = self.next_seq.max(n.saturating_add(1));
        }
        *out_chars += wire::responses::delta_chars(v);
        if wire::responses::is_terminal(v) {
            if let Some(u) = wire::responses::usage_of(v) {
                *usage = Some(u);
            }
            self.done = v.get("response").cloned();
        }
    }
}

impl StreamGuard {
    /// Who saw a failure of this stream ([`super::witness`]).
    fn witness(&self, class: Outcome) -> crate::routing::blame::Witness {
        let client = self.row.as_ref().and_then(|r| r.client_key.as_deref());
        super::witness(&self.cfg, client, class)
    }

    /// What is redacted from `ep`'s texts: its secrets and the request's own key.
    fn secrets<'a>(&'a self, ep: &'a Endpoint) -> Vec<&'a str> {
        ep.secret_values_with(self.own_key.as_ref())
    }

    /// A chunk said why its choice ended: kept for the request's spans, when it is traced.
    fn finished_as(&mut self, name: &'static str) {
        if let Some(t) = self.row.as_mut().and_then(|r| r.trace.as_mut()) {
            wire::trace::note_finish(&mut t.finish_reasons, name);
        }
    }

    /// Adds an attempt to the row (continuation: the break, and each continuing attempt).
    fn push_attempt(
        &mut self,
        endpoint: &str,
        address: Option<&str>,
        class: Outcome,
        status: Option<u16>,
        error: Option<String>,
        trace: Option<crate::wire::trace::AttemptTrace>,
    ) {
        let latency_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        if let Some(row) = self.row.as_mut() {
            let seq = row.attempts.len() as u32 + 1;
            row.attempts.push(AttemptRow {
                seq,
                endpoint: endpoint.to_string(),
                class,
                status,
                error,
                latency_ms,
                panic_mode: false,
                own_key: self.own_key.is_some(),
                address: address.map(str::to_string),
                trace,
            });
        }
    }

    pub(super) fn finish(&mut self, failure: Option<(Outcome, String)>) {
        let Some(mut row) = self.row.take() else {
            return;
        };
        if failure.is_some() {
            self.keep = None;
        } else {
            self.whole = true;
        }
        // In-band error texts are upstream bytes: redacted like every other upstream error.
        let failure = failure.map(|(class, detail)| {
            let secrets = self.secrets(&self.ep);
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
            failure.is_none(),
        );
        // A continuation's answer is both legs': the client's key is billed for both.
        if let Some(prior) = self.prior.take() {
            prior.add_to(&mut row);
        }
        let ttft_ms = self.ttft.as_secs_f64() * 1000.0;
        if failure.is_none()
            && let Some(r) = self.responses.as_ref()
            && let Some(done) = &r.done
        {
            super::responses::keep(
                &self.app,
                &self.cfg,
                &r.ctx,
                row.client_key.as_deref(),
                (&self.ep.name, r.address.as_deref()),
                r.produced.upstream_id(),
                done,
            );
        }
        match failure {
            None => {
                self.app.registry.apply(
                    &self.ep,
                    &self.cfg.policy,
                    Effect::Success {
                        latency_ms: ttft_ms,
                        who: super::answered_by(&self.cfg, row.client_key.as_deref()),
                    },
                );
            }
            Some((class @ (Outcome::ClientClosed | Outcome::Shutdown), _)) => {
                // The client left, or shutdown cut the stream: not the endpoint's fault, but
                // the record says so.
                row.error_class = Some(class.as_str().into());
            }
            Some((class, _)) if self.break_recorded => {
                // Recorded (and counted) when a continuation was tried; none could carry it.
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
                    own_key: self.own_key.is_some(),
                    address: self.address.as_deref().map(str::to_string),
                    trace: None,
                });
                tracing::warn!(request_id = %row.request_id, endpoint = %self.ep.name, class = class.as_str(), error = %detail, "stream failed after commit");
                // A stream its server cut (the connection lost, or silent between events)
                // counts against that address too; not one made with the client's own key.
                let who = super::witness(&self.cfg, row.client_key.as_deref(), class);
                if let Some(at) = &self.address
                    && self.own_key.is_none()
                    && matches!(class, Outcome::Connection | Outcome::FirstTokenTimeout)
                {
                    let t = crate::routing::registry::tuning(&self.cfg, &self.ep);
                    self.app.registry.address_failed(&self.ep.name, at, who, &t);
                }
                self.app.registry.apply(
                    &self.ep,
                    &self.cfg.policy,
                    Effect::Failure { class, detail, who },
                );
            }
        }
        if self.audit.is_some() {
            self.pending = Some((row, self.admission.take()));
            return;
        }
        self.app.record_request(row, self.admission.take());
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
        // Every byte the client got has gone through `pump_kept` by now.
        if self.whole
            && let Some(k) = self.keep.take()
        {
            k.keep((&self.app.last_resort, self.app.cluster.get()));
        }
        self.send_pending();
    }
}

impl StreamGuard {
    /// The finished row held for its bodies (`audit`), with them, to the trail.
    pub(super) fn send_pending(&mut self) {
        if let Some((mut row, admission)) = self.pending.take() {
            if let Some(audit) = self.audit.take() {
                audit.attach(&self.app, &self.cfg, &mut row, None, self.own_key.as_ref());
            }
            self.app.record_request(row, admission);
        }
    }
}

/// How long the rest of an upstream's body is read after `[DONE]` (`PassThrough::drain_ready`).
const DRAIN_FOR: Duration = Duration::from_millis(250);
/// How much of it at most.
const DRAIN_BYTES: usize = 64 * 1024;

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
    /// The wait for the next chunk (`idle`, within `deadline`): one timer for the stream's
    /// life, moved on at every chunk (no cheaper than a timer a chunk, measured, but no dearer).
    pub timer: Pin<Box<tokio::time::Sleep>>,
    /// Stream continuation, when the route has it on.
    pub cont: Option<Box<Continuation>>,
    /// The upstream's unfinished event: sent once its blank line arrives, dropped if the stream
    /// breaks first. Bounded by the parser (`limits.max_event_bytes`).
    pub held: BytesMut,
    /// The stream's chunks read against the last one read in full.
    pub skim: wire::scan::Skim,
}

/// What the events of one upstream read teach, applied once the read has parsed whole.
#[derive(Default)]
struct Learned {
    done: bool,
    usage: Option<Usage>,
    out_chars: usize,
    /// Finish reasons, in order (a `Vec` allocates only when one comes).
    finishes: Vec<&'static str>,
    /// The chunks a continuation watches, in order (only with continuation on).
    watched: Vec<Value>,
}

/// What one upstream read held, as `PassThrough::scan` read it.
enum Scanned {
    /// Whole events (or part of one): pass on.
    Events,
    /// An in-band error event, the `index`th event of the read.
    InBand { message: String, index: usize },
    /// Bytes that are not SSE, or an event over `limits.max_event_bytes`.
    Invalid(String),
}

/// Moves the last `n` bytes of `chunks` (the start of an unfinished event) into a buffer of
/// their own, for `PassThrough::held`.
pub(super) fn hold_tail(chunks: &mut Vec<Bytes>, mut n: usize) -> BytesMut {
    let mut tail: Vec<Bytes> = Vec::new();
    while n > 0 {
        let Some(mut last) = chunks.pop() else {
            break;
        };
        if last.len() <= n {
            n -= last.len();
            tail.push(last);
        } else {
            tail.push(last.split_off(last.len() - n));
            chunks.push(last);
            n = 0;
        }
    }
    let mut held = BytesMut::with_capacity(tail.iter().map(Bytes::len).sum());
    for b in tail.iter().rev() {
        held.extend_from_slice(b);
    }
    held
}

impl PassThrough {
    /// After `[DONE]`: reads the rest of the upstream's body so that its connection goes back
    /// to the pool instead of being closed — a new connection for every stream was a third of
    /// a stream's cost. What is already here is read at once; the end that is not, on a task
    /// of its own, for at most [`DRAIN_FOR`] and [`DRAIN_BYTES`] (a server that holds its
    /// connection open after `[DONE]`, or keeps writing, loses it as before). The client's
    /// stream is complete either way: nothing read here reaches it.
    fn drain_ready(&mut self) {
        use futures_util::FutureExt;
        let mut rest = std::mem::replace(&mut self.rest, Box::pin(futures_util::stream::empty()));
        let mut read = 0usize;
        loop {
            match rest.next().now_or_never() {
                Some(Some(Ok(b))) => {
                    read += b.len();
                    if read > DRAIN_BYTES {
                        return;
                    }
                }
                // Ended (the connection is back in the pool) or broken: nothing to wait for.
                Some(None | Some(Err(_))) => return,
                None => break,
            }
        }
        tokio::spawn(async move {
            let _ = tokio::time::timeout(DRAIN_FOR, async move {
                while let Some(Ok(b)) = rest.next().await {
                    read += b.len();
                    if read > DRAIN_BYTES {
                        return;
                    }
                }
            })
            .await;
        });
    }

    /// Reads one upstream read's events for usage, `[DONE]` and in-band errors. Each event is
    /// lent by the parser (no copy of its data) and a plain chunk read against the stream's
    /// last ([`wire::scan::Skim`]). What the events teach is applied only once the whole read
    /// has parsed: a read that turns out unreadable is dropped whole (the client gets none of
    /// it), so none of its events may count — not their text, usage or finish, nor what a
    /// continuation carries on from.
    fn scan(&mut self, b: &Bytes) -> Scanned {
        if self.guard.responses.is_some() {
            return match self.parser.push(b) {
                Ok(events) => self.scan_responses(events),
                Err(e) => Scanned::Invalid(e.0),
            };
        }
        let mut learned = Learned::default();
        let mut found = Scanned::Events;
        let mut index = 0usize;
        let (skim, watching) = (&mut self.skim, self.cont.is_some());
        let read = self.parser.push_each(b, |ev| {
            let at = index;
            index += 1;
            // What follows an error event is not read: the stream ends at it.
            if !matches!(found, Scanned::Events) {
                return;
            }
            if ev.data.trim() == "[DONE]" {
                learned.done = true;
                return;
            }
            // The plain chunk, read without a `Value` tree (a continuation watches the tree).
            if !watching && let Some(p) = wire::chunk::read_next(skim, ev.data) {
                if let Some(u) = p.usage {
                    learned.usage = Some(u);
                }
                if p.content {
                    learned.out_chars += p.text_bytes;
                }
                if let Some(f) = p.finish {
                    learned.finishes.push(f);
                }
                return;
            }
            if let Ok(v) = serde_json::from_str::<Value>(ev.data) {
                if let Some(u) = wire::usage_of(&v) {
                    learned.usage = Some(u);
                }
                match wire::classify_chunk(&v) {
                    ChunkKind::Error(message) => {
                        found = Scanned::InBand { message, index: at };
                        return;
                    }
                    ChunkKind::Content => learned.out_chars += chunk_text_chars(&v),
                    ChunkKind::Preamble => {}
                }
                for f in v
                    .get("choices")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c.get("finish_reason"))
                    .filter(|f| !f.is_null())
                {
                    let name = f
                        .as_str()
                        .map_or("other", |s| wire::trace::finish_name(s.as_bytes()));
                    learned.finishes.push(name);
                }
                if watching {
                    learned.watched.push(v);
                }
            }
        });
        if let Err(e) = read {
            return Scanned::Invalid(e.0);
        }
        if learned.done {
            self.done_seen = true;
        }
        if let Some(u) = learned.usage {
            self.guard.usage = Some(u);
        }
        self.guard.out_chars += learned.out_chars;
        for f in learned.finishes {
            self.guard.finished_as(f);
        }
        if let Some(c) = self.cont.as_mut() {
            for v in &learned.watched {
                c.watch(v);
            }
        }
        found
    }

    /// [`PassThrough::scan`] for a Responses stream: its end (`response.completed`) is its
    /// `[DONE]`; an `error` or `response.failed` event ends it.
    fn scan_responses(&mut self, events: Vec<crate::wire::sse::SseEvent>) -> Scanned {
        let g = &mut self.guard;
        let Some(r) = g.responses.as_mut() else {
            return Scanned::Events;
        };
        for (index, ev) in events.into_iter().enumerate() {
            let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
                return Scanned::Invalid("an event whose data is not JSON".into());
            };
            r.observe(&v, &mut g.usage, &mut g.out_chars);
            if let ChunkKind::Error(message) = wire::responses::classify_event(&v) {
                return Scanned::InBand { message, index };
            }
            if wire::responses::is_terminal(&v) {
                self.done_seen = true;
            }
        }
        Scanned::Events
    }

    /// The event that ends the stream when the gateway must: OpenAI's error event, or for a
    /// Responses stream a `response.failed` (its `error.code` the outcome) numbered after the
    /// last event the client got.
    fn error_event(&mut self, message: &str, code: &str) -> Bytes {
        match self.guard.responses.as_mut() {
            Some(r) => {
                let seq = r.next_seq;
                r.next_seq += 1;
                Bytes::from(wire::responses::failed_event(
                    &r.ctx.meta,
                    seq,
                    code,
                    message,
                ))
            }
            None => Bytes::from(stream_error_event(message, code)),
        }
    }

    /// The whole events `b` completes, with the held start of the first of them; the start of
    /// an event `b` leaves unfinished is held. No copy when `b` holds whole events only.
    fn frame(&mut self, b: Bytes) -> Bytes {
        let n = self.parser.pending();
        if self.held.is_empty() && n == 0 {
            return b;
        }
        if self.held.is_empty() && n <= b.len() {
            let cut = b.len() - n;
            self.held.extend_from_slice(&b[cut..]);
            return b.slice(..cut);
        }
        self.held.extend_from_slice(&b);
        let cut = self.held.len().saturating_sub(n);
        self.held.split_to(cut).freeze()
    }

    /// The held bytes and `b` up to `end` of `b` (an event's end, from the parser); what was
    /// held is let go.
    fn upto(&mut self, b: &Bytes, end: usize) -> Bytes {
        let end = end.min(b.len());
        if self.held.is_empty() {
            return b.slice(..end);
        }
        let mut out = std::mem::take(&mut self.held);
        out.extend_from_slice(&b[..end]);
        out.freeze()
    }
}

/// [`pump`], with each piece the client gets added to what the last resort may keep.
pub(super) async fn pump_kept(
    st: Box<PassThrough>,
) -> Option<(Result<Bytes, std::io::Error>, Box<PassThrough>)> {
    let (out, mut st) = pump(st).await?;
    if let (Ok(b), Some(k)) = (&out, st.guard.keep.as_mut())
        && !k.push(b)
    {
        st.guard.keep = None;
    }
    if let (Ok(b), Some(a)) = (&out, st.guard.audit.as_mut()) {
        a.push(&st.guard.app, b);
    }
    // The stream has ended for the client: this was its last piece, so the row can go now (not
    // when the body is dropped, which a client that stops reading can put off).
    if st.finished {
        st.guard.send_pending();
    }
    Some((out, st))
}

/// The next piece of a committed stream. The state is boxed: `unfold` moves it into every
/// step's future and out again, and a box moves as a pointer where the state is a kilobyte.
pub(super) async fn pump(
    mut st: Box<PassThrough>,
) -> Option<(Result<Bytes, std::io::Error>, Box<PassThrough>)> {
    if let Some(b) = st.prelude.pop_front() {
        if st.prelude.is_empty() && st.done_seen && !st.finished {
            // `[DONE]` came with the first chunks: the stream is complete for the client.
            st.finished = true;
            st.drain_ready();
            st.guard.finish(None);
        }
        return Some((Ok(b), st));
    }
    if st.finished {
        return None;
    }
    let wait_until = (super::after(Instant::now(), st.idle)).min(st.deadline);
    st.timer.as_mut().reset(wait_until);
    let next = tokio::select! {
        // Shutdown's cut first, so a stream that always has a chunk ready is still cut; then
        // a chunk that is there before its timer.
        biased;
        _ = &mut st.stop => {
            st.finished = true;
            st.guard.finish(Some((Outcome::Shutdown, "cut by shutdown after shutdown_grace".into())));
            let ev = st.error_event("The gateway is shutting down.", "shutdown");
            return Some((Ok(ev), st));
        }
        r = st.rest.next() => Ok(r),
        () = st.timer.as_mut() => Err(()),
    };
    match next {
        Ok(Some(Ok(b))) => match st.scan(&b) {
            Scanned::Events => {
                let out = st.frame(b);
                if st.done_seen {
                    // `data: [DONE]` ends the stream for the client; whatever the upstream does
                    // with its connection afterwards is not the client's problem, nor a failure.
                    st.finished = true;
                    st.held.clear();
                    st.drain_ready();
                    st.guard.finish(None);
                }
                Some((Ok(out), st))
            }
            Scanned::InBand { message, index } => {
                // The whole events up to and including the error event, and where it starts.
                let ends = st.parser.ends();
                let end = ends.get(index).copied().unwrap_or(b.len());
                let start = index
                    .checked_sub(1)
                    .and_then(|i| ends.get(i))
                    .map_or(0, |e| st.held.len() + e);
                let upto_error = st.upto(&b, end);
                if st.cont.is_some() {
                    // The events before the error reach the client, then the continuation:
                    // what it carries on from is exactly what the client has.
                    let before = upto_error.slice(..start.min(upto_error.len()));
                    if let Some(first) = continued(&mut st, Outcome::InBand, &message).await {
                        if before.is_empty() {
                            return Some((Ok(first), st));
                        }
                        st.prelude.push_front(first);
                        return Some((Ok(before), st));
                    }
                }
                if st.guard.responses.is_some() {
                    // The events before the upstream's error reach the client, then the
                    // gateway's `response.failed` (the upstream's own words, redacted).
                    let before = upto_error.slice(..start.min(upto_error.len()));
                    st.finished = true;
                    let secrets = st.guard.secrets(&st.guard.ep);
                    let shown = classify::redact(&message, &secrets);
                    let before = classify::redact_exact(before, &secrets);
                    // The translator's own end of a response too large keeps its code.
                    let code = if message.starts_with(wire::responses::TOO_LARGE_MESSAGE) {
                        wire::responses::TOO_LARGE
                    } else {
                        Outcome::InBand.as_str()
                    };
                    st.guard.finish(Some((Outcome::InBand, message)));
                    let ev =
                        st.error_event(&format!("The upstream failed mid-stream: {shown}"), code);
                    let mut out = BytesMut::from(&before[..]);
                    out.extend_from_slice(&ev);
                    return Some((Ok(out.freeze()), st));
                }
                Some((Ok(in_band_end(&mut st, message, upto_error)), st))
            }
            Scanned::Invalid(detail) => {
                // What was held of the unreadable event is dropped: the client's stream stays
                // whole events, and the error event (or a continuation) starts clean.
                st.held.clear();
                let detail = format!("upstream stream unreadable: {detail}");
                if let Some(first) = continued(&mut st, Outcome::StreamBroken, &detail).await {
                    return Some((Ok(first), st));
                }
                st.finished = true;
                st.guard
                    .finish(Some((Outcome::StreamBroken, detail.clone())));
                let ev = st.error_event(
                    &format!("The upstream's stream could not be passed on: {detail}."),
                    "stream_broken",
                );
                Some((Ok(ev), st))
            }
        },
        Ok(None) => {
            // An unfinished last event is not passed on.
            st.held.clear();
            if !st.done_seen
                && let Some(first) = continued(
                    &mut st,
                    Outcome::StreamTruncated,
                    "upstream closed the stream without [DONE]",
                )
                .await
            {
                return Some((Ok(first), st));
            }
            st.finished = true;
            if st.done_seen {
                st.guard.finish(None);
                None
            } else {
                st.guard.finish(Some((
                    Outcome::StreamTruncated,
                    "upstream closed the stream without [DONE]".into(),
                )));
                let ev = st.error_event(
                    "The upstream closed the stream before it finished.",
                    "stream_truncated",
                );
                Some((Ok(ev), st))
            }
        }
        Ok(Some(Err(e))) => {
            st.held.clear();
            let detail = error_chain(&*e);
            if let Some(first) = continued(&mut st, Outcome::StreamBroken, &detail).await {
                return Some((Ok(first), st));
            }
            st.finished = true;
            st.guard.finish(Some((Outcome::StreamBroken, detail)));
            let ev = st.error_event(
                "The upstream connection failed mid-stream.",
                "stream_broken",
            );
            Some((Ok(ev), st))
        }
        Err(_) => {
            st.held.clear();
            let total = Instant::now() >= st.deadline;
            if !total
                && let Some(first) = continued(
                    &mut st,
                    Outcome::StreamStalled,
                    "The upstream stalled mid-stream.",
                )
                .await
            {
                return Some((Ok(first), st));
            }
            st.finished = true;
            let (outcome, msg) = if total {
                (
                    Outcome::StreamTimeout,
                    "The stream exceeded timeouts.total.",
                )
            } else {
                (Outcome::StreamStalled, "The upstream stalled mid-stream.")
            };
            st.guard.finish(Some((outcome, msg.into())));
            let ev = st.error_event(msg, outcome.as_str());
            Some((Ok(ev), st))
        }
    }
}

/// Ends the stream at the upstream's own in-band error event, which passes to the client as sent
/// (`out`: the whole events up to and including it) but for the endpoint's secrets.
fn in_band_end(st: &mut PassThrough, message: String, out: Bytes) -> Bytes {
    st.finished = true;
    st.guard.finish(Some((Outcome::InBand, message)));
    classify::redact_exact(out, &st.guard.secrets(&st.guard.ep))
}

/// Carries the stream on after a break, when continuation is on and an endpoint can: the first
/// bytes of the continuation.
async fn continued(st: &mut PassThrough, class: Outcome, detail: &str) -> Option<Bytes> {
    if st.cont.is_none() || !st.continue_stream(class, detail).await {
        return None;
    }
    st.prelude.pop_front()
}

/// Opt-in stream continuation (`routes.<name>.continue_streams: true`): what is needed to carry a
/// committed stream that broke on at the next endpoint able to continue an assistant message,
/// and splice its output onto the client's stream.
pub(super) struct Continuation {
    pub req: Arc<Inbound>,
    /// Endpoints of the chain with the `continue` capability, in chain order, the serving one
    /// left out.
    pub candidates: Vec<Arc<Endpoint>>,
    pub request_id: String,
    pub deadline: Instant,
    /// The assistant text streamed to the client so far.
    pub text: String,
    /// The stream's identity (`id`, `model`, `created` of its chunks), kept across the splice.
    pub identity: Option<(Value, Value, Value)>,
    /// A `finish_reason` went by: the answer is complete, nothing to continue.
    pub finished: bool,
    /// Continued once already.
    pub spliced: bool,
}

impl Continuation {
    /// Watches one content chunk of the stream.
    pub(super) fn watch(&mut self, v: &Value) {
        if self.identity.is_none()
            && let Some(id) = v.get("id")
        {
            self.identity = Some((
                id.clone(),
                v.get("model").cloned().unwrap_or(Value::Null),
                v.get("created").cloned().unwrap_or(Value::Null),
            ));
        }
        // Key by key: `Value::pointer` allocates for every path segment.
        if let Some(choice) = v.get("choices").and_then(|c| c.get(0)) {
            if let Some(t) = choice
                .get("delta")
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
            {
                self.text.push_str(t);
            }
            if choice.get("finish_reason").is_some_and(|f| !f.is_null()) {
                self.finished = true;
            }
        }
    }

    /// The continuation request: the conversation plus the assistant text already streamed.
    fn request(&self, ep: &Endpoint) -> Inbound {
        let mut body = self.req.body().clone();
        if let Some(Value::Array(messages)) = body.get_mut("messages") {
            messages.push(serde_json::json!({"role": "assistant", "content": self.text}));
        }
        if ep.kind == crate::config::EndpointKind::Vllm {
            body.insert("continue_final_message".into(), Value::Bool(true));
            body.insert("add_generation_prompt".into(), Value::Bool(false));
        }
        Inbound::new(
            self.req.op,
            self.req.model.clone(),
            true,
            body,
            self.req.needs.clone(),
        )
    }
}

/// Rewrites a continuation's SSE so the client sees one stream: its role-only opening chunk is
/// dropped, its chunks carry the first stream's `id`, `model` and `created`, and a comment marks
/// the splice just before `data: [DONE]`.
struct Splicer {
    parser: SseParser,
    identity: Option<(Value, Value, Value)>,
    note: Option<String>,
}

impl Splicer {
    fn push(&mut self, b: &Bytes) -> Result<Bytes, std::io::Error> {
        let events = self
            .parser
            .push(b)
            .map_err(|e| std::io::Error::other(e.0))?;
        let mut out = String::new();
        for ev in events {
            if ev.data.trim() == "[DONE]" {
                if let Some(note) = self.note.take() {
                    out.push_str(&format!(": {note}\n\n"));
                }
                out.push_str("data: [DONE]\n\n");
                continue;
            }
            if let Some(name) = &ev.event {
                out.push_str(&format!("event: {name}\n"));
            }
            let data = match serde_json::from_str::<Value>(&ev.data) {
                Ok(mut v) => {
                    // The opening chunk: a choice with no content, tool call or finish yet.
                    let role_only = v.pointer("/choices/0").is_some()
                        && wire::classify_chunk(&v) == ChunkKind::Preamble;
                    if role_only && v.get("usage").is_none_or(Value::is_null) {
                        continue;
                    }
                    if let (Some((id, model, created)), Some(o)) =
                        (&self.identity, v.as_object_mut())
                    {
                        o.insert("id".into(), id.clone());
                        if !model.is_null() {
                            o.insert("model".into(), model.clone());
                        }
                        if !created.is_null() {
                            o.insert("created".into(), created.clone());
                        }
                    }
                    v.to_string()
                }
                Err(_) => ev.data,
            };
            for line in data.split('\n') {
                out.push_str("data: ");
                out.push_str(line);
                out.push('\n');
            }
            out.push('\n');
        }
        Ok(Bytes::from(out))
    }
}

impl PassThrough {
    /// A committed stream broke with `class`: with continuation on, record the break against its
    /// endpoint and carry the answer on at the next endpoint that can continue it. True when the
    /// stream now reads from the continuation (its first bytes queued in `prelude`).
    async fn continue_stream(&mut self, class: Outcome, detail: &str) -> bool {
        let Some(c) = self.cont.as_mut() else {
            return false;
        };
        if c.spliced || c.finished || c.text.is_empty() || Instant::now() >= c.deadline {
            return false;
        }
        c.spliced = true;
        let app = self.guard.app.clone();
        let cfg = self.guard.cfg.clone();
        let from = self.guard.ep.clone();
        // The break counts against its endpoint as any failure after the commit does.
        let secrets = self.guard.secrets(&from);
        let detail = classify::redact(detail, &secrets);
        let broke_at = self.guard.address.clone();
        self.guard.push_attempt(
            &from.name,
            broke_at.as_deref(),
            class,
            Some(200),
            Some(detail.clone()),
            None,
        );
        self.guard.break_recorded = true;
        // A continued stream is two upstreams' words: never a last resort.
        self.guard.keep = None;
        // A stream cut by its server (the connection lost, or silent between events) counts
        // against that address as a failed attempt does; one that ran out of its total time was
        // being served — its length is the request's, not the address's fault.
        let who = self.guard.witness(class);
        if let Some(at) = &broke_at
            && self.guard.own_key.is_none()
            && matches!(class, Outcome::Connection | Outcome::FirstTokenTimeout)
        {
            let t = crate::routing::registry::tuning(&cfg, &from);
            app.registry.address_failed(&from.name, at, who, &t);
        }
        app.registry
            .apply(&from, &cfg.policy, Effect::Failure { class, detail, who });
        let views = app.registry.views(
            &cfg,
            &c.candidates
                .iter()
                .map(|e| e.name.clone())
                .collect::<Vec<_>>(),
        );
        for ep in c.candidates.clone() {
            let usable = views.iter().any(|v| {
                v.name == ep.name
                    && matches!(
                        v.avail,
                        crate::routing::registry::Avail::Ready
                            | crate::routing::registry::Avail::Degraded
                    )
            });
            if !usable {
                continue;
            }
            // The first leg's key goes on: the request's own (`x-encrypted-key`) where the
            // endpoint takes it, as the first leg did, else one of the endpoint's keys.
            let own_key = self
                .guard
                .own_key
                .clone()
                .filter(|_| ep.kind == crate::config::EndpointKind::Openai);
            let key_idx = if own_key.is_some() {
                None
            } else {
                match app.registry.pick_key(&ep) {
                    crate::routing::registry::KeyPick::NotNeeded => None,
                    crate::routing::registry::KeyPick::Use(i) => Some(i),
                    _ => continue,
                }
            };
            // An endpoint of several addresses: one picked by load and counted in flight for as
            // long as the continuation streams.
            let t = crate::routing::registry::tuning(&cfg, &ep);
            // Never the address whose stream just broke.
            let broke: Vec<Arc<str>> = broke_at
                .iter()
                .filter(|_| ep.name == from.name)
                .cloned()
                .collect();
            let want = crate::routing::registry::Want {
                avoid: &broke,
                ..Default::default()
            };
            let picked = match app.registry.pick_address(&ep, &t, &want) {
                Ok(p) => p,
                Err(_) => continue,
            };
            let base = picked.as_ref().map(|p| p.base.clone());
            let req = c.request(&ep);
            // The continuing call's own span, when the request is traced.
            let trace = self.guard.row.as_ref().and_then(|r| r.trace.as_deref());
            let span = trace.map(|t| {
                let s = crate::wire::trace::SpanId::random();
                (s, t.header(s))
            });
            let tracestate = trace.and_then(|t| t.ctx.tracestate.clone());
            let t0 = Instant::now();
            let attempt_trace = span
                .as_ref()
                .map(|(s, _)| crate::wire::trace::AttemptTrace {
                    span: *s,
                    started_ms: t0
                        .saturating_duration_since(self.guard.started)
                        .as_secs_f64()
                        * 1000.0,
                    hedge: false,
                    continuation: true,
                });
            let attempt = Attempt {
                ep: &ep,
                key: own_key.as_ref().or_else(|| {
                    key_idx
                        .and_then(|i| ep.keys.get(i))
                        .and_then(|k| k.value.as_ref())
                }),
                req: &req,
                ids: crate::upstream::Ids {
                    request: &c.request_id,
                    traceparent: span.as_ref().map(|s| s.1.as_str()),
                    tracestate: tracestate.as_deref(),
                },
                deadline: c.deadline,
                max_cooldown: cfg.policy.max_cooldown,
                max_answer: cfg.max_response_bytes,
                base: base.as_deref(),
                own_key: own_key.is_some(),
                max_event: cfg.max_event_bytes,
                translate: false,
                responses: None,
            };
            let Ok((rb, _)) = attempt.prepare(true) else {
                continue;
            };
            match attempt.stream(rb, t0).await {
                Ok(Success::Stream {
                    prelude,
                    rest,
                    usage_tap,
                    ..
                }) => {
                    let note = format!(
                        "autohedge: continued on {} after {} broke ({class})",
                        ep.name, from.name
                    );
                    let mut splicer = Splicer {
                        parser: SseParser::with_max_event(cfg.max_event_bytes),
                        identity: c.identity.clone(),
                        note: Some(note),
                    };
                    for b in prelude {
                        if let Ok(out) = splicer.push(&b)
                            && !out.is_empty()
                        {
                            self.prelude.push_back(out);
                        }
                    }
                    let held = picked.map(|p| p.in_flight);
                    self.rest = Box::pin(rest.map(move |r| {
                        let _held = &held;
                        match r {
                            Ok(b) => splicer.push(&b).map_err(|e| Box::new(e) as _),
                            Err(e) => Err(e),
                        }
                    }));
                    self.parser = SseParser::with_max_event(cfg.max_event_bytes);
                    self.done_seen = false;
                    self.finished = false;
                    self.deadline =
                        (super::after(Instant::now(), ep.timeouts.total)).min(c.deadline);
                    self.idle = ep.timeouts.first_token;
                    self.guard.push_attempt(
                        &ep.name,
                        base.as_deref(),
                        Outcome::Ok,
                        Some(200),
                        None,
                        attempt_trace,
                    );
                    self.guard.address = base.as_deref().map(Arc::from);
                    if let Some(row) = self.guard.row.as_mut() {
                        row.continued_from = Some(from.name.clone());
                        row.endpoint = Some(ep.name.clone());
                    }
                    // The first leg's tokens as its upstream billed them (its usage, else
                    // counted), recorded against it; the second leg counts from zero and the
                    // row sums both.
                    let tapped = self
                        .guard
                        .usage_tap
                        .as_ref()
                        .and_then(|t| t.lock().ok().and_then(|u| *u));
                    let first = Leg::of(
                        &from,
                        self.guard.usage.or(tapped),
                        self.guard.prompt_estimate,
                        wire::estimate_tokens(self.guard.out_chars),
                        self.guard.op,
                    );
                    app.registry.record_tokens(
                        &from.name,
                        first.tokens_in,
                        first.tokens_out,
                        first.estimated,
                        false,
                    );
                    self.guard.prior = Some(self.guard.prior.map_or(first, |p| p.plus(first)));
                    self.guard.prompt_estimate =
                        self.guard.prompt_estimate.saturating_add(first.tokens_out);
                    self.guard.out_chars = 0;
                    self.guard.ep = ep.clone();
                    self.guard.break_recorded = false;
                    self.guard.usage = None;
                    self.guard.usage_tap = usage_tap;
                    tracing::debug!(request_id = %c.request_id, from = %from.name, to = %ep.name, "stream continued");
                    // Rescan what is queued, so usage and [DONE] in it are seen.
                    let queued: Vec<Bytes> = self.prelude.iter().cloned().collect();
                    for b in &queued {
                        let _ = self.scan(b);
                    }
                    return !self.prelude.is_empty();
                }
                Ok(Success::Full { .. }) => continue,
                Err(f) => {
                    let secrets = self.guard.secrets(&ep);
                    let detail = classify::redact(&f.detail, &secrets);
                    self.guard.push_attempt(
                        &ep.name,
                        base.as_deref(),
                        f.class,
                        f.status,
                        Some(detail.clone()),
                        attempt_trace,
                    );
                    // A failure of the request's own key is the client's, not the endpoint's.
                    if f.class.counts_against_endpoint() && own_key.is_none() {
                        app.registry.apply(
                            &ep,
                            &cfg.policy,
                            Effect::Failure {
                                class: f.class,
                                detail,
                                who: self.guard.witness(f.class),
                            },
                        );
                    }
                }
            }
        }
        false
    }
}
