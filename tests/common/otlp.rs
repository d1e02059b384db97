//! A loopback OTLP/HTTP collector: decodes what the gateway posts to `/v1/traces` (protobuf,
//! with the OpenTelemetry protocol's own message types) and keeps the spans; it can be told to
//! refuse (503) or to hang, as a collector that is down or overloaded does.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio_util::sync::CancellationToken;

/// How the collector answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Accept,
    Refuse,
    Hang,
}

#[derive(Default)]
struct Seen {
    spans: Vec<(BTreeMap<String, String>, Span)>,
    posts: u64,
    headers: Vec<BTreeMap<String, String>>,
}

pub struct Collector {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
    mode: Arc<Mutex<Mode>>,
    cancel: CancellationToken,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// A span's attribute as text (strings, ints, doubles, bools).
pub fn attr(s: &Span, key: &str) -> Option<String> {
    s.attributes.iter().find(|kv| kv.key == key).and_then(|kv| {
        Some(match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(v) => v.clone(),
            AnyValue::IntValue(v) => v.to_string(),
            AnyValue::DoubleValue(v) => v.to_string(),
            AnyValue::BoolValue(v) => v.to_string(),
            // An array of strings, joined with commas.
            AnyValue::ArrayValue(a) => a
                .values
                .iter()
                .filter_map(|v| match v.value.as_ref()? {
                    AnyValue::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join(","),
            _ => return None,
        })
    })
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen: Arc<Mutex<Seen>> = Default::default();
        let mode = Arc::new(Mutex::new(Mode::Accept));
        let cancel = CancellationToken::new();
        let (s, m, c) = (seen.clone(), mode.clone(), cancel.clone());
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let (s, m) = (s.clone(), m.clone());
                    async move {
                        let mode = *m.lock().unwrap();
                        match mode {
                            Mode::Hang => {
                                std::future::pending::<()>().await;
                                unreachable!()
                            }
                            Mode::Refuse => {
                                s.lock().unwrap().posts += 1;
                                return (axum::http::StatusCode::SERVICE_UNAVAILABLE, Vec::new());
                            }
                            Mode::Accept => {}
                        }
                        let req = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                        let mut g = s.lock().unwrap();
                        g.posts += 1;
                        g.headers.push(
                            headers
                                .iter()
                                .map(|(k, v)| {
                                    (k.to_string(), v.to_str().unwrap_or("").to_string())
                                })
                                .collect(),
                        );
                        for rs in req.resource_spans {
                            let resource: BTreeMap<String, String> = rs
                                .resource
                                .iter()
                                .flat_map(|r| r.attributes.iter())
                                .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
                                    AnyValue::StringValue(v) => Some((kv.key.clone(), v.clone())),
                                    _ => None,
                                })
                                .collect();
                            for ss in rs.scope_spans {
                                for span in ss.spans {
                                    g.spans.push((resource.clone(), span));
                                }
                            }
                        }
                        let ok = opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse::default();
                        (axum::http::StatusCode::OK, ok.encode_to_vec())
                    }
                },
            ),
        );
        tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(c.cancelled_owned())
                .await
                .ok();
        });
        Collector {
            addr,
            seen,
            mode,
            cancel,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/v1/traces", self.addr)
    }

    pub fn set(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.seen
            .lock()
            .unwrap()
            .spans
            .iter()
            .map(|(_, s)| s.clone())
            .collect()
    }

    /// The resource attributes the spans came with (the last export's).
    pub fn resource(&self) -> BTreeMap<String, String> {
        self.seen
            .lock()
            .unwrap()
            .spans
            .last()
            .map(|(r, _)| r.clone())
            .unwrap_or_default()
    }

    pub fn posts(&self) -> u64 {
        self.seen.lock().unwrap().posts
    }

    pub fn headers(&self) -> Vec<BTreeMap<String, String>> {
        self.seen.lock().unwrap().headers.clone()
    }

    /// The spans of trace `trace` (hex), once `n` of them came (within 10 s).
    pub async fn trace(&self, trace: &str, n: usize) -> Vec<Span> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let spans: Vec<Span> = self
                .spans()
                .into_iter()
                .filter(|s| hex(&s.trace_id) == trace)
                .collect();
            if spans.len() >= n || std::time::Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
}
