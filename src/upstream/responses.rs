//! The Responses API's two stream adapters, each an upstream body in and a Responses event
//! stream out, whole events only:
//! - [`Rewrite`] for an endpoint that speaks Responses: every event that carries the response
//!   object gets the gateway's response id in place of the upstream's (kept in a tap, for the
//!   pin a later `previous_response_id` follows); other events pass as they came.
//! - [`FromChat`] for one that speaks only chat: chat completion chunks become the Responses
//!   event sequence ([`crate::wire::responses::ChatToEvents`]).
//!
//! Bytes that are not SSE end either stream with an `error` event, which the executor reads as
//! any other in-band error (fail over before the commit; `response.failed` after it).

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::Stream;
use serde_json::{Value, json};

use crate::wire::responses::{ChatToEvents, Meta, event};
use crate::wire::sse::SseParser;

type Inner = super::ByteStream;

/// The upstream's own id for the response, once an event said it.
pub type IdTap = Arc<Mutex<Option<String>>>;

/// Sets `v`'s response id (an event's `response.id`, or a Response object's own `id`) to the
/// gateway's, and its `previous_response_id` (the upstream's id of the turn before) to the
/// gateway's id of that turn; returns the upstream's id.
pub fn rewrite_id(v: &mut Value, gateway_id: &str, previous: Option<&str>) -> Option<String> {
    let target = if v.get("response").is_some_and(Value::is_object) {
        v.get_mut("response")?
    } else if v.get("object").and_then(Value::as_str) == Some("response") {
        v
    } else {
        return None;
    };
    let old = target.get("id").and_then(Value::as_str).map(str::to_string);
    target["id"] = json!(gateway_id);
    if let Some(p) = previous
        && target
            .get("previous_response_id")
            .is_some_and(|v| !v.is_null())
    {
        target["previous_response_id"] = json!(p);
    }
    old
}

/// One parse error's `error` event.
fn unreadable(e: &str) -> Bytes {
    Bytes::from(event(
        "error",
        0,
        json!({"code": "malformed_stream", "message": format!("upstream stream unreadable: {e}"), "param": null}),
    ))
}

/// What each of the two adapters does with one read of the upstream's body: the whole events
/// it completes, as the client is to get them (`Err`: the bytes are not SSE).
trait Render {
    fn render(&mut self, b: &Bytes) -> Result<Bytes, String>;

    /// Nothing more is to come of the stream (the upstream is read no further).
    fn finished(&self) -> bool {
        false
    }
}

/// An upstream body read through a [`Render`]: its reads rendered, empty ones skipped, the
/// first that cannot be read ending the stream with an `error` event.
pub struct Adapted<R> {
    inner: Inner,
    render: R,
    ended: bool,
}

impl<R: Render + Unpin> Stream for Adapted<R> {
    type Item = Result<Bytes, super::BoxError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if self.ended {
                return Poll::Ready(None);
            }
            match self.inner.as_mut().poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.ended = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    self.ended = true;
                    return Poll::Ready(Some(Err(e)));
                }
                Poll::Ready(Some(Ok(b))) => match self.render.render(&b) {
                    Ok(out) => {
                        if self.render.finished() {
                            // Ended (a response too large, say): the upstream's connection is
                            // let go instead of read to its end.
                            self.ended = true;
                        }
                        if out.is_empty() {
                            continue;
                        }
                        return Poll::Ready(Some(Ok(out)));
                    }
                    Err(e) => {
                        self.ended = true;
                        return Poll::Ready(Some(Ok(unreadable(&e))));
                    }
                },
            }
        }
    }
}

/// An endpoint's own Responses stream with the gateway's response id.
pub struct Rewrite {
    parser: SseParser,
    id: Arc<str>,
    previous: Option<String>,
    tap: IdTap,
}

impl Rewrite {
    pub fn new(
        inner: Inner,
        id: Arc<str>,
        previous: Option<String>,
        max_event: usize,
    ) -> (Adapted<Rewrite>, IdTap) {
        let tap: IdTap = Arc::new(Mutex::new(None));
        let render = Rewrite {
            parser: SseParser::with_max_event(max_event),
            id,
            previous,
            tap: tap.clone(),
        };
        (
            Adapted {
                inner,
                render,
                ended: false,
            },
            tap,
        )
    }
}

impl Render for Rewrite {
    fn render(&mut self, b: &Bytes) -> Result<Bytes, String> {
        let events = self.parser.push(b).map_err(|e| e.0)?;
        let mut out = String::new();
        for ev in events {
            let mut data = ev.data;
            // Only the events that carry the response object are rebuilt.
            if (data.contains("\"response\"") || data.contains("\"object\""))
                && let Ok(mut v) = serde_json::from_str::<Value>(&data)
                && let Some(old) = rewrite_id(&mut v, &self.id, self.previous.as_deref())
            {
                if let Ok(mut t) = self.tap.lock()
                    && t.is_none()
                {
                    *t = Some(old);
                }
                data = v.to_string();
            }
            if let Some(name) = &ev.event {
                out.push_str("event: ");
                out.push_str(name);
                out.push('\n');
            }
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

/// A chat completion stream (an OpenAI-compatible server's SSE, or Ollama's translated to it) as
/// the Responses event sequence. A stream that ends without chat's `[DONE]` simply ends: no
/// `response.completed`, which the executor treats as the truncation it is.
pub struct FromChat {
    parser: SseParser,
    tr: ChatToEvents,
}

impl FromChat {
    /// `max_kept`: the most output the translator keeps for `response.completed`
    /// (`server.max_response_bytes`); past it the response ends `response.failed`.
    pub fn new(inner: Inner, meta: Meta, max_event: usize, max_kept: usize) -> Adapted<FromChat> {
        Adapted {
            inner,
            render: FromChat {
                parser: SseParser::with_max_event(max_event),
                tr: ChatToEvents::bounded(meta, max_kept),
            },
            ended: false,
        }
    }
}

impl Render for FromChat {
    fn finished(&self) -> bool {
        self.tr.is_done()
    }

    fn render(&mut self, b: &Bytes) -> Result<Bytes, String> {
        let events = self.parser.push(b).map_err(|e| e.0)?;
        let mut out = String::new();
        for ev in events {
            if self.tr.is_done() {
                break;
            }
            if ev.data.trim() == "[DONE]" {
                out.push_str(&self.tr.finish());
                continue;
            }
            match serde_json::from_str::<Value>(&ev.data) {
                Ok(v) => out.push_str(&self.tr.chunk(&v)),
                Err(_) if ev.event.as_deref() == Some("error") => {
                    out.push_str(&self.tr.chunk(&json!({"error": {"message": ev.data}})));
                }
                Err(e) => return Err(format!("SSE data is not JSON: {e}")),
            }
        }
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    fn body(parts: &[&'static str]) -> Inner {
        let items: Vec<Result<Bytes, super::super::BoxError>> = parts
            .iter()
            .map(|p| Ok(Bytes::from_static(p.as_bytes())))
            .collect();
        Box::pin(futures_util::stream::iter(items))
    }

    async fn text(
        mut s: impl Stream<Item = Result<Bytes, super::super::BoxError>> + Unpin,
    ) -> String {
        let mut out = String::new();
        while let Some(Ok(b)) = s.next().await {
            out.push_str(std::str::from_utf8(&b).unwrap());
        }
        out
    }

    #[tokio::test]
    async fn the_upstreams_id_is_replaced_and_kept_and_split_events_stay_whole() {
        let (s, tap) = Rewrite::new(
            body(&[
                "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_up\",\"status\":\"in_progress\"}}\n\nevent: response.output_text.de",
                "lta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n",
            ]),
            Arc::from("resp_gw"),
            None,
            1 << 20,
        );
        let out = text(s).await;
        assert!(out.contains("\"id\":\"resp_gw\""), "{out}");
        assert!(!out.contains("resp_up"), "{out}");
        assert!(out.contains("event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n"), "{out}");
        assert_eq!(tap.lock().unwrap().as_deref(), Some("resp_up"));
    }

    #[tokio::test]
    async fn a_chat_stream_reads_as_responses_events_and_garbage_as_an_error_event() {
        let s = FromChat::new(
            body(&[
                "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n",
            ]),
            Meta::new("resp_gw", "m", &Default::default()),
            1 << 20,
            1 << 20,
        );
        let out = text(s).await;
        assert!(out.starts_with("event: response.created\n"), "{out}");
        assert!(out.contains("event: response.output_text.delta\n"), "{out}");
        assert!(
            out.trim_end()
                .lines()
                .rev()
                .nth(1)
                .unwrap()
                .starts_with("event: response.completed"),
            "{out}"
        );
        let s = FromChat::new(
            body(&["data: {nope\n\n"]),
            Meta::new("r", "m", &Default::default()),
            1 << 20,
            1 << 20,
        );
        let out = text(s).await;
        assert!(
            out.starts_with("event: error\n") && out.contains("malformed_stream"),
            "{out}"
        );
    }

    /// What the translator keeps is bounded: a stream whose text passes `max_kept` ends with
    /// `response.failed` (`response_too_large`), and what the upstream sends after is not read.
    #[tokio::test]
    async fn a_translated_stream_past_its_bound_ends_failed_and_reads_no_more() {
        let chunk = "data: {\"choices\":[{\"delta\":{\"content\":\"0123456789\"}}]}\n\n";
        let read = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = read.clone();
        let endless = futures_util::stream::iter(0..1_000_000).map(move |_| {
            r.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok::<_, super::super::BoxError>(Bytes::from_static(chunk.as_bytes()))
        });
        let s = FromChat::new(
            Box::pin(endless),
            Meta::new("resp_gw", "m", &Default::default()),
            1 << 20,
            100,
        );
        let out = text(s).await;
        assert_eq!(
            out.matches("event: response.output_text.delta\n").count(),
            10,
            "{out}"
        );
        assert!(out.contains("event: response.failed\n"), "{out}");
        assert!(out.contains(crate::wire::responses::TOO_LARGE), "{out}");
        assert!(!out.contains("response.completed"), "{out}");
        assert_eq!(read.load(std::sync::atomic::Ordering::Relaxed), 11);
    }
}
