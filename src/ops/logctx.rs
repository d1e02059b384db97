//! Which request a log line was written for. Every line logged while a request is served — a
//! failed attempt, a stream that broke after its commit, its drop guard — carries the request's
//! id: `"span": {"request_id": …, "name": "request"}` in JSON, `request{request_id=…}:` in text,
//! the shape `tracing-subscriber` gives a line logged inside a `request` span.
//!
//! Why not a `tracing` span: the subscriber formats a span's fields into a string when the span
//! opens, keeps it in its slab registry, and walks its span stack on every poll the span is
//! entered for — about 7,500 instructions a request, 5 % of the gateway's work, paid by every
//! request although most log nothing but their access line (which is written directly, with the
//! same `span` object). Here the request's id sits in a thread-local while the request's future
//! or its response body is polled or dropped ([`InRequest`], [`enter`]), and the formatter
//! ([`Format`]) reads it only for a line that is actually written.

use std::cell::RefCell;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Writer};
use tracing_subscriber::registry::LookupSpan;

thread_local! {
    static CURRENT: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// The request being served on this thread now, if any.
pub fn current() -> Option<Arc<str>> {
    CURRENT.with(|c| c.try_borrow().ok().and_then(|c| c.clone()))
}

/// Marks this thread as serving `id` until the guard is dropped (then the previous request, if
/// any, is current again).
pub fn enter(id: &Arc<str>) -> Entered {
    Entered {
        prev: CURRENT.with(|c| {
            c.try_borrow_mut()
                .ok()
                .and_then(|mut c| c.replace(id.clone()))
        }),
    }
}

pub struct Entered {
    prev: Option<Arc<str>>,
}

impl Drop for Entered {
    fn drop(&mut self) {
        let prev = self.prev.take();
        CURRENT.with(|c| {
            if let Ok(mut c) = c.try_borrow_mut() {
                *c = prev;
            }
        });
    }
}

/// A future polled — and dropped — as serving `id`.
pub struct InRequest<F> {
    id: Arc<str>,
    inner: Option<Pin<Box<F>>>,
}

impl<F> InRequest<F> {
    pub fn new(id: Arc<str>, inner: F) -> InRequest<F> {
        InRequest {
            id,
            inner: Some(Box::pin(inner)),
        }
    }
}

impl<F: Future> Future for InRequest<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        let _in = enter(&this.id);
        match this.inner.as_mut() {
            Some(f) => f.as_mut().poll(cx),
            // Polled after it finished: never by the gateway; pending is the only safe answer.
            None => Poll::Pending,
        }
    }
}

impl<F> Drop for InRequest<F> {
    fn drop(&mut self) {
        let _in = enter(&self.id);
        drop(self.inner.take());
    }
}

/// The event formatter: `tracing-subscriber`'s own JSON or text shape, with the current
/// request's `span` added.
pub enum Format {
    /// One JSON object a line, fields at the top level (`flatten_event`).
    Json(format::Format<format::Json>),
    /// The text line: timestamp and level written here, then the request, then the subscriber's
    /// own rendering of the message and fields.
    Text(format::Format<format::Full, ()>),
}

impl Format {
    pub fn json() -> Format {
        Format::Json(
            format::format()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false)
                .with_target(false),
        )
    }

    pub fn text() -> Format {
        Format::Text(
            format::format()
                .with_target(false)
                .with_level(false)
                .without_time(),
        )
    }
}

impl<S, N> FormatEvent<S, N> for Format
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let request = current();
        match self {
            Format::Json(inner) => {
                let Some(id) = request else {
                    return inner.format_event(ctx, writer, event);
                };
                // The subscriber's own object, with the request's `span` as its last entry.
                let mut line = String::with_capacity(512);
                inner.format_event(ctx, Writer::new(&mut line), event)?;
                let end = line.trim_end().len();
                if line[..end].ends_with('}') {
                    line.truncate(end - 1);
                    line.push_str(",\"span\":{\"request_id\":");
                    line.push_str(&json_string(&id));
                    line.push_str(",\"name\":\"request\"}}\n");
                }
                writer.write_str(&line)
            }
            Format::Text(inner) => {
                let ansi = writer.has_ansi_escapes();
                let mut ts = Vec::with_capacity(32);
                crate::ops::telemetry::rfc3339(&mut ts, std::time::SystemTime::now());
                let ts = std::str::from_utf8(&ts).unwrap_or_default();
                let level = *event.metadata().level();
                let (name, color) = match level {
                    Level::TRACE => ("TRACE", "35"),
                    Level::DEBUG => ("DEBUG", "34"),
                    Level::INFO => (" INFO", "32"),
                    Level::WARN => (" WARN", "33"),
                    Level::ERROR => ("ERROR", "31"),
                };
                if ansi {
                    write!(writer, "\x1b[2m{ts}\x1b[0m \x1b[{color}m{name}\x1b[0m ")?;
                } else {
                    write!(writer, "{ts} {name} ")?;
                }
                if let Some(id) = request {
                    if ansi {
                        write!(
                            writer,
                            "\x1b[1mrequest\x1b[0m\x1b[1m{{\x1b[0m\x1b[3mrequest_id\x1b[0m\x1b[2m=\x1b[0m{id}\x1b[1m}}\x1b[0m\x1b[2m:\x1b[0m "
                        )?;
                    } else {
                        write!(writer, "request{{request_id={id}}}: ")?;
                    }
                }
                inner.format_event(ctx, writer, event)
            }
        }
    }
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Buf {
        type Writer = Buf;
        fn make_writer(&'a self) -> Buf {
            self.clone()
        }
    }

    fn lines(json: bool, ansi: bool, f: impl FnOnce()) -> String {
        let buf = Buf::default();
        let builder = tracing_subscriber::fmt()
            .with_writer(buf.clone())
            .with_ansi(ansi)
            .with_max_level(Level::DEBUG);
        if json {
            let sub = builder
                .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                .event_format(Format::json())
                .finish();
            tracing::subscriber::with_default(sub, f);
        } else {
            let sub = builder.event_format(Format::text()).finish();
            tracing::subscriber::with_default(sub, f);
        }
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn json_lines_carry_the_request_they_were_logged_for() {
        let out = lines(true, false, || {
            tracing::warn!(class = "server_error", status = 502u16, "attempt failed");
            let id: Arc<str> = Arc::from("req-\"1\"");
            let _in = enter(&id);
            tracing::info!(endpoint = "a", "inside");
            {
                let other: Arc<str> = Arc::from("req-2");
                let _nested = enter(&other);
                tracing::debug!("nested");
            }
            tracing::error!("back");
        });
        let v: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(v.len(), 4, "{out}");
        assert_eq!(v[0]["level"], "WARN");
        assert_eq!(v[0]["message"], "attempt failed");
        assert_eq!(v[0]["class"], "server_error");
        assert_eq!(v[0]["status"], 502);
        assert!(v[0].get("span").is_none(), "{}", v[0]);
        assert!(v[0]["timestamp"].as_str().unwrap().ends_with('Z'));
        assert_eq!(v[1]["span"]["request_id"], "req-\"1\"");
        assert_eq!(v[1]["span"]["name"], "request");
        assert_eq!(v[1]["endpoint"], "a");
        assert_eq!(v[2]["span"]["request_id"], "req-2");
        assert_eq!(v[3]["span"]["request_id"], "req-\"1\"");
    }

    #[test]
    fn text_lines_carry_the_request_in_the_subscribers_shape() {
        let out = lines(false, false, || {
            tracing::info!(k = 1, "plain");
            let id: Arc<str> = Arc::from("abc");
            let _in = enter(&id);
            tracing::warn!(k = 2, "inside");
        });
        let l: Vec<&str> = out.lines().collect();
        assert_eq!(l.len(), 2, "{out}");
        assert!(l[0].ends_with("Z  INFO plain k=1"), "{}", l[0]);
        assert!(
            l[1].ends_with("Z  WARN request{request_id=abc}: inside k=2"),
            "{}",
            l[1]
        );
        let colored = lines(false, true, || tracing::error!("red"));
        assert!(colored.contains("\x1b[31mERROR\x1b[0m"), "{colored:?}");
    }

    #[test]
    fn a_future_is_polled_and_dropped_as_its_request() {
        use std::task::Wake;
        struct Noop;
        impl Wake for Noop {
            fn wake(self: Arc<Self>) {}
        }
        let seen = Arc::new(Mutex::new(Vec::new()));
        struct Probe(Arc<Mutex<Vec<Option<String>>>>);
        impl Drop for Probe {
            fn drop(&mut self) {
                self.0
                    .lock()
                    .unwrap()
                    .push(current().map(|s| s.to_string()));
            }
        }
        let probe = Probe(seen.clone());
        let s2 = seen.clone();
        let fut = InRequest::new(Arc::from("r1"), async move {
            s2.lock().unwrap().push(current().map(|s| s.to_string()));
            std::future::pending::<()>().await;
            drop(probe);
        });
        let mut fut = Box::pin(fut);
        let waker = Arc::new(Noop).into();
        let mut cx = Context::from_waker(&waker);
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        assert_eq!(current(), None, "the id does not outlive the poll");
        drop(fut);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![Some("r1".to_string()), Some("r1".to_string())]
        );
        assert_eq!(current(), None);
    }
}
