//! Starting and stopping a gateway: opens the store, builds state, starts the named background
//! tasks (config watcher, stats persister), serves until told to stop, then drains in order —
//! in-flight requests, background tasks, and finally the audit queue.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::state::AppState;
use crate::store::{Record, Store};

/// How often endpoint stats are written to SQLite: often enough that a crash loses little,
/// rarely enough to cost nothing.
const STATS_PERSIST_EVERY: Duration = Duration::from_secs(10);

/// How often audit rows past `server.audit_retention` are deleted (also once at start).
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

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
        let opened = Store::open(&opts.data_dir, opts.config.audit_queue)?;
        for w in &opts.config.warnings {
            tracing::warn!(warning = %w, "config warning");
        }
        let grace = opts.config.shutdown_grace;
        let state = AppState::new(
            opts.config,
            opened.store.handle(),
            opts.config_path.clone(),
            &opened.persisted,
        );
        let addr = opts.listener.local_addr()?;
        let cancel = CancellationToken::new();
        let mut tasks = JoinSet::new();

        if opts.watch
            && let Some(path) = opts.config_path.clone()
        {
            let st = state.clone();
            let c = cancel.clone();
            tasks.spawn(async move {
                if let Err(e) = crate::config::reload::watch(st, path, c).await {
                    tracing::error!(error = %e, "config watcher stopped");
                }
            });
        }
        tasks.spawn(crate::probe::run(state.clone(), cancel.clone()));
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
                        _ = tick.tick() => st.store.send(Record::Stats(st.registry.snapshot())),
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

        let app = crate::http::router(state.clone());
        let c = cancel.clone();
        let stop = cancel.clone();
        let server = tokio::spawn(async move {
            // Streams are many small writes: without TCP_NODELAY, Nagle's algorithm holds each
            // chunk until the client's delayed ACK (~40 ms) arrives.
            let listener = opts.listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let serve = axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async move { c.cancelled().await });
            let mut serve = std::pin::pin!(serve.into_future());
            tokio::select! {
                r = &mut serve => {
                    if let Err(e) = r {
                        tracing::error!(error = %e, "server error");
                    }
                }
                _ = stop.cancelled() => {
                    // Shutdown asked: bound the drain, so a client holding a stream open cannot
                    // block it forever. (The bound applies from the signal on, never before.)
                    match tokio::time::timeout(grace + Duration::from_secs(1), &mut serve).await {
                        Ok(Err(e)) => tracing::error!(error = %e, "server error"),
                        Ok(Ok(())) => {}
                        Err(_) => tracing::warn!("in-flight requests did not finish within shutdown_grace"),
                    }
                }
            }
        });
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
        while self.tasks.join_next().await.is_some() {}
        self.state
            .store
            .send(Record::Stats(self.state.registry.snapshot()));
        if let Some(store) = self.store.take() {
            tokio::task::spawn_blocking(move || store.close())
                .await
                .ok();
        }
        tracing::info!("autohedge stopped; audit queue drained");
    }

    /// Waits until the gateway is cancelled (by a signal handler or a caller), then shuts down.
    pub async fn run_until_cancelled(self) {
        self.cancel.cancelled().await;
        self.shutdown().await;
    }
}
