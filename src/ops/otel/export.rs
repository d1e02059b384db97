//! The export side: a bounded queue of finished spans and the task that posts them in batches
//! through `opentelemetry-otlp`'s HTTP exporter (protobuf). The request path only counts and
//! queues; a full queue drops (counted), a collector that fails or hangs costs the batch (counted,
//! with its error for `/status`), never a request's time. The queue is bounded in spans and in
//! bytes, and with several client keys no key holds more than half of either: one key's flood
//! of requests (or of long prompts with `capture_content`) never drops another key's spans.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SpanData, SpanExporter};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, OtlpSettings};
use crate::store::RequestRow;

/// Spans sent in one export at most.
const BATCH: usize = 512;
/// A batch waits at most this long for more spans.
const LINGER: Duration = Duration::from_millis(500);
/// One export's limit (the exporter's own timeout; the task also stops waiting then).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// What shutdown waits for the last spans.
const FLUSH_FOR: Duration = Duration::from_secs(2);

/// The request path's side (cheap to clone: the export task holds one): the queue's sender
/// and the counts `/status` shows.
#[derive(Clone)]
pub struct Traces(Arc<Inner>);

struct Inner {
    tx: mpsc::UnboundedSender<Queued>,
    rx: Mutex<Option<mpsc::UnboundedReceiver<Queued>>>,
    /// Spans queued and not yet taken by the export task: bounded by `max_queue_spans`.
    queued: AtomicUsize,
    /// What is queued, in all and by client key: bounded by `max_queue_spans` and
    /// `max_queue_bytes`, and a key's share by half of each.
    held: Mutex<Held>,
    exported: AtomicU64,
    dropped: AtomicU64,
    failed_exports: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl Default for Traces {
    fn default() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Traces(Arc::new(Inner {
            tx,
            rx: Mutex::new(Some(rx)),
            queued: AtomicUsize::new(0),
            held: Mutex::new(Held::default()),
            exported: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            failed_exports: AtomicU64::new(0),
            last_error: Mutex::new(None),
        }))
    }
}

/// One request's spans on their way to the export task.
struct Queued {
    key: String,
    spans: Vec<SpanData>,
    bytes: usize,
}

/// Spans and bytes queued, in all and by client key (`""`: requests without one).
#[derive(Default)]
struct Held {
    spans: usize,
    bytes: usize,
    by_key: HashMap<String, (usize, usize)>,
}

impl Held {
    /// Takes `n` spans of `bytes` for `key` if they fit: the queue's bounds, and with `shared`
    /// (several client keys) half of each for any one key.
    fn admit(
        &mut self,
        key: &str,
        (n, bytes): (usize, usize),
        s: &OtlpSettings,
        shared: bool,
    ) -> bool {
        let (ks, kb) = self.by_key.get(key).copied().unwrap_or_default();
        let fits = self.spans + n <= s.max_queue_spans
            && self.bytes + bytes <= s.max_queue_bytes
            && (!shared
                || (ks + n <= s.max_queue_spans.div_ceil(2)
                    && kb + bytes <= s.max_queue_bytes.div_ceil(2)));
        if fits {
            self.spans += n;
            self.bytes += bytes;
            let e = self.by_key.entry(key.to_string()).or_default();
            *e = (e.0 + n, e.1 + bytes);
        }
        fits
    }

    /// `key`'s `n` spans of `bytes` left the queue.
    fn release(&mut self, key: &str, (n, bytes): (usize, usize)) {
        self.spans = self.spans.saturating_sub(n);
        self.bytes = self.bytes.saturating_sub(bytes);
        if let Some(e) = self.by_key.get_mut(key) {
            *e = (e.0.saturating_sub(n), e.1.saturating_sub(bytes));
            if e.0 == 0 && e.1 == 0 {
                self.by_key.remove(key);
            }
        }
    }
}

/// What a span holds in memory, about: its strings and a fixed part for the rest.
fn span_bytes(s: &SpanData) -> usize {
    fn kvs(attrs: &[opentelemetry::KeyValue]) -> usize {
        attrs
            .iter()
            .map(|kv| {
                48 + kv.key.as_str().len()
                    + match &kv.value {
                        opentelemetry::Value::String(v) => v.as_str().len(),
                        _ => 16,
                    }
            })
            .sum()
    }
    let events: usize = s
        .events
        .events
        .iter()
        .map(|e| 64 + e.name.len() + kvs(&e.attributes))
        .sum();
    256 + s.name.len() + kvs(&s.attributes) + events
}

impl Traces {
    /// The finished request's spans, queued (never waited for): past `max_queue_spans` or
    /// `max_queue_bytes` (or, with several client keys, past half of either for the request's
    /// key) they are dropped and counted.
    pub fn record(&self, cfg: &Config, row: &RequestRow) {
        let Some(settings) = &cfg.otlp else {
            return;
        };
        if !row.trace.as_ref().is_some_and(|t| t.export) {
            return;
        }
        let spans = super::spans::of(cfg, row);
        let n = spans.len();
        if n == 0 {
            return;
        }
        let bytes = spans.iter().map(span_bytes).sum();
        let key = row.client_key.clone().unwrap_or_default();
        let shared = cfg.auth.keys.as_ref().is_some_and(|k| k.len() > 1);
        let admitted = self.held().admit(&key, (n, bytes), settings, shared);
        if admitted {
            self.0.queued.fetch_add(n, Ordering::Relaxed);
            let q = Queued { key, spans, bytes };
            if let Err(mpsc::error::SendError(q)) = self.0.tx.send(q) {
                self.taken(&q.key, (n, q.bytes));
            } else {
                return;
            }
        }
        self.0.dropped.fetch_add(n as u64, Ordering::Relaxed);
        metrics::counter!("autohedge_otlp_spans_dropped_total").increment(n as u64);
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.0.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `key`'s `n` spans of `bytes` left the queue (taken for export, or not sent).
    fn taken(&self, key: &str, (n, bytes): (usize, usize)) {
        self.held().release(key, (n, bytes));
        self.0.queued.fetch_sub(n, Ordering::Relaxed);
    }

    /// Spans waiting to be exported.
    pub fn queued(&self) -> usize {
        self.0.queued.load(Ordering::Relaxed)
    }

    /// `/status.telemetry`.
    pub fn status(&self, cfg: &Config) -> serde_json::Value {
        let Some(o) = &cfg.otlp else {
            return serde_json::json!({ "otlp": null });
        };
        serde_json::json!({
            "otlp": {
                "endpoint": o.display,
                "sample_ratio": o.sample_ratio,
                "service_name": o.service_name,
                "capture_content": o.capture_content,
                "spans_exported": self.0.exported.load(Ordering::Relaxed),
                "spans_dropped": self.0.dropped.load(Ordering::Relaxed),
                "failed_exports": self.0.failed_exports.load(Ordering::Relaxed),
                "queued_spans": self.queued(),
                "last_error": *self.0.last_error.lock().unwrap_or_else(|e| e.into_inner()),
            }
        })
    }
}

/// reqwest (the gateway's own version) as the exporter's HTTP client.
#[derive(Debug)]
struct Client(reqwest::Client);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Client {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> Result<http::Response<Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let mut rb = self
            .0
            .request(parts.method, parts.uri.to_string())
            .timeout(EXPORT_TIMEOUT)
            .body(body);
        for (k, v) in &parts.headers {
            rb = rb.header(k, v);
        }
        let resp = rb.send().await?;
        let status = resp.status();
        // A collector's answer is small; a larger one is read no further than this.
        let mut body = Vec::new();
        let mut resp = resp;
        while let Some(chunk) = resp.chunk().await? {
            if body.len() + chunk.len() > 1 << 20 {
                break;
            }
            body.extend_from_slice(&chunk);
        }
        Ok(http::Response::builder()
            .status(status)
            .body(Bytes::from(body))?)
    }
}

fn exporter(s: &OtlpSettings) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let client = reqwest::Client::builder()
        .timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|e| e.to_string())?;
    let headers: HashMap<String, String> = s
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.expose().to_string()))
        .collect();
    let mut e = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(Client(client))
        .with_endpoint(s.endpoint.as_str())
        .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
        .with_timeout(EXPORT_TIMEOUT)
        .with_headers(headers)
        .build()
        .map_err(|e| e.to_string())?;
    e.set_resource(
        &opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(s.service_name.clone())
            .with_attribute(opentelemetry::KeyValue::new(
                "service.version",
                env!("CARGO_PKG_VERSION"),
            ))
            .build(),
    );
    Ok(e)
}

/// The export task: batches what `Traces::record` queued and posts it to the collector that
/// `settings` names now (the current config's; the exporter is rebuilt when a reload changes
/// it). On shutdown, what is queued gets [`FLUSH_FOR`].
pub async fn run(
    traces: Traces,
    settings: impl Fn() -> Option<Arc<OtlpSettings>> + Send + 'static,
    cancel: CancellationToken,
) {
    let Some(mut rx) = traces.0.rx.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    let mut built: Option<(Arc<OtlpSettings>, opentelemetry_otlp::SpanExporter)> = None;
    let mut batch: Vec<SpanData> = Vec::new();
    let mut stopping = false;
    loop {
        // Gather a batch: the first spans, then what comes within `LINGER`.
        if batch.is_empty() {
            let first = tokio::select! {
                spans = rx.recv() => spans,
                _ = cancel.cancelled(), if !stopping => {
                    stopping = true;
                    continue;
                }
                _ = tokio::time::sleep(FLUSH_FOR), if stopping => None,
            };
            let Some(q) = first else { return };
            traces.taken(&q.key, (q.spans.len(), q.bytes));
            batch.extend(q.spans);
        }
        let until = tokio::time::Instant::now() + LINGER;
        while batch.len() < BATCH {
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some(q)) => {
                    traces.taken(&q.key, (q.spans.len(), q.bytes));
                    batch.extend(q.spans);
                }
                Ok(None) | Err(_) => break,
            }
            if stopping {
                break;
            }
        }
        let spans = std::mem::take(&mut batch);
        let n = spans.len();
        let Some(settings) = settings() else {
            // Tracing was turned off by a reload: what was queued is let go.
            built = None;
            traces.0.dropped.fetch_add(n as u64, Ordering::Relaxed);
            continue;
        };
        if built.as_ref().is_none_or(|(s, _)| **s != *settings) {
            built = match exporter(&settings) {
                Ok(e) => Some((settings.clone(), e)),
                Err(e) => {
                    let e = redact(&e, &settings);
                    fail(&traces, n, format!("building the exporter: {e}"));
                    continue;
                }
            };
        }
        let Some((_, exporter)) = &built else {
            continue;
        };
        let result = tokio::time::timeout(EXPORT_TIMEOUT + Duration::from_secs(1), async {
            exporter.export(spans).await
        })
        .await;
        match result {
            Ok(Ok(())) => {
                traces.0.exported.fetch_add(n as u64, Ordering::Relaxed);
                metrics::counter!("autohedge_otlp_spans_exported_total").increment(n as u64);
            }
            Ok(Err(e)) => fail(&traces, n, redact(&e.to_string(), &settings)),
            Err(_) => fail(&traces, n, "the collector did not answer in time".into()),
        }
    }
}

/// `text` without the export's header values (an error may quote what was sent).
fn redact(text: &str, s: &OtlpSettings) -> String {
    let secrets: Vec<&str> = s.headers.iter().map(|(_, v)| v.expose()).collect();
    crate::upstream::classify::redact(text, &secrets)
}

/// A batch the collector did not take: its spans are dropped (counted) and the error kept.
fn fail(traces: &Traces, n: usize, error: String) {
    traces.0.failed_exports.fetch_add(1, Ordering::Relaxed);
    traces.0.dropped.fetch_add(n as u64, Ordering::Relaxed);
    metrics::counter!("autohedge_otlp_spans_dropped_total").increment(n as u64);
    metrics::counter!("autohedge_otlp_export_failures_total").increment(1);
    let error: String = error.chars().take(300).collect();
    tracing::warn!(error = %error, spans = n, "OTLP export failed; spans dropped");
    *traces
        .0
        .last_error
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(error);
}
