//! HTTP/1.1 connections to one plain-`http` upstream, kept for reuse: what requests to vLLM,
//! Ollama and llama.cpp servers (and any OpenAI-compatible server without TLS) go over.
//! hyper-util's pooled client does the same for any number of hosts and both HTTP versions, and
//! pays for that generality on every request: the host hashed with SipHash on checkout and on
//! return, its `Checkout` and `Pooled` futures, a spawned task per request to wait until the
//! connection can take the next one — about 15k instructions a request (callgrind), more than a
//! tenth of the gateway's request path. One upstream and one protocol need much less: a stack
//! of idle connections behind a mutex, newest on top (the connections the upstream is least
//! likely to have closed), the oldest dropped past `idle_timeout` or past `max_idle`.
//!
//! A connection goes back on the stack only when its response body has been read to the end; a
//! body dropped before that takes the connection with it (the rest of the body is still in the
//! socket). A request that finds none idle starts a connect on a task of its own and takes a
//! connection given back meanwhile if that comes first; the new one then joins the stack. A request hyper hands back unsent — the connection closed as it was taken — is
//! written on the next idle connection or a new one. One the upstream closed after it was
//! written (a keep-alive timeout racing the request) comes back as an error whose
//! [`hyper::Error::is_incomplete_message`] is true: the caller decides whether to send it again.
//!
//! Imports nothing of the crate (it is below `config`, which builds one per plain-`http`
//! endpoint).

use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body_util::Full;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One connection's request side.
type Sender = SendRequest<Full<Bytes>>;

/// How connections are made: a `tower` service from the upstream's URI to a connected stream
/// (the gateway's `TimedConnector`, which puts the TCP connect under `timeouts.connect`).
pub trait Connect: Clone + Send + Sync + 'static {
    type Io: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static;
    fn connect(&self, uri: Uri) -> impl Future<Output = Result<Self::Io, BoxError>> + Send;
}

impl<S> Connect for S
where
    S: tower::Service<Uri, Error = BoxError> + Clone + Send + Sync + 'static,
    S::Response: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S::Future: Send,
{
    type Io = S::Response;
    fn connect(&self, uri: Uri) -> impl Future<Output = Result<Self::Io, BoxError>> + Send {
        tower::ServiceExt::oneshot(self.clone(), uri)
    }
}

/// Connections to one upstream. Cloning shares them.
pub struct H1Pool<C> {
    shared: Arc<Shared<C>>,
}

impl<C> Clone for H1Pool<C> {
    fn clone(&self) -> Self {
        H1Pool {
            shared: self.shared.clone(),
        }
    }
}

impl<C> fmt::Debug for H1Pool<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("H1Pool")
            .field("target", &self.shared.target)
            .field(
                "idle",
                &self.shared.idle.lock().map(|i| i.len()).unwrap_or(0),
            )
            .finish()
    }
}

struct Shared<C> {
    connector: C,
    /// Where new connections go (scheme and authority; the path is the request's).
    target: Uri,
    idle: Mutex<Vec<Idle>>,
    /// Told when a connection goes back on the stack (a request waiting for a connect takes it).
    returned: tokio::sync::Notify,
    idle_timeout: Duration,
    max_idle: usize,
    /// Whether a task drops the connections idle past `idle_timeout` (changed only with `idle`
    /// locked).
    reaping: std::sync::atomic::AtomicBool,
}

struct Idle {
    tx: Sender,
    since: Instant,
}

/// Why a request got no response.
#[derive(Debug)]
pub enum Error {
    /// No connection could be made (refused, unreachable, timed out, DNS).
    Connect(BoxError),
    /// The connection failed while the request was written or its response read.
    Http(hyper::Error),
}

impl Error {
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect(_))
    }

    /// The upstream closed the connection before any of the response came (hyper's
    /// "incomplete message"), or it was found closed as the request was being written.
    pub fn closed_unanswered(&self) -> bool {
        match self {
            Error::Http(e) => e.is_incomplete_message() || e.is_canceled(),
            Error::Connect(_) => false,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Connect(_) => f.write_str("client error (Connect)"),
            Error::Http(_) => f.write_str("client error (SendRequest)"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Connect(e) => Some(&**e),
            Error::Http(e) => Some(e),
        }
    }
}

impl<C: Connect> H1Pool<C> {
    /// Connections to `target` (its scheme and authority), made by `connector`.
    pub fn new(connector: C, target: Uri, idle_timeout: Duration, max_idle: usize) -> Self {
        H1Pool {
            shared: Arc::new(Shared {
                connector,
                target,
                idle: Mutex::new(Vec::new()),
                returned: tokio::sync::Notify::new(),
                idle_timeout,
                max_idle,
                reaping: std::sync::atomic::AtomicBool::new(false),
            }),
        }
    }

    /// Where the connections go.
    pub fn target(&self) -> &Uri {
        &self.shared.target
    }

    /// Idle connections now.
    pub fn idle(&self) -> usize {
        self.shared.idle.lock().map(|i| i.len()).unwrap_or(0)
    }

    /// Sends `req` (origin-form URI and `Host` header already set: hyper writes the request as
    /// it is) on an idle connection, or a new one when none is left.
    pub async fn send(&self, req: Request<Full<Bytes>>) -> Result<Response<PooledBody<C>>, Error> {
        let mut req = match self.on_idle(req).await {
            Ok(sent) => return sent,
            Err(unsent) => unsent,
        };
        // None idle: a new connection — but one given back while it is being made is taken
        // instead, and the new one joins the pool when it is ready (as hyper-util's client
        // races them), so a burst does not wait a connect longer than it must.
        let (give, mut made) = tokio::sync::oneshot::channel();
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let conn = shared.connect().await;
            if let Err(Ok(tx)) = give.send(conn) {
                shared.put(tx);
            }
        });
        loop {
            tokio::select! {
                biased;
                conn = &mut made => {
                    let mut tx = conn.unwrap_or_else(|_| {
                        Err(Error::Connect("the connecting task ended".into()))
                    })?;
                    return match tx.send_request(req).await {
                        Ok(resp) => Ok(self.pooled(resp, tx)),
                        Err(e) => Err(Error::Http(e)),
                    };
                }
                () = self.shared.returned.notified() => {
                    req = match self.on_idle(req).await {
                        Ok(sent) => return sent,
                        Err(unsent) => unsent,
                    };
                }
            }
        }
    }

    /// `req` on an idle connection: the outcome once it was written (or failed as it was
    /// written), or `req` back when no idle connection could take it (each one tried closed).
    async fn on_idle(
        &self,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Result<Response<PooledBody<C>>, Error>, Request<Full<Bytes>>> {
        while let Some(mut tx) = self.take() {
            // Ready at once unless the connection's task has not yet seen the last response's
            // end; an error means it closed meanwhile.
            if tx.ready().await.is_err() {
                continue;
            }
            match tx.try_send_request(req).await {
                Ok(resp) => return Ok(Ok(self.pooled(resp, tx))),
                Err(mut e) => match e.take_message() {
                    Some(unsent) => req = unsent,
                    None => return Ok(Err(Error::Http(e.into_error()))),
                },
            }
        }
        Err(req)
    }

    /// An idle connection still open, after dropping those idle too long or closed.
    fn take(&self) -> Option<Sender> {
        let mut idle = self.shared.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.expire(&mut idle, Instant::now());
        loop {
            let top = idle.pop()?;
            if top.tx.is_closed() {
                continue;
            }
            if top.tx.is_ready() {
                return Some(top.tx);
            }
            // Its task has not yet seen the last response end: one further down that can take
            // a request now, if any; else this one (the caller awaits it rather than connecting).
            if let Some(at) = idle
                .iter()
                .rposition(|i| i.tx.is_ready() && !i.tx.is_closed())
            {
                let ready = idle.remove(at);
                idle.push(top);
                return Some(ready.tx);
            }
            return Some(top.tx);
        }
    }

    fn pooled(&self, resp: Response<Incoming>, tx: Sender) -> Response<PooledBody<C>> {
        let shared = self.shared.clone();
        resp.map(|body| PooledBody {
            body,
            back: Some((tx, shared)),
        })
    }
}

impl<C: Connect> Shared<C> {
    /// A new connection, ready for a request.
    async fn connect(&self) -> Result<Sender, Error> {
        let io = self
            .connector
            .connect(self.target.clone())
            .await
            .map_err(Error::Connect)?;
        let (mut tx, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(Error::Http)?;
        tokio::spawn(async move {
            // Ends when the connection closes; its error (a reset, say) was the request's.
            let _ = conn.await;
        });
        tx.ready().await.map_err(Error::Http)?;
        Ok(tx)
    }
}

impl<C> Shared<C> {
    /// Drops the connections idle for `idle_timeout` or longer (the oldest are at the bottom).
    fn expire(&self, idle: &mut Vec<Idle>, now: Instant) {
        let expired = idle
            .iter()
            .take_while(|i| now.saturating_duration_since(i.since) >= self.idle_timeout)
            .count();
        idle.drain(..expired);
    }
}

impl<C: Send + Sync + 'static> Shared<C> {
    fn put(self: &Arc<Self>, tx: Sender) {
        use std::sync::atomic::Ordering;
        if tx.is_closed() || self.max_idle == 0 {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        self.expire(&mut idle, now);
        idle.push(Idle { tx, since: now });
        if idle.len() > self.max_idle {
            idle.remove(0);
        }
        if !self.reaping.load(Ordering::Relaxed)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            self.reaping.store(true, Ordering::Relaxed);
            rt.spawn(reap(Arc::downgrade(self)));
        }
        drop(idle);
        self.returned.notify_one();
    }
}

/// Drops a pool's connections as they pass `idle_timeout`, while it has any: a pool touched
/// only now and then (or no more, after a burst) would otherwise keep every connection the
/// burst opened, and each holds its connection task's buffers (about 18 KB) — after 10,000
/// clients came and went, the gateway's memory stayed a third above idle. Ends when the pool
/// is empty or gone; the next connection given back starts it again.
async fn reap<C>(pool: std::sync::Weak<Shared<C>>) {
    use std::sync::atomic::Ordering;
    loop {
        let Some(shared) = pool.upgrade() else {
            return;
        };
        let next = {
            let mut idle = shared.idle.lock().unwrap_or_else(|e| e.into_inner());
            shared.expire(&mut idle, Instant::now());
            match idle.first() {
                Some(oldest) => oldest.since + shared.idle_timeout,
                None => {
                    // With `idle` locked: a connection given back after this starts another.
                    shared.reaping.store(false, Ordering::Relaxed);
                    return;
                }
            }
        };
        drop(shared);
        tokio::time::sleep_until(next.into()).await;
    }
}

/// A response body whose connection goes back to the pool when it has been read to the end.
pub struct PooledBody<C> {
    body: Incoming,
    back: Option<(Sender, Arc<Shared<C>>)>,
}

impl<C> fmt::Debug for PooledBody<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledBody")
            .field("reusable", &self.back.is_some())
            .finish()
    }
}

impl<C: Send + Sync + 'static> Body for PooledBody<C> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some((tx, shared)) = self.back.take() {
                    shared.put(tx);
                }
            }
            // A broken body: the connection is not reused.
            Poll::Ready(Some(Err(_))) => self.back = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Plain TCP to the pool's target, as the gateway's connector is for `http`; with a `gate`,
    /// every connect after the first waits for it.
    #[derive(Clone, Default)]
    struct Tcp {
        made: Arc<AtomicUsize>,
        /// When set, every connect after the first waits for it to be notified as well.
        gate: Option<Arc<tokio::sync::Notify>>,
    }

    impl tower::Service<Uri> for Tcp {
        type Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>;
        type Error = BoxError;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, uri: Uri) -> Self::Future {
            let later = self.made.fetch_add(1, Ordering::SeqCst) > 0;
            let gate = self.gate.clone().filter(|_| later);
            Box::pin(async move {
                if let Some(g) = gate {
                    g.notified().await;
                }
                let addr = uri.authority().map(|a| a.to_string()).unwrap_or_default();
                Ok(hyper_util::rt::TokioIo::new(
                    tokio::net::TcpStream::connect(addr).await?,
                ))
            })
        }
    }

    /// A server on 127.0.0.1 that counts the connections it accepted. Each connection answers
    /// `per_connection` requests (`Content-Length` bodies of `body`), then closes: after its last
    /// answer, or `close_early` — silently, with the next request unanswered.
    async fn server(
        per_connection: usize,
        close_early: bool,
        body: &'static str,
    ) -> (Uri, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut answered = 0;
                    loop {
                        let mut chunk = [0u8; 4096];
                        let n = match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        buf.extend_from_slice(&chunk[..n]);
                        // Requests here have no body: each ends at its blank line.
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            buf.drain(..end + 4);
                            if close_early && answered == per_connection {
                                return;
                            }
                            let last = answered + 1 == per_connection && !close_early;
                            let head = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n{}\r\n",
                                body.len(),
                                if last { "connection: close\r\n" } else { "" }
                            );
                            s.write_all(head.as_bytes()).await.unwrap();
                            s.write_all(body.as_bytes()).await.unwrap();
                            answered += 1;
                            if last {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (format!("http://{addr}").parse().unwrap(), accepted)
    }

    fn get(target: &Uri) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(Bytes::new()));
        *req.uri_mut() = "/x".parse().unwrap();
        req.headers_mut().insert(
            http::header::HOST,
            target.authority().unwrap().as_str().parse().unwrap(),
        );
        req
    }

    async fn read(resp: Response<PooledBody<Tcp>>) -> String {
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_connection_is_reused_once_its_body_is_read() {
        let (target, accepted) = server(1000, false, "hello").await;
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_secs(60), 8);
        for _ in 0..5 {
            let resp = pool.send(get(&target)).await.unwrap();
            assert_eq!(resp.status(), 200);
            assert_eq!(read(resp).await, "hello");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection for five requests"
        );
        assert_eq!(pool.idle(), 1);
        // A body dropped unread takes its connection with it.
        let resp = pool.send(get(&target)).await.unwrap();
        drop(resp);
        assert_eq!(pool.idle(), 0);
        assert_eq!(read(pool.send(get(&target)).await.unwrap()).await, "hello");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn requests_in_flight_at_once_each_get_a_connection_and_all_come_back() {
        let (target, accepted) = server(1000, false, "ok").await;
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_secs(60), 3);
        let resps = futures_util::future::join_all((0..6).map(|_| pool.send(get(&target)))).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 6);
        for r in resps {
            assert_eq!(read(r.unwrap()).await, "ok");
        }
        // No more idle than `max_idle`.
        assert_eq!(pool.idle(), 3);
    }

    #[tokio::test]
    async fn connection_close_and_idle_timeout_are_honoured() {
        // Every connection answers two requests, the second with `connection: close`.
        let (target, accepted) = server(2, false, "ok").await;
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_secs(60), 8);
        for _ in 0..4 {
            assert_eq!(read(pool.send(get(&target)).await.unwrap()).await, "ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        // Idle past the timeout: a new connection.
        let (target, accepted) = server(1000, false, "ok").await;
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_millis(50), 8);
        assert_eq!(read(pool.send(get(&target)).await.unwrap()).await, "ok");
        tokio::time::sleep(Duration::from_millis(80)).await;
        assert_eq!(read(pool.send(get(&target)).await.unwrap()).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// A pool nobody touches after a burst still lets its connections go at `idle_timeout`
    /// (their connection tasks and buffers with them), and reaps again after the next.
    #[tokio::test]
    async fn idle_connections_are_dropped_at_the_timeout_without_a_request() {
        let (target, accepted) = server(1000, false, "ok").await;
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_millis(50), 8);
        let burst = |n: usize| {
            let (pool, target) = (pool.clone(), target.clone());
            async move {
                let sends = (0..n).map(|_| pool.send(get(&target)));
                for r in futures_util::future::join_all(sends).await {
                    assert_eq!(read(r.unwrap()).await, "ok");
                }
            }
        };
        burst(3).await;
        let opened = accepted.load(Ordering::SeqCst);
        assert!(opened >= 2, "the burst opened {opened} connections");
        assert_eq!(pool.idle(), opened, "all back in the pool");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(pool.idle(), 0, "reaped without a request");
        burst(2).await;
        assert!(pool.idle() >= 1);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(pool.idle(), 0, "reaped again after the next burst");
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_unanswered_is_reported_as_such() {
        // The server reads the second request on a connection and closes it without a word.
        let (target, accepted) = server(1, true, "ok").await;
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_secs(60), 8);
        assert_eq!(read(pool.send(get(&target)).await.unwrap()).await, "ok");
        assert_eq!(pool.idle(), 1);
        let e = pool.send(get(&target)).await.unwrap_err();
        assert!(e.closed_unanswered(), "{e:?}");
        assert!(!e.is_connect());
        // Sent again, it goes on a new connection.
        assert_eq!(read(pool.send(get(&target)).await.unwrap()).await, "ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// A request that finds no idle connection takes one given back while its own connect is
    /// still under way, and the connection being made joins the pool afterwards.
    #[tokio::test]
    async fn a_connection_given_back_during_a_connect_is_taken_and_the_new_one_pooled() {
        let (target, accepted) = server(1000, false, "ok").await;
        let made = Arc::new(AtomicUsize::new(0));
        // The second connect does not finish until the test lets it: no clock decides.
        let gate = Arc::new(tokio::sync::Notify::new());
        let connector = Tcp {
            made: made.clone(),
            gate: Some(gate.clone()),
        };
        let pool = H1Pool::new(connector, target.clone(), Duration::from_secs(60), 8);
        // The first connection carries a response whose body is not read yet.
        let held = pool.send(get(&target)).await.unwrap();
        let waiting = {
            let pool = pool.clone();
            let target = target.clone();
            tokio::spawn(async move {
                let resp = pool.send(get(&target)).await.unwrap();
                resp.into_body().collect().await.unwrap().to_bytes()
            })
        };
        while made.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        // Reading the first body to its end gives its connection back.
        let body = held.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "ok");
        // Served on the connection given back, while its own connect is still held.
        let body = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .expect("served without the held connect")
            .unwrap();
        assert_eq!(body, "ok");
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the second connect is still held"
        );
        // The held connection, once made, is pooled beside the first.
        gate.notify_one();
        let deadline = Instant::now() + Duration::from_secs(30);
        while pool.idle() < 2 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(pool.idle(), 2);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let target: Uri = format!("http://{}", dead.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(dead);
        let pool = H1Pool::new(Tcp::default(), target.clone(), Duration::from_secs(60), 8);
        let e = pool.send(get(&target)).await.unwrap_err();
        assert!(e.is_connect(), "{e:?}");
        assert!(!e.closed_unanswered());
    }
}
