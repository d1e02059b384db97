//! An idle HTTP/1 keep-alive connection holds its socket and little else.
//!
//! hyper's HTTP/1 server gives each connection an 8 KiB read buffer and an 8 KiB header buffer
//! and keeps both while the connection waits for its next request: with the connection's own
//! state, about 22 KB a connection (4,000 idle clients: 24 → 111 MB). Here a connection whose
//! wait for its next request has lasted [`PARK_AFTER`] is *parked*: hyper is asked to close it
//! the way it closes an idle connection (a graceful shutdown, which touches nothing on the wire)
//! without shutting the socket, its parts are taken back (the socket, and any bytes of a next
//! request already read), and hyper's connection is dropped with its buffers. The socket alone
//! then waits to be readable — the rest of the wait's `server.header_timeout`, as hyper's own
//! keep-alive deadline — and a new hyper connection serves what comes. A connection that keeps
//! sending requests never parks and pays nothing for it; one that sends a request now and then
//! pays for a new hyper connection a request (about a microsecond).
//!
//! What a park must never do is change what the client sees. So a park happens only when hyper
//! was waiting for a head: if a request came in meanwhile (hyper, asked to close, then finishes
//! it with `connection: close`), the connection closes as that header says; bytes of a head
//! begun are served by the next connection before anything read after them ([`Rewind`]), under
//! the deadline that head began under (`ConnTimer::parking`); the drain and the hard stop close
//! a parked connection at once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use hyper::rt::{Read, ReadBufCursor, Write};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::front::send_deadline::SendDeadline;
use crate::front::stop::{Drains, Watched};
use crate::front::timer::ConnTimer;

/// How long a keep-alive connection waits for its next request holding hyper's buffers before
/// it is parked.
pub const PARK_AFTER: Duration = Duration::from_secs(1);

/// Connections parked now, and parks since the start (`/metrics`).
static PARKED: AtomicU64 = AtomicU64::new(0);
static PARKS: AtomicU64 = AtomicU64::new(0);

/// HTTP/1 connections parked now (`autohedge_http1_connections_parked`).
pub fn parked_now() -> u64 {
    PARKED.load(Ordering::Relaxed)
}

/// Parks since the process started, a head begun or not (`autohedge_http1_parks_total`).
pub fn parks_total() -> u64 {
    PARKS.load(Ordering::Relaxed)
}

/// Counts a connection as parked while it lives.
struct ParkedGuard;

impl ParkedGuard {
    fn new() -> ParkedGuard {
        PARKED.fetch_add(1, Ordering::Relaxed);
        ParkedGuard
    }
}

impl Drop for ParkedGuard {
    fn drop(&mut self) {
        PARKED.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The client socket as the front door serves it.
pub type ClientIo = SendDeadline<TokioIo<TcpStream>>;

/// The boxed future each request's response comes from (hyper needs it `Unpin` to hand the
/// connection back).
pub type ResponseFuture = Pin<
    Box<dyn Future<Output = Result<axum::response::Response, std::convert::Infallible>> + Send>,
>;

/// What a stretch's socket has seen, shared with its [`Parkable`].
#[derive(Default)]
struct Seen {
    /// Any byte handed to hyper.
    read_any: AtomicBool,
    /// The last write waited for the client (hyper still holds bytes it has not sent).
    write_blocked: AtomicBool,
}

/// A socket read from `prefix` first: bytes of a head a parked connection had begun. Notes
/// what it has seen ([`Seen`]).
pub struct Rewind {
    prefix: Bytes,
    inner: ClientIo,
    seen: Arc<Seen>,
}

impl Rewind {
    fn new(inner: ClientIo, prefix: Bytes, seen: Arc<Seen>) -> Rewind {
        Rewind {
            prefix,
            inner,
            seen,
        }
    }

    /// Notes whether a write waited.
    fn wrote<T>(&self, r: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        self.seen
            .write_blocked
            .store(r.is_pending(), Ordering::Relaxed);
        r
    }
}

impl Read for Rewind {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        mut buf: ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            self.seen.read_any.store(true, Ordering::Relaxed);
            return Poll::Ready(Ok(()));
        }
        // SAFETY: `dst` is the cursor's unfilled memory; the socket fills the front of it
        // through `rb` (never de-initialising anything), and the cursor is advanced by exactly
        // what `rb` reports filled.
        let dst = unsafe { buf.as_mut() };
        let mut rb = hyper::rt::ReadBuf::uninit(dst);
        ready!(Pin::new(&mut self.inner).poll_read(cx, rb.unfilled()))?;
        let n = rb.filled().len();
        if n > 0 {
            self.seen.read_any.store(true, Ordering::Relaxed);
        }
        // SAFETY: the first `n` bytes were just filled.
        unsafe { buf.advance(n) };
        Poll::Ready(Ok(()))
    }
}

impl Write for Rewind {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.wrote(r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.wrote(r)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.inner).poll_flush(cx);
        self.wrote(r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// How a served stretch of a connection ended.
enum Ended {
    /// Closed (by the client, an error, a drain, `connection: close`): nothing more to serve.
    Closed,
    /// Parked while waiting for a head: the socket, bytes of that head already read, and the
    /// deadline the wait had.
    Parked {
        io: ClientIo,
        begun: Bytes,
        deadline: tokio::time::Instant,
    },
}

/// A hyper HTTP/1 connection that parks when its timer asks ([`ConnTimer::take_park`]) while it
/// waits for a head. Polled as hyper's own future (which flushes and shuts the socket down when
/// the connection ends) except once a park is under way, when hyper is asked to close without
/// touching the socket and hand its parts back.
struct Parkable {
    conn: Option<http1::Connection<Rewind, Counted>>,
    timer: ConnTimer,
    /// Requests this connection has started (the service counts them), and how many had when
    /// this stretch of it began.
    started: Arc<AtomicU64>,
    started_before: u64,
    seen: Arc<Seen>,
    /// Asked to park: the wait's deadline, and how many requests had started then.
    parking: Option<(tokio::time::Instant, u64)>,
    drained: bool,
}

impl Parkable {
    /// Whether the park asked for still stands: no request started since (hyper, asked to
    /// close, answers it with `connection: close` and ends as that says) and no drain came.
    fn parking(&self) -> Option<tokio::time::Instant> {
        let (deadline, started) = self.parking?;
        (!self.drained && self.started.load(Ordering::Relaxed) == started).then_some(deadline)
    }

    /// Whether a park may be asked for now: hyper waits for a head and holds nothing unsent,
    /// and this stretch has read no byte of its first head (hyper, which holds a new
    /// connection busy until its first answer, would close it after that answer).
    fn may_park(&self) -> bool {
        let first_head_begun = self.seen.read_any.load(Ordering::Relaxed)
            && self.started.load(Ordering::Relaxed) == self.started_before;
        let busy = self.parking.is_some()
            || self.drained
            || self.seen.write_blocked.load(Ordering::Relaxed)
            || first_head_begun;
        !busy
    }
}

impl Parkable {
    /// Polls hyper: as its own future (whose end flushes and shuts the socket down), or, once a
    /// park stands, without the shutdown, handing the parts back.
    fn poll_conn(&mut self, cx: &mut Context<'_>) -> Poll<hyper::Result<Ended>> {
        loop {
            let parking = self.parking();
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(Ok(Ended::Closed));
            };
            let Some(deadline) = parking else {
                let r = ready!(Pin::new(conn).poll(cx));
                self.conn = None;
                return Poll::Ready(r.map(|()| Ended::Closed));
            };
            ready!(conn.poll_without_shutdown(cx))?;
            let Some(conn) = self.conn.take() else {
                continue;
            };
            let parts = conn.into_parts();
            return Poll::Ready(Ok(Ended::Parked {
                io: parts.io.inner,
                begun: join(parts.read_buf, parts.io.prefix),
                deadline,
            }));
        }
    }
}

impl Future for Parkable {
    type Output = hyper::Result<Ended>;

    /// Polls hyper, then asks for a park if the timer says the wait for a head has lasted
    /// [`PARK_AFTER`] and a park may be asked for now.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let r = this.poll_conn(cx);
        if r.is_pending()
            && let Some(deadline) = this.timer.take_park()
            && this.may_park()
        {
            this.parking = Some((deadline, this.started.load(Ordering::Relaxed)));
            if let Some(conn) = this.conn.as_mut() {
                Pin::new(conn).graceful_shutdown();
            }
            return this.poll_conn(cx);
        }
        r
    }
}

impl Drains for Parkable {
    fn drain(self: Pin<&mut Self>) {
        let this = self.get_mut();
        this.drained = true;
        if let Some(conn) = this.conn.as_mut() {
            Pin::new(conn).graceful_shutdown();
        }
    }
}

/// Bytes of a head begun: what hyper had read of them, then what it had not yet read of the
/// bytes an earlier park handed it.
fn join(read: Bytes, rest: Bytes) -> Bytes {
    if read.is_empty() {
        return rest;
    }
    if rest.is_empty() {
        return read;
    }
    let mut v = Vec::with_capacity(read.len() + rest.len());
    v.extend_from_slice(&read);
    v.extend_from_slice(&rest);
    Bytes::from(v)
}

/// Serves an HTTP/1 connection: hyper while requests come, parked (the socket alone) while
/// none does, under the hard stop (`stop`) and the graceful drain (`drain`).
pub async fn serve_http1(
    builder: &http1::Builder,
    io: ClientIo,
    handler: Handler,
    stop: &CancellationToken,
    drain: &CancellationToken,
) -> hyper::Result<()> {
    let started = Arc::new(AtomicU64::new(0));
    let mut io = io;
    let mut begun = Bytes::new();
    let mut first_deadline = None;
    loop {
        let timer = ConnTimer::parking(PARK_AFTER, first_deadline);
        let seen = Arc::new(Seen::default());
        let conn = {
            // Dropped here, not held (with its timer) while the connection is parked.
            let mut b = builder.clone();
            b.timer(timer.clone());
            let counted = Counted {
                handler: handler.clone(),
                started: started.clone(),
            };
            b.serve_connection(Rewind::new(io, begun, seen.clone()), counted)
        };
        let stretch = Parkable {
            conn: Some(conn),
            timer,
            started_before: started.load(Ordering::Relaxed),
            seen,
            started: started.clone(),
            parking: None,
            drained: false,
        };
        let Ended::Parked {
            io: parked,
            begun: head,
            deadline,
        } = Watched::new(stop, drain, stretch).await?
        else {
            return Ok(());
        };
        PARKS.fetch_add(1, Ordering::Relaxed);
        io = parked;
        if !head.is_empty() {
            // A head begun: served again at once, by its own deadline.
            begun = head;
            first_deadline = Some(deadline);
            continue;
        }
        begun = Bytes::new();
        // The next head is still the one this wait began for: it ends by this wait's deadline
        // (a wake, or a request begun just before it, gets no fresh `header_timeout`).
        first_deadline = Some(deadline);
        // Parked: the socket alone waits for the next request.
        let _parked = ParkedGuard::new();
        tokio::select! {
            biased;
            _ = stop.cancelled() => return Ok(()),
            _ = drain.cancelled() => return Ok(()),
            r = tokio::time::timeout_at(deadline, io.get_ref().inner().readable()) => match r {
                Ok(Ok(())) => {}
                // Idle for the whole `header_timeout`, or the socket failed: closed.
                Ok(Err(_)) | Err(_) => return Ok(()),
            },
        }
    }
}

/// What answers each request of a connection.
pub type Handler =
    Arc<dyn Fn(hyper::Request<hyper::body::Incoming>) -> ResponseFuture + Send + Sync>;

/// The service, counting the requests it starts (a park must know whether one did).
#[derive(Clone)]
struct Counted {
    handler: Handler,
    started: Arc<AtomicU64>,
}

impl hyper::service::Service<hyper::Request<hyper::body::Incoming>> for Counted {
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = ResponseFuture;

    fn call(&self, req: hyper::Request<hyper::body::Incoming>) -> Self::Future {
        self.started.fetch_add(1, Ordering::Relaxed);
        (self.handler)(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parked connection's task holds the serving future: kept small, since 10,000 idle
    /// clients hold 10,000 of them (hyper's connection, with its buffers, is boxed and dropped
    /// at the park).
    #[tokio::test]
    async fn the_serving_future_stays_small() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let io = SendDeadline::new(TokioIo::new(c), Duration::from_secs(1));
        let handler: Handler = Arc::new(|_| {
            Box::pin(async { Ok(axum::response::Response::default()) }) as ResponseFuture
        });
        let (stop, drain) = (CancellationToken::new(), CancellationToken::new());
        let builder = http1::Builder::new();
        let f = serve_http1(&builder, io, handler, &stop, &drain);
        let size = std::mem::size_of_val(&f);
        assert!(size <= 1024, "the serving future is {size} bytes");
    }
}
