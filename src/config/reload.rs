//! Live reload: a notify watcher on the config file's directory (editors save by renaming a new
//! file over the old one, which a watch on the file itself would lose) and SIGHUP. Events are
//! debounced, the file is parsed and validated, and only a valid table is swapped in; an invalid
//! one is logged with the bad key's path and the old table stays live.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::state::AppState;

/// Editors write a file in several steps (truncate, write, rename); 50 ms gathers them into one
/// reload while keeping the write-to-new-order time well under the 200 ms goal.
const DEBOUNCE: Duration = Duration::from_millis(50);

/// Reloads from `path` now. Returns whether a new table was installed.
pub fn reload_now(state: &AppState, path: &Path) -> bool {
    // One install at a time (file, SIGHUP, discovery), each from the newest inputs.
    let _serial = state.install_lock.lock().unwrap_or_else(|e| e.into_inner());
    let discovered = state
        .discovered
        .lock()
        .map(|d| d.clone())
        .unwrap_or_default();
    match Config::load_file_with(path, &discovered) {
        Ok(cfg) => {
            for w in &cfg.warnings {
                tracing::warn!(warning = %w, "config warning");
            }
            state.install(cfg);
            tracing::info!(path = %path.display(), "config reloaded");
            true
        }
        Err(e) => {
            tracing::error!(error = %e, "config reload rejected; the previous routing table stays live");
            state.reload_failed(e.0);
            false
        }
    }
}

pub async fn watch(
    state: Arc<AppState>,
    path: PathBuf,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    let path = std::path::absolute(&path)?;
    let dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    let file_name = path.file_name().map(|f| f.to_os_string());
    let (tx, mut rx) = mpsc::channel::<()>(16);
    let tx_watch = tx.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if let Ok(ev) = res {
            let relevant = ev
                .paths
                .iter()
                .any(|p| p.file_name() == file_name.as_deref());
            if relevant && !ev.kind.is_access() {
                let _ = tx_watch.try_send(());
            }
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;

    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    // A change between the initial load and the watch being in place would be missed:
    // compare with what is live now, once the watch exists.
    let mut last = Some(state.config.load().source.clone().into_bytes());
    let now = std::fs::read(&path).ok();
    if now.is_some() && now != last {
        reload_now(&state, &path);
    }
    last = now.or(last);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading config");
                reload_now(&state, &path);
                last = std::fs::read(&path).ok();
            }
            Some(()) = rx.recv() => {
                // Debounce: wait for the burst of events to end.
                while let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, rx.recv()).await {}
                let now = std::fs::read(&path).ok();
                if now.is_none() {
                    // Mid-rename or deleted: keep the live table; the next event retries.
                    continue;
                }
                if now != last {
                    reload_now(&state, &path);
                    last = now;
                }
            }
        }
    }
    drop(watcher);
    drop(tx);
    Ok(())
}
