//! Starting and stopping a gateway: opens the store, builds state, starts the named background
//! tasks (config watcher, stats persister), serves until told to stop, then drains in order —
//! in-flight requests, background tasks, and finally the audit queue.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::state::AppState;
use crate::store::{Record, Store};

/// How often endpoint stats are written to SQLite: often enough that a crash loses little,
/// rarely enough to cost nothing.
const STATS_PERSIST_EVERY: Duration = Duration::from_secs(10);

/// After the grace, how long requests that were cut get to write their audit rows.
const INFLIGHT_DRAIN: Duration = Duration::from_secs(3);

/// How long a failing `accept` (out of file descriptors, say) pauses the accept loop, so the
/// error does not spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The accept loop's warning is written at most this often, with how many failures it did not
/// log: while the process is out of descriptors `accept` fails every [`ACCEPT_BACKOFF`], and a
/// line each time (20 a second, 72,000 an hour) would fill the disk the log shares.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// A warning that repeats, let through at most once per `every`; the ones held back are counted
/// and reported with the next one let through.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    last: Option<tokio::time::Instant>,
    held: u64,
}

impl Throttle {
    pub fn new(every: Duration) -> Throttle {
        Throttle {
            every,
            last: None,
            held: 0,
        }
    }

    /// `Some(n)` when this occurrence is to be logged (`n` held back since the last one logged),
    /// `None` when it is held back.
    pub fn pass(&mut self, now: tokio::time::Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.duration_since(t) < self.every => {
                self.held += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

/// How often audit rows past `server.audit_retention` are deleted (also once at start).
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// Below this many open files the gateway warns at start: each request in flight holds two (the
/// client's connection and the upstream's), besides the pools' idle connections, the database
/// and the watchers.
pub const FEW_OPEN_FILES: u64 = 4096;

/// The soft limit on open files to ask for, given the current soft and hard limits (`None`:
/// unlimited), or `None` to leave it. Linux starts most services at a soft limit of 1,024 with a
/// hard one far above it (systemd: 524,288); the soft limit exists for programs that pass
/// descriptors to `select(2)`, which the gateway never does. As Go's runtime and nginx's
/// `worker_rlimit_nofile` do, the gateway raises it to the hard limit: at 1,024, some 500
/// requests in flight exhaust it, and an upstream connect then fails with `EMFILE` — the gateway
/// starved of descriptors, every endpoint looking down.
pub fn open_files_wanted(current: Option<u64>, maximum: Option<u64>) -> Option<u64> {
    match (current, maximum) {
        (Some(cur), Some(max)) if cur < max => Some(max),
        _ => None,
    }
}

/// What [`raise_open_files_limit`] did: the soft limit before and after (`None`: unlimited),
/// and the error when raising failed.
#[derive(Debug)]
pub struct OpenFiles {
    pub before: Option<u64>,
    pub now: Option<u64>,
    pub error: Option<String>,
}

/// Raises this process's soft limit on open files to its hard limit (see [`open_files_wanted`]).
pub fn raise_open_files_limit() -> OpenFiles {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let limit = getrlimit(Resource::Nofile);
        let before = limit.current;
        let Some(wanted) = open_files_wanted(limit.current, limit.maximum) else {
            return OpenFiles {
                before,
                now: before,
                error: None,
            };
        };
        let mut raised = limit;
        raised.current = Some(wanted);
        match setrlimit(Resource::Nofile, raised) {
            Ok(()) => OpenFiles {
                before,
                now: getrlimit(Resource::Nofile).current,
                error: None,
            },
            Err(e) => OpenFiles {
                before,
                now: before,
                error: Some(e.to_string()),
            },
        }
    }
    #[cfg(not(target_os = "linux"))]
    OpenFiles {
        before: None,
        now: None,
        error: None,
    }
}

/// The accept queue asked of the kernel (which caps it at `net.core.somaxconn`, 4096 on current
/// kernels). `TcpListener::bind` asks for the standard library's 128: a burst of more new
/// connections than that while the process is not accepting — its host pausing it, a
/// CPU-throttled container, a stall of the machine — has the kernel drop the SYNs past 128, and
/// each of those clients waits for its SYN to be sent again, a whole second, before the gateway
/// even sees it (README, Benchmark, session 14: 200 ms paused under 2,000 new requests a second
/// gave a p99 of 1.04 s).
pub const ACCEPT_BACKLOG: u32 = 4096;

/// Listens on `addr` (`host:port`, a name resolved) as `TcpListener::bind` does — the first
/// address that binds, `SO_REUSEADDR` set — but with an accept queue of [`ACCEPT_BACKLOG`].
pub async fn bind(addr: &str) -> std::io::Result<TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        match socket
            .set_reuseaddr(true)
            .and_then(|()| socket.bind(a))
            .and_then(|()| socket.listen(ACCEPT_BACKLOG))
        {
            Ok(listener) => return Ok(listener),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{addr} resolves to no address"),
        )
    }))
}

pub struct GatewayOptions {
    pub config: Config,
    pub config_path: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub listener: TcpListener,
    /// Watch `config_path` for changes (and SIGHUP).
    pub watch: bool,
}

/// A running gateway. Dropping it does not stop it; call [`Gateway::shutdown`].
pub struct Gateway {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    cancel: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    tasks: JoinSet<()>,
    store: Option<Store>,
}

impl Gateway {
    pub async fn start(opts: GatewayOptions) -> anyhow::Result<Gateway> {
        // `audit.store: postgres` takes effect at start (as `cluster:` does).
        let opened = match &opts.config.audit_pg {
            Some(pg) => crate::store::pg::open(pg, opts.config.audit_queue, Some(&opts.data_dir)),
            None => Store::open_or_off(&opts.data_dir, opts.config.audit_queue),
        };
        for w in &opts.config.warnings {
            tracing::warn!(warning = %w, "config warning");
        }
        let grace = opts.config.shutdown_grace;
        let header_timeout = opts.config.header_timeout;
        let send_timeout = opts.config.send_timeout;
        let state = AppState::new(
            opts.config,
            opened.store.handle(),
            opts.config_path.clone(),
            &opened.persisted,
            opened.spend,
        );
        let _ = state.trail.set(match &state.config.load().audit_pg {
            Some(pg) => crate::store::bodies::Trail::Postgres(pg.clone()),
            None => crate::store::bodies::Trail::Sqlite(crate::store::db_path(&opts.data_dir)),
        });
        if let Ok(mut up) = state.standbys_up.lock() {
            up.extend(opened.standbys_up);
        }
        // Ready once the first discovery scan and probe round are done, within what those may
        // take at most: a watcher that hangs cannot keep the gateway out of service.
        {
            let cfg = state.config.load();
            let docker = cfg.docker.enabled;
            let bound = cfg.health.probe_timeout
                + if docker {
                    cfg.docker.timeout
                } else {
                    Duration::ZERO
                };
            state.startup.begin(bound, docker);
        }
        let addr = opts.listener.local_addr()?;
        state
            .listen_loopback
            .store(addr.ip().is_loopback(), Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();

        if opts.watch
            && let Some(path) = opts.config_path.clone()
        {
            let st = state.clone();
            let c = cancel.clone();
            // Registered now, before the gateway says it listens: the default action of SIGHUP
            // is to end the process.
            let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
            tasks.spawn(async move {
                if let Err(e) = crate::ops::reload::watch(st, path, c, hup).await {
                    tracing::error!(error = %e, "config watcher stopped");
                }
            });
        }
        tasks.spawn(crate::discovery::probe::run(state.clone(), cancel.clone()));
        if let Some(rx) = state
            .alerts_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            tasks.spawn(crate::ops::alerts::run(state.clone(), rx, cancel.clone()));
        }
        tasks.spawn(crate::ops::telemetry::upkeep(cancel.clone()));
        {
            let st = state.clone();
            tasks.spawn(crate::ops::otel::run(
                state.traces.clone(),
                move || st.config.load().otlp.clone(),
                cancel.clone(),
            ));
        }
        let cluster_settings = state.config.load().cluster.clone();
        if let Some(settings) = cluster_settings {
            let cluster = Arc::new(crate::cluster::Cluster::new(
                settings,
                state.alerts.clone(),
                Some(&opts.data_dir),
            )?);
            let _ = state.cluster.set(cluster.clone());
            let (tx, facts) = tokio::sync::mpsc::channel(crate::cluster::FACT_QUEUE);
            state.registry.share_with(tx);
            let (a, b, c, d) = (state.clone(), state.clone(), state.clone(), state.clone());
            let hooks = crate::cluster::Hooks {
                spend: Box::new(move || a.clients.spend_snapshot()),
                endpoints: Box::new(move || b.config.load().endpoints.keys().cloned().collect()),
                apply: Box::new(move |fact| {
                    let cfg = c.config.load();
                    if let Some(ep) = cfg.endpoints.get(fact.endpoint()) {
                        c.registry.apply_fact(ep, fact);
                    }
                }),
                known: Box::new(move || {
                    let cfg = d.config.load();
                    d.registry
                        .known_facts(cfg.endpoints.values().map(|e| e.as_ref()))
                }),
                facts,
            };
            tasks.spawn(crate::cluster::run(cluster, hooks, cancel.clone()));
        }
        tasks.spawn(crate::ops::reload::vault_refresher(
            state.clone(),
            cancel.clone(),
        ));
        tasks.spawn(crate::discovery::run(
            state.clone(),
            state.docker.clone(),
            cancel.clone(),
        ));
        {
            let st = state.clone();
            let c = cancel.clone();
            tasks.spawn(async move {
                let mut tick = tokio::time::interval(STATS_PERSIST_EVERY);
                tick.tick().await;
                let mut prune = tokio::time::interval(PRUNE_EVERY);
                loop {
                    tokio::select! {
                        _ = c.cancelled() => break,
                        _ = tick.tick() => {
                            st.store.send(Record::Stats(st.registry.snapshot()));
                            st.store.send(Record::Spend(st.clients.spend_snapshot()));
                        }
                        _ = prune.tick() => {
                            if let Some(keep) = st.config.load().audit_retention
                                && let Some(before) = std::time::SystemTime::now().checked_sub(keep)
                            {
                                st.store.send(Record::Prune(before));
                            }
                        }
                    }
                }
            });
        }

        let app = crate::front::http::router(state.clone())
            .merge(crate::front::replay::routes(state.clone()));
        let server = tokio::spawn(serve(
            opts.listener,
            app,
            state.clone(),
            cancel.clone(),
            grace,
            header_timeout,
            send_timeout,
        ));
        tracing::info!(%addr, "autohedge listening");
        Ok(Gateway {
            addr,
            state,
            cancel,
            server,
            tasks,
            store: Some(opened.store),
        })
    }

    /// A token that stops the gateway when cancelled.
    pub fn cancel_token(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// Stops accepting, lets in-flight requests finish, stops background tasks, persists stats
    /// and drains the audit queue.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        let _ = (&mut self.server).await;
        // Requests cut at the grace write their rows as they unwind; wait for the last of them
        // (bounded) before the final flush, so none is lost at exit.
        let t0 = tokio::time::Instant::now();
        while self.state.inflight() > 0 && t0.elapsed() < INFLIGHT_DRAIN {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        while self.tasks.join_next().await.is_some() {}
        // The last snapshots wait for room in the queue (on the blocking pool): a full queue at
        // shutdown must not lose the month's spend or the endpoints' state.
        let last = [
            Record::Stats(self.state.registry.snapshot()),
            Record::Spend(self.state.clients.spend_snapshot()),
        ];
        let handle = self.state.store.clone();
        let store = self.store.take();
        tokio::task::spawn_blocking(move || {
            for r in last {
                handle.send_waiting(r);
            }
            if let Some(store) = store {
                store.close();
            }
        })
        .await
        .ok();
        tracing::info!("autohedge stopped; audit queue drained");
    }

    /// Waits until the gateway is cancelled (by a signal handler or a caller), then shuts down.
    pub async fn run_until_cancelled(self) {
        self.cancel.cancelled().await;
        self.shutdown().await;
    }
}

/// The accept loop: hyper with a header read timeout (slow clients cannot hold a connection
/// without sending a request), TCP_NODELAY, the peer address for `ConnectInfo`, and a graceful
/// drain on `cancel`. When `grace` is over, `AppState::hard_stop` cuts what is still running;
/// each cut request records itself (class `shutdown`) before its connection closes.
///
/// Each connection's protocol is told from its first bytes, peeked (see [`sniff`]): HTTP/1
/// goes to hyper's HTTP/1 server, the HTTP/2 preface (h2c, prior knowledge) to hyper's HTTP/2
/// server. hyper-util's auto builder, used before, read every connection's first 24 bytes
/// itself and handed them back through a `Rewind`, which made hyper grow each connection's read
/// buffer from 8 to 16 KiB (README, Benchmark, session 15) — and it waited for those bytes
/// without any deadline, so a client that connected and sent nothing held its connection for
/// ever. The sniff runs under `header_timeout`.
async fn serve(
    listener: TcpListener,
    app: axum::Router,
    state: Arc<AppState>,
    cancel: CancellationToken,
    grace: Duration,
    header_timeout: Duration,
    send_timeout: Duration,
) {
    // Each connection gets its own timer for the header-read timeout (`front::timer`).
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.header_read_timeout(header_timeout);
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    // A peer that stops answering PINGs (its host gone, a middlebox that dropped the flow) is
    // let go: without this an HTTP/2 connection has no deadline at all once the preface is in.
    http2
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(header_timeout))
        .keep_alive_timeout(header_timeout);
    let builders = Arc::new((http1, http2));
    let graceful = GracefulShutdown::new();
    let mut accept_warning = Throttle::new(ACCEPT_WARN_EVERY);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = cancel.cancelled() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    if let Some(held) = accept_warning.pass(tokio::time::Instant::now()) {
                        tracing::warn!(error = %e, failures_not_logged = held, "accept failed (logged at most once per {}s)", ACCEPT_WARN_EVERY.as_secs());
                    }
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm holds each
        // chunk until the client's delayed ACK (~40 ms) arrives.
        let _ = tcp.set_nodelay(true);
        let (router, state_) = (app.clone(), state.clone());
        let draining = state.draining.clone();
        let hard_stop = state.hard_stop.clone();
        // Taken here, before the connection's task runs: a shutdown signalled from now on
        // reaches this connection too.
        let watcher = graceful.watcher();
        let (builders, cancel) = (builders.clone(), cancel.clone());
        tokio::spawn(async move {
            let proto = tokio::select! {
                _ = cancel.cancelled() => return,
                r = tokio::time::timeout(header_timeout, sniff(&tcp)) => match r {
                    Ok(Ok(Some(proto))) => proto,
                    // Closed or reset before a byte: nothing to answer.
                    Ok(Ok(None) | Err(_)) => return,
                    Err(_) => {
                        tracing::debug!(%peer, "no request within server.header_timeout; connection closed");
                        return;
                    }
                },
            };
            // Client resets and header timeouts end up here; they are the client's business.
            let io =
                crate::front::send_deadline::SendDeadline::new(TokioIo::new(tcp), send_timeout);
            let ended = match proto {
                Proto::Http1 => {
                    let handler: crate::front::idle::Handler = std::sync::Arc::new(
                        move |req: axum::http::Request<hyper::body::Incoming>| -> crate::front::idle::ResponseFuture {
                            let (router, state_) = (router.clone(), state_.clone());
                            Box::pin(async move {
                                let mut resp =
                                    crate::front::http::dispatch(&state_, &router, req, peer).await;
                                // Draining: the client's next request opens a new connection,
                                // which the load balancer sends elsewhere.
                                if state_.draining.is_cancelled() {
                                    resp.headers_mut().insert(
                                        axum::http::header::CONNECTION,
                                        axum::http::HeaderValue::from_static("close"),
                                    );
                                }
                                Ok::<_, std::convert::Infallible>(resp)
                            })
                        },
                    );
                    // The graceful drain and the hard stop, each waited for once a
                    // connection (`front::stop`); the connection parked while idle
                    // (`front::idle`). `cancel` is set just before the drain begins; the
                    // watcher is held until the connection ends so the drain waits for it.
                    let _drain_waits = watcher;
                    crate::front::idle::serve_http1(&builders.0, io, handler, &hard_stop, &cancel)
                        .await
                }
                // Boxed: an HTTP/1 connection's task (most of them, and every idle one) does
                // not carry the HTTP/2 connection's state in its own.
                Proto::Http2 => Box::pin(async move {
                    let (open, idle) = Streams::new();
                    let watched = open.clone();
                    let svc = hyper::service::service_fn(
                        move |req: axum::http::Request<hyper::body::Incoming>| {
                            let (router, state_) = (router.clone(), state_.clone());
                            // Counted from the request's arrival until its response's last byte
                            // is sent (or the stream is reset): the guard rides in the body.
                            let stream = open.opened();
                            async move {
                                let resp =
                                    crate::front::http::dispatch(&state_, &router, req, peer).await;
                                Ok::<_, std::convert::Infallible>(
                                    resp.map(|body| {
                                        axum::body::Body::new(Tracked::new(body, stream))
                                    }),
                                )
                            }
                        },
                    );
                    // hyper-util's watcher cannot be told of a second reason to close, so the
                    // shutdown signal is `cancel` here (set just before the graceful drain
                    // begins), and the watcher is held until the connection ends so the drain
                    // waits for it all the same.
                    let _drain_waits = watcher;
                    let conn = builders.1.serve_connection(io, svc);
                    tokio::pin!(conn);
                    let idle = idle.elapsed(header_timeout);
                    tokio::pin!(idle);
                    let mut look =
                        tokio::time::interval((send_timeout / 4).max(Duration::from_millis(1)));
                    look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    let mut closing = false;
                    loop {
                        tokio::select! {
                            r = conn.as_mut() => break r,
                            _ = look.tick() => {
                                if watched.stalled(send_timeout) {
                                    // A stream the client gives no room (no WINDOW_UPDATE) for
                                    // `send_timeout`: as `SendDeadline` for a socket that takes
                                    // nothing. Dropping the connection resets its streams.
                                    tracing::debug!(%peer, "HTTP/2 client took nothing of a response for server.send_timeout; connection closed");
                                    return Ok(());
                                }
                            }
                            _ = cancel.cancelled(), if !closing => {
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                            // GOAWAY: streams open finish, new ones go to a new connection.
                            _ = draining.cancelled(), if !closing => {
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                            _ = &mut idle, if !closing => {
                                tracing::debug!(%peer, "HTTP/2 connection idle for server.header_timeout; closing");
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                        }
                    }
                })
                .await,
            };
            if let Err(e) = ended {
                tracing::debug!(error = %crate::upstream::error_chain(&e), "connection ended with an error");
            }
        });
    }
    drop(listener);
    let drain = graceful.shutdown();
    tokio::pin!(drain);
    tokio::select! {
        _ = &mut drain => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!("in-flight requests did not finish within shutdown_grace; cutting them");
            state.hard_stop.cancel();
            if tokio::time::timeout(INFLIGHT_DRAIN, &mut drain).await.is_err() {
                tracing::warn!("connections still open after the cut; closing");
            }
        }
    }
}

/// The streams an HTTP/2 connection has open, for closing it once it has been idle for
/// `server.header_timeout` — as hyper's HTTP/1 server closes a keep-alive connection that sends
/// no next request within it. hyper's HTTP/2 server has no idle deadline of its own, so a client
/// that sent the preface and then nothing (or only answers PINGs) held its socket and task for
/// ever.
///
/// It also knows which streams wait for the client: a response body that handed hyper a frame
/// is not polled again until the client's flow-control window has room for it. A client that
/// never grants room (no `WINDOW_UPDATE`) — while answering PINGs — would hold the stream, and
/// the upstream's stream behind it, for ever; the socket's own [`SendDeadline`] never sees a
/// write wait, since nothing is written.
///
/// [`SendDeadline`]: crate::front::send_deadline::SendDeadline
#[derive(Clone)]
struct Streams(Arc<StreamsShared>);

struct StreamsShared {
    open: tokio::sync::watch::Sender<usize>,
    /// What the streams' waits are counted from.
    epoch: tokio::time::Instant,
    /// Each open stream's wait ([`OpenStream::waiting`]), registered once when it opens; a stream
    /// gone leaves a dead entry, pruned at the next look.
    waits: std::sync::Mutex<Vec<std::sync::Weak<AtomicU64>>>,
}

/// One open stream; dropping it (the response's body sent in full, or the stream reset) closes it.
struct OpenStream {
    streams: Streams,
    /// Since when (milliseconds past `epoch`, plus one) a frame this stream handed hyper has
    /// waited for the client; 0 while none waits. A store per frame: no lock on the stream's path.
    waiting: Arc<AtomicU64>,
}

/// Watches a connection's open streams.
struct Idle(tokio::sync::watch::Receiver<usize>);

impl Streams {
    fn new() -> (Streams, Idle) {
        let (tx, rx) = tokio::sync::watch::channel(0);
        let streams = Streams(Arc::new(StreamsShared {
            open: tx,
            epoch: tokio::time::Instant::now(),
            waits: Default::default(),
        }));
        (streams, Idle(rx))
    }

    fn opened(&self) -> OpenStream {
        self.0.open.send_modify(|n| *n += 1);
        let waiting = Arc::new(AtomicU64::new(0));
        self.0
            .waits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::downgrade(&waiting));
        OpenStream {
            streams: self.clone(),
            waiting,
        }
    }

    /// Milliseconds since `epoch`, plus one (0 means "not waiting").
    fn now(&self) -> u64 {
        self.0.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Whether a stream has had a frame waiting for the client for `limit` or more.
    fn stalled(&self, limit: Duration) -> bool {
        let (now, limit) = (self.now(), limit.as_millis() as u64);
        let mut waits = self.0.waits.lock().unwrap_or_else(|e| e.into_inner());
        waits.retain(|w| w.strong_count() > 0);
        waits.iter().filter_map(std::sync::Weak::upgrade).any(|w| {
            let since = w.load(Ordering::Relaxed);
            since != 0 && now.saturating_sub(since) >= limit
        })
    }
}

impl OpenStream {
    /// The body handed hyper a frame: from now the stream waits for the client to take it.
    fn handed(&self) {
        self.waiting.store(self.streams.now(), Ordering::Relaxed);
    }

    /// The body is polled again: what it handed has been taken.
    fn taken(&self) {
        self.waiting.store(0, Ordering::Relaxed);
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.streams
            .0
            .open
            .send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Idle {
    /// Completes once no stream has been open for `after` without a break; never while one is.
    async fn elapsed(mut self, after: Duration) {
        loop {
            if self.0.wait_for(|open| *open == 0).await.is_err() {
                // The connection's service is gone, so is the connection.
                return std::future::pending().await;
            }
            match tokio::time::timeout(after, self.0.changed()).await {
                Err(_) => return,
                Ok(_) => continue,
            }
        }
    }
}

/// A response body that holds its stream open until it is dropped, and says when it waits for
/// the client (see [`Streams`]).
struct Tracked {
    body: axum::body::Body,
    stream: OpenStream,
}

impl Tracked {
    /// The response goes to hyper now: until its body is first polled, it waits for the client
    /// too (a client that opened with no flow-control window at all).
    fn new(body: axum::body::Body, stream: OpenStream) -> Tracked {
        stream.handed();
        Tracked { body, stream }
    }
}

impl hyper::body::Body for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        this.stream.taken();
        let polled = std::pin::Pin::new(&mut this.body).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(_))) = &polled {
            this.stream.handed();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// HTTP/2's connection preface: what a client speaking HTTP/2 over plain TCP (prior knowledge)
/// sends first, and no HTTP/1 request can begin with.
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long the sniff waits before looking again while the first bytes are a part of the
/// preface — an HTTP/2 client whose preface came in pieces (never an HTTP/1 client: its first
/// byte already differs unless its method begins with `P`, and then its second does), or a
/// client holding a connection open with a byte or two. The socket stays readable with those
/// bytes in it, so readiness cannot say when more came: the sniff looks again after a pause
/// that doubles from 5 ms up to 200 ms, so thousands of such connections cost a few peeks a
/// second each, not one every 5 ms.
fn sniff_pause(looked: u32) -> Duration {
    Duration::from_millis(5u64.saturating_mul(1 << looked.min(6)).min(200))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proto {
    Http1,
    Http2,
}

/// The protocol the first bytes of a connection say, or `None` while they are a proper prefix of
/// the HTTP/2 preface (more must be read to tell).
fn proto_of(first: &[u8]) -> Option<Proto> {
    let n = first.len().min(H2_PREFACE.len());
    if first[..n] != H2_PREFACE[..n] {
        Some(Proto::Http1)
    } else if n == H2_PREFACE.len() {
        Some(Proto::Http2)
    } else {
        None
    }
}

/// Waits for a connection's first bytes and tells its protocol by peeking (`MSG_PEEK`): the
/// bytes stay in the socket, so hyper's first read takes them with the rest of the request into
/// its own buffer. `None` when the peer closed before sending a byte. The caller bounds it.
async fn sniff(tcp: &tokio::net::TcpStream) -> std::io::Result<Option<Proto>> {
    let mut buf = [0u8; H2_PREFACE.len()];
    let mut looked: u32 = 0;
    loop {
        let n = tcp.peek(&mut buf).await?;
        if n == 0 {
            return Ok(None);
        }
        match proto_of(&buf[..n]) {
            Some(proto) => return Ok(Some(proto)),
            None => {
                tokio::time::sleep(sniff_pause(looked)).await;
                looked = looked.saturating_add(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_open_files_limit_is_raised_to_the_hard_one_never_lowered() {
        assert_eq!(open_files_wanted(Some(1024), Some(524_288)), Some(524_288));
        assert_eq!(open_files_wanted(Some(256), Some(20_000)), Some(20_000));
        // Already at the hard limit, or no hard limit: left alone.
        assert_eq!(open_files_wanted(Some(20_000), Some(20_000)), None);
        assert_eq!(open_files_wanted(Some(1024), None), None);
        assert_eq!(open_files_wanted(None, None), None);
        // A soft limit above the hard one cannot be, but is never lowered.
        assert_eq!(open_files_wanted(Some(30_000), Some(20_000)), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_repeating_warning_passes_once_per_period_and_counts_what_it_held() {
        let every = Duration::from_secs(10);
        let mut t = Throttle::new(every);
        let t0 = tokio::time::Instant::now();
        assert_eq!(t.pass(t0), Some(0), "the first is logged");
        // Every 50 ms for just under the period: all held back.
        let mut at = t0;
        for _ in 0..199 {
            at += Duration::from_millis(50);
            assert_eq!(t.pass(at), None);
        }
        assert!(at < t0 + every);
        // The period is over: logged, with the 199 held back since.
        assert_eq!(t.pass(t0 + every), Some(199));
        assert_eq!(t.pass(t0 + every + Duration::from_secs(1)), None);
        // After a quiet spell the next one is logged at once, with what was held before it.
        assert_eq!(t.pass(t0 + every * 5), Some(1));
    }

    #[test]
    fn the_first_bytes_tell_the_protocol() {
        assert_eq!(
            proto_of(b"POST /v1/chat/completions HTTP/1.1\r\n"),
            Some(Proto::Http1)
        );
        assert_eq!(proto_of(b"G"), Some(Proto::Http1));
        // `P` could still be the preface; `PO` cannot.
        assert_eq!(proto_of(b"P"), None);
        assert_eq!(proto_of(b"PO"), Some(Proto::Http1));
        assert_eq!(proto_of(b"PRI * HTTP/2.0\r\n"), None);
        assert_eq!(proto_of(H2_PREFACE), Some(Proto::Http2));
        let mut more = H2_PREFACE.to_vec();
        more.extend_from_slice(b"\0\0\x12\x04");
        assert_eq!(proto_of(&more), Some(Proto::Http2));
        // A TLS ClientHello (https to a plain port) is HTTP/1 to hyper, which answers 400.
        assert_eq!(proto_of(&[0x16, 0x03, 0x01]), Some(Proto::Http1));
        assert_eq!(proto_of(b""), None);
    }

    proptest::proptest! {
        /// Any first bytes give an answer without a panic, and more bytes never change a
        /// decision: what the sniff saw first is what it would see with the rest.
        #[test]
        fn any_first_bytes_decide_once(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
            preface_first in proptest::bool::ANY,
        ) {
            let bytes = if preface_first {
                let mut b = H2_PREFACE[..bytes.len().min(H2_PREFACE.len())].to_vec();
                b.extend_from_slice(&bytes[b.len()..]);
                b
            } else {
                bytes
            };
            let mut decided = None;
            for n in 0..=bytes.len() {
                match (decided, proto_of(&bytes[..n])) {
                    (None, now) => decided = now,
                    (Some(before), now) => proptest::prop_assert_eq!(Some(before), now),
                }
            }
            let starts = bytes.len() >= H2_PREFACE.len() && bytes[..H2_PREFACE.len()] == H2_PREFACE[..];
            if starts {
                proptest::prop_assert_eq!(decided, Some(Proto::Http2));
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_http2_connection_is_idle_only_while_no_stream_is_open() {
        let after = Duration::from_secs(10);
        let t0 = tokio::time::Instant::now();
        // No stream ever opened: idle from the start.
        let (_streams, idle) = Streams::new();
        idle.elapsed(after).await;
        assert_eq!(t0.elapsed(), after);

        // A stream open for three times the window, then another opened and closed inside
        // the window that follows: idle only `after` past the last close.
        let (streams, idle) = Streams::new();
        let t0 = tokio::time::Instant::now();
        let first = streams.opened();
        let watch = tokio::spawn(idle.elapsed(after));
        tokio::time::sleep(after * 3).await;
        assert!(!watch.is_finished(), "a stream is open");
        drop(first);
        tokio::time::sleep(after / 2).await;
        let second = streams.opened();
        let third = streams.opened();
        drop(second);
        tokio::time::sleep(after * 2).await;
        assert!(!watch.is_finished(), "one stream of two is still open");
        drop(third);
        watch.await.unwrap();
        assert_eq!(t0.elapsed(), after * 3 + after / 2 + after * 2 + after);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_is_stalled_only_while_what_it_handed_waits_past_the_limit() {
        let limit = Duration::from_secs(5);
        let (streams, _idle) = Streams::new();
        let a = streams.opened();
        let b = streams.opened();
        assert!(!streams.stalled(limit), "nothing handed yet");
        a.handed();
        tokio::time::sleep(Duration::from_secs(4)).await;
        b.handed();
        assert!(!streams.stalled(limit));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(streams.stalled(limit), "a has waited 5 s");
        // Taken, then handed again: the wait starts over; b has waited 1 s.
        a.taken();
        a.handed();
        assert!(!streams.stalled(limit));
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(streams.stalled(limit), "b has waited 5 s");
        drop(b);
        assert!(!streams.stalled(limit), "a stream gone waits for nothing");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(streams.stalled(limit), "a again, 5 s");
        drop(a);
        assert!(!streams.stalled(limit));
    }

    #[test]
    fn a_partial_preface_is_looked_at_again_ever_more_rarely() {
        let pauses: Vec<u64> = (0..10).map(|i| sniff_pause(i).as_millis() as u64).collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 200, 200, 200, 200]);
        assert_eq!(sniff_pause(u32::MAX), Duration::from_millis(200));
        // Within the default header timeout (10 s) a connection holding a part of the preface
        // is peeked at about 55 times, not 2,000.
        let (mut t, mut looks) = (Duration::ZERO, 0);
        while t < Duration::from_secs(10) {
            t += sniff_pause(looks);
            looks += 1;
        }
        assert!(looks < 60, "{looks}");
    }

    #[test]
    fn every_prefix_of_the_preface_waits_and_every_other_byte_decides() {
        for n in 1..H2_PREFACE.len() {
            assert_eq!(proto_of(&H2_PREFACE[..n]), None, "{n} bytes");
            let mut wrong = H2_PREFACE[..n].to_vec();
            wrong[n - 1] ^= 0x20;
            assert_eq!(
                proto_of(&wrong),
                Some(Proto::Http1),
                "{n} bytes, last differs"
            );
        }
    }
}
