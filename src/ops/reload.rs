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

/// `reload_now` on the blocking pool: loading reads files, builds HTTP clients and TLS roots and
/// may build a token encoder (hundreds of milliseconds), none of which may hold an async worker
/// that requests are running on.
async fn reload_off_path(state: &Arc<AppState>, path: &Path) {
    let (st, p) = (state.clone(), path.to_path_buf());
    if let Err(e) = tokio::task::spawn_blocking(move || reload_now(&st, &p)).await {
        tracing::error!(error = %e, "config reload task failed; the previous routing table stays live");
    }
}

/// A stream of writes (a log-like tool rewriting the file) must not postpone a reload forever.
const DEBOUNCE_MAX: Duration = Duration::from_millis(500);

/// The directories to watch for `path`: its own, and — when it is a symlink (a config mounted
/// from elsewhere, Kubernetes' `..data` indirection) — the directory of what it points to now.
fn watch_dirs(path: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = path.parent() {
        dirs.push(d.to_path_buf());
    }
    if let Ok(real) = std::fs::canonicalize(path)
        && let Some(d) = real.parent()
        && !dirs.iter().any(|x| x == d)
    {
        dirs.push(d.to_path_buf());
    }
    if dirs.is_empty() {
        dirs.push(PathBuf::from("."));
    }
    dirs
}

/// The file names whose events matter: the config's own, and its symlink target's.
fn watch_names(path: &Path) -> Vec<std::ffi::OsString> {
    let mut names: Vec<std::ffi::OsString> = path
        .file_name()
        .map(|n| n.to_os_string())
        .into_iter()
        .collect();
    if let Ok(real) = std::fs::canonicalize(path)
        && let Some(n) = real.file_name()
        && !names.iter().any(|x| x == n)
    {
        names.push(n.to_os_string());
    }
    names
}

pub async fn watch(
    state: Arc<AppState>,
    path: PathBuf,
    cancel: CancellationToken,
    mut hup: tokio::signal::unix::Signal,
) -> anyhow::Result<()> {
    let path = std::path::absolute(&path)?;
    let (tx, mut rx) = mpsc::channel::<()>(16);
    let tx_watch = tx.clone();
    // Events that may change what the path reads: the file's own name, its symlink target's
    // name, and Kubernetes' `..data` / `..2026_…` entries (a ConfigMap update swaps the `..data`
    // symlink). Whether the config really changed is decided by comparing the content.
    let names = Arc::new(std::sync::Mutex::new(watch_names(&path)));
    let names_w = names.clone();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        let Ok(ev) = res else { return };
        if ev.kind.is_access() {
            return;
        }
        let names = names_w.lock().unwrap_or_else(|e| e.into_inner());
        let relevant = ev.paths.iter().any(|p| {
            p.file_name().is_some_and(|n| {
                names.iter().any(|x| x == n) || n.to_string_lossy().starts_with("..")
            })
        });
        if relevant {
            let _ = tx_watch.try_send(());
        }
    })?;
    let mut watched = watch_dirs(&path);
    for d in &watched {
        watcher.watch(d, RecursiveMode::NonRecursive)?;
    }

    // A change between the initial load and the watch being in place would be missed:
    // compare with what is live now, once the watch exists.
    // Compared by digest: the watcher keeps no copy of the file's text (its literal keys).
    let digest = |path: &Path| {
        crate::config::read_bounded(path, crate::config::MAX_CONFIG_BYTES)
            .ok()
            .map(|b| crate::config::text_digest(&b))
    };
    let live = Some(state.config.load().source_digest);
    let now = digest(&path);
    if now.is_some() && now != live {
        reload_off_path(&state, &path).await;
    }
    let mut last = now.or(live);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            _ = hup.recv() => {
                tracing::info!("SIGHUP: reloading config");
                reload_off_path(&state, &path).await;
                last = digest(&path);
            }
            Some(()) = rx.recv() => {
                // Debounce: wait for the burst of events to end, but never longer than
                // DEBOUNCE_MAX in all.
                let until = tokio::time::Instant::now() + DEBOUNCE_MAX;
                while tokio::time::Instant::now() < until
                    && let Ok(Some(())) = tokio::time::timeout(DEBOUNCE, rx.recv()).await
                {}
                let now = digest(&path);
                if now.is_none() {
                    // Mid-rename or deleted: keep the live table; the next event retries.
                    continue;
                }
                if now != last {
                    reload_off_path(&state, &path).await;
                    last = now;
                }
                // A symlink may point elsewhere now: follow it.
                let dirs = watch_dirs(&path);
                if dirs != watched {
                    for d in watched.iter().filter(|d| !dirs.contains(d)) {
                        let _ = watcher.unwatch(d);
                    }
                    for d in dirs.iter().filter(|d| !watched.contains(d)) {
                        if let Err(e) = watcher.watch(d, RecursiveMode::NonRecursive) {
                            tracing::warn!(dir = %d.display(), error = %e, "cannot watch the config's directory");
                        }
                    }
                    watched = dirs;
                }
                *names.lock().unwrap_or_else(|e| e.into_inner()) = watch_names(&path);
            }
        }
    }
    drop(watcher);
    drop(tx);
    Ok(())
}

/// Re-reads `vault:` secrets every `vault.refresh` and, when a value changed, rebuilds the table
/// from the current source and installs it. Vault down: the last good values stay in use and the
/// error is shown in `/status` (`vault.last_error`).
pub async fn vault_refresher(state: Arc<AppState>, cancel: CancellationToken) {
    loop {
        let every = state
            .config
            .load()
            .vault
            .as_ref()
            .map(|v| v.refresh.max(Duration::from_secs(1)))
            .unwrap_or(Duration::from_secs(60));
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if state.config.load().vault.is_none() {
            continue;
        }
        let st = state.clone();
        let _ = tokio::task::spawn_blocking(move || refresh_vault_now(&st)).await;
    }
}

/// One Vault refresh: returns whether a new table was installed.
pub fn refresh_vault_now(state: &AppState) -> bool {
    let _serial = state.install_lock.lock().unwrap_or_else(|e| e.into_inner());
    let current = state.config.load_full();
    if current.vault.is_none() {
        return false;
    }
    let discovered = state
        .discovered
        .lock()
        .map(|d| d.clone())
        .unwrap_or_default();
    let Some(rebuilt) = current.rebuild_with(&discovered) else {
        return false;
    };
    match rebuilt {
        Ok(cfg) => {
            *state.vault_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
            if cfg.vault_digest == current.vault_digest {
                return false;
            }
            state.install(cfg);
            tracing::info!("vault secrets changed; routing table rebuilt");
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, "vault refresh failed; the last good values stay in use");
            *state.vault_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e.0);
            false
        }
    }
}
