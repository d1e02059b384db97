//! The commands behind `main`: each returns an exit code or an error that `main` prints.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use tokio_util::sync::CancellationToken;

use crate::config::{self, Config, EMBEDDED_DEFAULT};
use crate::demo::mock::{self, Flavor, Mock};
use crate::front::server::{Gateway, GatewayOptions};
use crate::store;

const DEFAULT_CONFIG: &str = "config/config.yaml";

/// Logs go to stderr (stdout carries the `listening on` line scripts wait for). `RUST_LOG`
/// overrides the level; `AUTOHEDGE_LOG_FORMAT=json` switches to JSON lines.
pub fn init_tracing(default_level: &str) -> Option<crate::ops::logwriter::Guard> {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // vaultrs and rustify log every failed Vault call at ERROR with no context; the gateway
    // reports Vault's failures itself (naming the secret's path), once.
    let filter = ["vaultrs=off", "rustify=off"]
        .iter()
        .filter_map(|d| d.parse().ok())
        .fold(filter, |f, d| f.add_directive(d));
    // A bounded queue in front of stderr, written by a thread of its own: a slow or blocked
    // stderr (a full pipe, `docker service logs` behind) drops lines — counted in
    // `autohedge_log_dropped_total` — instead of stalling the requests that log. One write(2)
    // per gather interval, and no wake-up per line (`logwriter`).
    let limit = std::env::var("AUTOHEDGE_LOG_BUFFER_LINES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|n| *n > 0)
        .unwrap_or(LOG_QUEUE_LINES);
    let (writer, guard) =
        match crate::ops::logwriter::LogWriter::start(std::io::stderr(), limit, "autohedge-log") {
            Ok(w) => w,
            Err(e) => {
                eprintln!("autohedge: cannot start the log writer thread: {e}");
                return None;
            }
        };
    let json = std::env::var("AUTOHEDGE_LOG_FORMAT").as_deref() == Ok("json");
    let _ = crate::ops::telemetry::ACCESS_LOG.set((writer.clone(), json));
    // Colour only for a person at a terminal: `docker service logs`, files and pipes get plain
    // text (and `NO_COLOR` turns it off anywhere).
    let colour = {
        use std::io::IsTerminal;
        std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(writer);
    // Each line logged while a request is served carries it (`span.request_id` in JSON,
    // `request{request_id=…}:` in text): `logctx`, not a tracing span per request.
    let installed = if json {
        builder
            // Fields at the top level (`jq .status`), not under `fields`.
            .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
            .event_format(crate::ops::logctx::Format::json())
            .try_init()
    } else {
        builder
            .event_format(crate::ops::logctx::Format::text())
            .try_init()
    };
    // The guard flushes what is queued when it is dropped (at exit).
    installed.is_ok().then_some(guard)
}

/// Log lines queued for stderr before new ones are dropped (`AUTOHEDGE_LOG_BUFFER_LINES`).
const LOG_QUEUE_LINES: usize = 16_384;

/// The config to use: the given path, else `config/config.yaml` if present, else the embedded
/// default (which is not watched: there is no file).
fn load_config(path: Option<PathBuf>) -> anyhow::Result<(Config, Option<PathBuf>)> {
    match path {
        Some(p) => Ok((Config::load_file(&p)?, Some(p))),
        None => {
            let p = PathBuf::from(DEFAULT_CONFIG);
            if p.exists() {
                Ok((Config::load_file(&p)?, Some(p)))
            } else {
                let cfg = Config::load(EMBEDDED_DEFAULT)
                    .map_err(|e| anyhow::anyhow!("embedded default config: {e}"))?;
                Ok((cfg, None))
            }
        }
    }
}

/// Cancels `token` on SIGTERM or SIGINT. With a gateway's `state`, the drain comes first: it
/// starts at once (`AppState::draining`) and accepting stops `server.drain_delay` later (or at
/// a second signal).
fn cancel_on_signals(
    token: CancellationToken,
    state: Option<std::sync::Arc<crate::state::AppState>>,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        let delay = state
            .as_ref()
            .map_or(Duration::ZERO, |s| s.config.load().drain_delay);
        tracing::info!(
            drain_delay_ms = delay.as_millis() as u64,
            "signalled to stop: draining"
        );
        if let Some(s) = &state {
            s.draining.cancel();
        }
        if !delay.is_zero() {
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = term.recv() => tracing::info!("second SIGTERM: closing now"),
                _ = int.recv() => tracing::info!("second SIGINT: closing now"),
            }
        }
        token.cancel();
    });
    Ok(())
}

pub async fn serve(
    config_path: Option<PathBuf>,
    listen: Option<String>,
    data_dir: PathBuf,
) -> anyhow::Result<ExitCode> {
    let (cfg, path) = load_config(config_path)?;
    let files = crate::front::server::raise_open_files_limit();
    match (&files.error, files.now) {
        (Some(e), _) => tracing::warn!(
            error = %e,
            limit = ?files.before,
            "could not raise the open files limit to its hard limit"
        ),
        (None, now) if now != files.before => {
            tracing::info!(from = ?files.before, to = ?now, "open files limit raised to the hard limit")
        }
        _ => {}
    }
    if let Some(n) = files.now
        && n < crate::front::server::FEW_OPEN_FILES
    {
        tracing::warn!(
            limit = n,
            "few open files allowed: each request in flight holds two (client and upstream); raise the hard limit (ulimit -Hn, systemd LimitNOFILE=, docker --ulimit nofile=)"
        );
    }
    let addr = listen.unwrap_or_else(|| cfg.listen.clone());
    let listener = crate::front::server::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    let gw = Gateway::start(GatewayOptions {
        config: cfg,
        config_path: path.clone(),
        data_dir: data_dir.clone(),
        listener,
        watch: path.is_some(),
    })
    .await?;
    // Handlers before the line scripts wait for: a SIGTERM sent the moment the gateway says it
    // listens must drain it, not kill it.
    cancel_on_signals(gw.cancel_token(), Some(gw.state.clone()))?;
    crate::say!("autohedge listening on http://{}", gw.addr);
    crate::say!(
        "config: {}; audit: {}",
        path.map(|p| p.display().to_string())
            .unwrap_or_else(|| "embedded default".into()),
        store::db_path(&data_dir).display()
    );
    gw.run_until_cancelled().await;
    Ok(ExitCode::SUCCESS)
}

pub async fn mock_upstream(
    listen: String,
    flavor: Flavor,
    script: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let script = match script {
        Some(p) => {
            let text = std::fs::read_to_string(&p)
                .with_context(|| format!("cannot read {}", p.display()))?;
            mock::parse_script(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?
        }
        None => mock::Script::default(),
    };
    let listener = crate::front::server::bind(&listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    let addr = listener.local_addr()?;
    let token = CancellationToken::new();
    cancel_on_signals(token.clone(), None)?;
    crate::say!("mock-upstream ({flavor:?}) listening on http://{addr}");
    mock::serve(listener, Mock::new(flavor, script), token).await;
    Ok(ExitCode::SUCCESS)
}

pub fn check_config(path: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let (cfg, used) = match load_config(path) {
        Ok(v) => v,
        Err(e) => {
            crate::say!("INVALID: {e:#}");
            return Ok(ExitCode::FAILURE);
        }
    };
    crate::say!(
        "config: {} — valid",
        used.map(|p| p.display().to_string())
            .unwrap_or_else(|| "embedded default".into())
    );
    {
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), "{}", config::describe(&cfg));
    }
    Ok(ExitCode::SUCCESS)
}

pub fn count_tokens(
    model: &str,
    config_path: Option<PathBuf>,
    json: bool,
    as_text: bool,
    file: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    use std::io::Read;
    let (cfg, _) = load_config(config_path)?;
    // A model the config does not name is counted the way `tiktoken.encoding_for_model` would
    // (tiktoken's own model map): `count-tokens --model gpt-4o FILE` works with no config.
    let (counter, endpoint, counted_for) = match cfg.chain_for(model) {
        Some(chain) => {
            let ep = chain
                .first()
                .and_then(|n| cfg.endpoints.get(n))
                .context("empty chain")?;
            (
                ep.counter.clone(),
                Some(ep.name.clone()),
                format!("endpoint {}", ep.name),
            )
        }
        None => {
            use tiktoken_rs::tokenizer::Tokenizer as T;
            let family = match tiktoken_rs::tokenizer::get_tokenizer(model) {
                Some(T::O200kBase | T::O200kHarmony) => crate::tokens::Family::O200k,
                Some(T::Cl100kBase) => crate::tokens::Family::Cl100k,
                Some(other) => bail!(
                    "`{model}` names no route or endpoint of this config; tiktoken maps it to {other:?}, which the gateway does not count with (o200k_base and cl100k_base only)"
                ),
                None => bail!(
                    "`{model}` names no route or endpoint of this config, and tiktoken knows no encoding for it"
                ),
            };
            (
                crate::tokens::Counter::Tiktoken(family),
                None,
                format!("tiktoken's model map for `{model}`"),
            )
        }
    };
    let mut text = String::new();
    match &file {
        Some(p) => {
            text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read {}", p.display()))?
        }
        None => {
            std::io::stdin().read_to_string(&mut text)?;
        }
    }
    // A JSON request body is counted as the gateway counts requests; anything else as text.
    let parsed: Option<(crate::wire::Op, serde_json::Map<String, serde_json::Value>)> =
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(serde_json::Value::Object(o)) if !as_text => {
                let op = if o.contains_key("messages") {
                    Some(crate::wire::Op::Chat)
                } else if o.contains_key("prompt") {
                    Some(crate::wire::Op::Completions)
                } else if o.contains_key("input") {
                    Some(crate::wire::Op::Embeddings)
                } else {
                    None
                };
                op.map(|op| (op, o))
            }
            _ => None,
        };
    let (kind, count) = match &parsed {
        Some((op, body)) => (op.name(), counter.request(*op, body)),
        None => (
            "text",
            crate::tokens::Count {
                tokens: counter.text(&text),
                exact: counter.is_exact(),
            },
        ),
    };
    if json {
        crate::say!(
            "{}",
            serde_json::json!({"tokens": count.tokens, "exact": count.exact, "method": counter.method(), "endpoint": endpoint, "counted_for": counted_for, "kind": kind})
        );
    } else {
        crate::say!(
            "{} tokens ({kind}; {}{}; {})",
            count.tokens,
            counter.method(),
            if count.exact { "" } else { ", an estimate" },
            counted_for
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `autohedge report`.
pub fn report(
    data_dir: &[PathBuf],
    since: &str,
    format: crate::ops::report::Format,
    out: Option<&Path>,
    config: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let window =
        config::duration::parse_duration(since).map_err(|e| anyhow::anyhow!("--since: {e}"))?;
    let (data_dir, _snapshot) = trail_dirs(data_dir, config, window, false)?;
    let data_dir = &data_dir[..];
    let from = SystemTime::now()
        .checked_sub(window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let r = crate::ops::report::build(data_dir, from).context("reading the audit trail")?;
    let text = match format {
        crate::ops::report::Format::Md => crate::ops::report::markdown(&r),
        crate::ops::report::Format::Html => crate::ops::report::html(&r),
    };
    match out {
        Some(p) => {
            std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
            eprintln!(
                "report written to {} ({} requests, {} recommendation{})",
                p.display(),
                r.requests,
                r.recommendations.len(),
                if r.recommendations.len() == 1 {
                    ""
                } else {
                    "s"
                }
            );
        }
        None => crate::say!("{text}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// `autohedge stats --watch`: the table redrawn in place every 2 s (cursor home, clear to the
/// end) until Ctrl-C.
pub async fn stats_watch(
    data_dir: &[PathBuf],
    since: &str,
    by_key: bool,
    config: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    use std::io::Write as _;
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
            _ = tick.tick() => {}
        }
        // Clear first, then the table: a failing read shows its error in place too.
        let mut out = std::io::stdout();
        let _ = write!(out, "\x1b[H\x1b[2J");
        let _ = out.flush();
        if let Err(e) = stats(data_dir, since, false, by_key, config) {
            crate::say!("{e:#}");
        }
        crate::say!(
            "\n(refreshed {} — every 2 s; Ctrl-C to stop)",
            httpdate::fmt_http_date(SystemTime::now())
        );
    }
}

/// A trail copied out of PostgreSQL for the readers; removed when dropped.
pub struct Snapshot(PathBuf);

impl Drop for Snapshot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The data dirs the readers read: the `--data-dir`s, or, when `--config` names a config whose
/// `audit.store` is `postgres`, the window (from `window` ago) copied into a temporary one.
fn trail_dirs(
    data_dir: &[PathBuf],
    config: Option<&Path>,
    window: Duration,
    bodies: bool,
) -> anyhow::Result<(Vec<PathBuf>, Option<Snapshot>)> {
    let Some(path) = config else {
        return Ok((data_dir.to_vec(), None));
    };
    let cfg = Config::load_file(path)?;
    let Some(pg) = &cfg.audit_pg else {
        return Ok((data_dir.to_vec(), None));
    };
    let from = SystemTime::now()
        .checked_sub(window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let dir = std::env::temp_dir().join(format!(
        "autohedge-pg-{}-{:016x}",
        std::process::id(),
        fastrand::u64(..)
    ));
    let snap = Snapshot(dir.clone());
    store::pg::snapshot(pg, from, &dir, bodies).context("reading the PostgreSQL audit store")?;
    Ok((vec![dir], Some(snap)))
}

/// `autohedge audit export`: the trail from `since` ago as JSON lines.
pub fn audit_export(
    data_dir: &Path,
    since: &str,
    config: Option<&Path>,
    out: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let window =
        config::duration::parse_duration(since).map_err(|e| anyhow::anyhow!("--since: {e}"))?;
    // Only the export carries the kept bodies.
    let (dirs, _snapshot) = trail_dirs(&[data_dir.to_path_buf()], config, window, true)?;
    let (_, conn) = store::open_trails(&dirs)?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no audit trail"))?;
    let from = SystemTime::now()
        .checked_sub(window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let n = match out {
        Some(p) => {
            let mut f = std::io::BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
            );
            let n = store::transfer::export(&conn, from, &mut f)?;
            std::io::Write::flush(&mut f)?;
            n
        }
        None => store::transfer::export(&conn, from, &mut std::io::stdout().lock())?,
    };
    eprintln!("{n} records exported");
    Ok(ExitCode::SUCCESS)
}

/// `autohedge audit import FILE`: exported lines into the configured store (`--config` with
/// `audit.store: postgres`, else the SQLite trail in `--data-dir`).
pub fn audit_import(
    file: &Path,
    data_dir: &Path,
    config: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let pg = match config {
        Some(p) => Config::load_file(p)?.audit_pg,
        None => None,
    };
    let opened = match &pg {
        Some(pg) => {
            let o = store::pg::open(pg, 100_000, None);
            if let Some(why) = o.store.handle().off_reason() {
                bail!("the audit store ({}) is not reachable: {why}", pg.display);
            }
            o
        }
        None => store::Store::open(data_dir, 100_000)?,
    };
    let handle = opened.store.handle();
    let mut input = std::io::BufReader::new(
        std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?,
    );
    let (ok, bad, why) =
        store::transfer::import(&mut input, |r| handle.send_waiting(r)).context("reading")?;
    drop(handle);
    let written_before = opened.store.handle();
    opened.store.close();
    for w in &why {
        eprintln!("refused: {w}");
    }
    let dropped = written_before.dropped();
    eprintln!("{ok} records imported, {bad} refused, {dropped} not written");
    Ok(if bad == 0 && dropped == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

pub fn stats(
    data_dir: &[PathBuf],
    since: &str,
    json: bool,
    by_key: bool,
    config: Option<&Path>,
) -> anyhow::Result<ExitCode> {
    let window =
        config::duration::parse_duration(since).map_err(|e| anyhow::anyhow!("--since: {e}"))?;
    let (data_dir, _snapshot) = trail_dirs(data_dir, config, window, false)?;
    let data_dir = &data_dir[..];
    let (paths, trails): (Vec<PathBuf>, Vec<rusqlite::Connection>) =
        store::open_trails(data_dir)?.into_iter().unzip();
    let db = paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let from = SystemTime::now()
        .checked_sub(window)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    if by_key {
        let rows = store::report_by_key(&trails, from).context("reading the audit trail")?;
        if json {
            let v: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "key": r.key,
                        "requests": r.requests,
                        "served": r.served,
                        "refused": r.refused,
                        "tokens_in": r.tokens_in,
                        "tokens_out": r.tokens_out,
                        "cost_usd": r.cost_usd,
                    })
                })
                .collect();
            crate::say!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(ExitCode::SUCCESS);
        }
        crate::say!("requests by client key since {since} ago ({db}):");
        crate::say!(
            "{:<24} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10}",
            "key",
            "requests",
            "served",
            "refused",
            "tokens in",
            "tokens out",
            "cost $"
        );
        if rows.is_empty() {
            crate::say!("(no requests with a client key in this period)");
        }
        for r in rows {
            crate::say!(
                "{:<24} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10.4}",
                r.key,
                r.requests,
                r.served,
                r.refused,
                r.tokens_in,
                r.tokens_out,
                r.cost_usd
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    let rows = store::report(&trails, from).context("reading the audit trail")?;
    if json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                serde_json::json!({
                    "endpoint": r.endpoint,
                    "requests": r.requests,
                    "success_rate": if r.requests > 0 { Some(r.ok as f64 / r.requests as f64) } else { None },
                    "p50_ms": r.p50_ms,
                    "p95_ms": r.p95_ms,
                    "errors": r.errors.iter().map(|(c, n)| (c.clone(), *n)).collect::<std::collections::BTreeMap<_, _>>(),
                    "fallbacks_from": r.fallbacks_from,
                    "fallbacks_served": r.fallbacks_served,
                })
            })
            .collect();
        crate::say!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    crate::say!("attempts since {since} ago ({db}):");
    crate::say!(
        "{:<24} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}  errors",
        "endpoint",
        "requests",
        "success",
        "p50 ms",
        "p95 ms",
        "fell from",
        "fell to"
    );
    if rows.is_empty() {
        crate::say!("(no requests in this period)");
    }
    let fmt_ms = |v: Option<f64>| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
    for r in rows {
        let rate = if r.requests > 0 {
            format!("{:.1}%", 100.0 * r.ok as f64 / r.requests as f64)
        } else {
            "-".into()
        };
        let errors = r
            .errors
            .iter()
            .map(|(c, n)| format!("{c}={n}"))
            .collect::<Vec<_>>()
            .join(" ");
        crate::say!(
            "{:<24} {:>8} {:>8} {:>9} {:>9} {:>9} {:>9}  {}",
            r.endpoint,
            r.requests,
            rate,
            fmt_ms(r.p50_ms),
            fmt_ms(r.p95_ms),
            r.fallbacks_from,
            r.fallbacks_served,
            if errors.is_empty() {
                "-".into()
            } else {
                errors
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn endpoint_clear(
    name: &str,
    data_dir: &Path,
    url: Option<String>,
    config_path: Option<PathBuf>,
) -> anyhow::Result<ExitCode> {
    let config = load_config(config_path);
    let url = match url {
        Some(u) => u,
        None => {
            let listen = config
                .as_ref()
                .map(|(c, _)| c.listen.clone())
                .unwrap_or_else(|_| "127.0.0.1:8000".into());
            format!("http://{listen}")
        }
    };
    // A running gateway clears its memory and persists the change itself; only when none
    // answers is the database edited directly, for the next start.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()?;
    let mut req = client
        .post(format!(
            "{}/admin/endpoints/{name}/clear",
            url.trim_end_matches('/')
        ))
        .header("content-type", "application/json")
        .body("{}");
    // With `auth.admin_key` set the gateway wants it; the CLI reads it from the environment.
    if let Ok(k) = std::env::var("AUTOHEDGE_ADMIN_KEY")
        && !k.trim().is_empty()
    {
        req = req.bearer_auth(k.trim());
    }
    let online = req.send().await;
    match online {
        Ok(r) if r.status().is_success() => {
            crate::say!("{name}: retirement lifted; cleared in the running gateway at {url}");
            return Ok(ExitCode::SUCCESS);
        }
        Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {
            crate::say!("{name}: the gateway at {url} has no such endpoint");
            return Ok(ExitCode::FAILURE);
        }
        Ok(r)
            if r.status() == reqwest::StatusCode::UNAUTHORIZED
                || r.status() == reqwest::StatusCode::FORBIDDEN =>
        {
            // A gateway is running: editing its database underneath it would be undone.
            crate::say!(
                "{name}: the gateway at {url} refused the admin call ({}); set AUTOHEDGE_ADMIN_KEY to its auth.admin_key",
                r.status()
            );
            return Ok(ExitCode::FAILURE);
        }
        Ok(r) => crate::say!("{name}: the gateway at {url} answered {}", r.status()),
        Err(_) => crate::say!("{name}: no gateway answering at {url}"),
    }
    // With `cluster:`, the fleet's shared knowledge is cleared too: the other replicas apply it
    // at once, and none (this one restarted included) reads the old facts back.
    let mut cleared_shared = false;
    if let Ok((cfg, _)) = &config
        && let Some(settings) = cfg.cluster.clone()
    {
        let display = settings.display.clone();
        let (alerts, _rx) = crate::ops::alerts::Alerts::channel();
        match crate::cluster::Cluster::new(settings, alerts, None) {
            Ok(c) => match c.clear_endpoint(name).await {
                Ok(()) => {
                    crate::say!("{name}: cleared in the cluster store at {display}");
                    cleared_shared = true;
                }
                Err(e) => crate::say!("{name}: the cluster store at {display} failed: {e}"),
            },
            Err(e) => crate::say!("{name}: {e}"),
        }
        if !cleared_shared {
            // The replicas would read the old facts back at their next start.
            return Ok(ExitCode::FAILURE);
        }
    }
    if !store::db_path(data_dir).exists() {
        crate::say!(
            "{name}: no audit database at {}",
            store::db_path(data_dir).display()
        );
        return Ok(if cleared_shared {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let was_retired =
        store::clear_endpoint(data_dir, name).context("updating the audit database")?;
    crate::say!(
        "{name}: {} in {}; the next start uses it",
        if was_retired {
            "retirement lifted"
        } else {
            "no persisted retirement"
        },
        store::db_path(data_dir).display()
    );
    Ok(ExitCode::SUCCESS)
}

pub async fn healthcheck(url: &str) -> anyhow::Result<ExitCode> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()?;
    match client
        .get(format!("{}/health", url.trim_end_matches('/')))
        .send()
        .await
    {
        Ok(r) if r.status().is_success() => Ok(ExitCode::SUCCESS),
        Ok(r) => {
            eprintln!("unhealthy: {}", r.status());
            Ok(ExitCode::FAILURE)
        }
        Err(e) => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            eprintln!("unreachable: {msg}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Starts a mock upstream in-process on an ephemeral loopback port.
pub async fn spawn_mock(
    flavor: Flavor,
    script: mock::Script,
    cancel: CancellationToken,
) -> anyhow::Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = crate::front::server::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let m: Arc<Mock> = Mock::new(flavor, script);
    let handle = tokio::spawn(mock::serve(listener, m, cancel));
    Ok((addr, handle))
}

/// `autohedge replay`'s options.
pub struct ReplayArgs {
    pub to: Option<String>,
    pub key: Option<String>,
    pub url: Option<String>,
    pub config: Option<PathBuf>,
    pub diff: bool,
    pub json: bool,
}

/// `autohedge replay ID`: asks the running gateway to send a kept request again
/// (`POST /admin/replay/{id}`) and prints what came back.
pub async fn replay(id: &str, args: ReplayArgs) -> anyhow::Result<ExitCode> {
    let url = match args.url {
        Some(u) => u,
        None => {
            let listen = load_config(args.config)
                .map(|(c, _)| c.listen)
                .unwrap_or_else(|_| "127.0.0.1:8000".into());
            format!("http://{listen}")
        }
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(660))
        .build()?;
    let mut ask = serde_json::Map::new();
    if let Some(to) = &args.to {
        ask.insert("to".into(), to.clone().into());
    }
    if let Some(k) = &args.key {
        ask.insert("key".into(), k.clone().into());
    }
    let path: String = id
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let mut req = client
        .post(format!("{}/admin/replay/{path}", url.trim_end_matches('/')))
        .header("content-type", "application/json")
        .body(serde_json::Value::Object(ask).to_string());
    if let Ok(k) = std::env::var("AUTOHEDGE_ADMIN_KEY")
        && !k.trim().is_empty()
    {
        req = req.bearer_auth(k.trim());
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("no gateway answering at {url}"))?;
    let status = resp.status();
    let body: serde_json::Value = resp
        .json()
        .await
        .context("the gateway's answer is not JSON")?;
    if !status.is_success() {
        let msg = body["error"]["message"].as_str().unwrap_or("(no message)");
        crate::say!("{id}: not replayed ({status}): {msg}");
        return Ok(ExitCode::FAILURE);
    }
    if args.json {
        crate::say!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(ExitCode::SUCCESS);
    }
    let o = &body["original"];
    let s = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "-".to_string(),
        serde_json::Value::String(s) => s.clone(),
        v => v.to_string(),
    };
    crate::say!(
        "replayed {id} as {} (client key {}{})",
        s(&body["request_id"]),
        s(&body["client_key"]),
        args.to
            .as_deref()
            .map(|t| format!(", to {t}"))
            .unwrap_or_default()
    );
    crate::say!(
        "  before: {} from {} ({})",
        s(&o["status"]),
        s(&o["endpoint"]),
        s(&o["error_class"])
    );
    crate::say!(
        "  now:    {} from {} after {} attempt(s)",
        s(&body["status"]),
        s(&body["endpoint"]),
        s(&body["attempts"])
    );
    if args.diff {
        let old = answer_text(&o["response"]);
        let new = answer_text(&body["response"]);
        crate::say!("");
        for line in side_by_side(&old, &new, 60) {
            crate::say!("{line}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// An answer as lines to compare: a JSON body pretty-printed; a stream's events as the text its
/// chunks carried, with why it ended.
pub fn answer_text(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "(no answer kept)".into(),
        serde_json::Value::String(s) if s.contains("data:") => {
            let (mut text, mut finish) = (String::new(), Vec::new());
            for line in s.lines() {
                let Some(data) = line.strip_prefix("data:").map(str::trim) else {
                    continue;
                };
                let Ok(ev) = serde_json::from_str::<serde_json::Value>(data) else {
                    continue;
                };
                for c in ev["choices"].as_array().into_iter().flatten() {
                    if let Some(t) = c["delta"]["content"].as_str().or(c["text"].as_str()) {
                        text.push_str(t);
                    }
                    if let Some(f) = c["finish_reason"].as_str() {
                        finish.push(f.to_string());
                    }
                }
                if let Some(m) = ev["error"]["message"].as_str() {
                    finish.push(format!("error: {m}"));
                }
            }
            format!("(stream) {text}\nfinish: {}", finish.join(", "))
        }
        serde_json::Value::String(s) => s.clone(),
        v => serde_json::to_string_pretty(v).unwrap_or_default(),
    }
}

/// `old` and `new` as two columns of `width` characters, lines matched by their longest common
/// subsequence: `|` between lines that differ, `<` a line only the old has, `>` only the new.
pub fn side_by_side(old: &str, new: &str, width: usize) -> Vec<String> {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    let col = |s: &str| {
        let mut c: String = s.chars().take(width).collect();
        let n = c.chars().count();
        c.extend(std::iter::repeat_n(' ', width - n));
        c
    };
    let mut out = vec![format!("{} | {}", col("old"), col("new"))];
    // Past a few thousand lines the table would be large: compare line by line instead.
    let (n, m) = (a.len(), b.len());
    let lcs = (n.saturating_mul(m) <= 4_000_000).then(|| {
        let mut t = vec![0u32; (n + 1) * (m + 1)];
        for i in (0..n).rev() {
            for j in (0..m).rev() {
                t[i * (m + 1) + j] = if a[i] == b[j] {
                    t[(i + 1) * (m + 1) + j + 1] + 1
                } else {
                    t[(i + 1) * (m + 1) + j].max(t[i * (m + 1) + j + 1])
                };
            }
        }
        t
    });
    let (mut i, mut j) = (0, 0);
    while i < n || j < m {
        let same = i < n && j < m && a[i] == b[j];
        let step = match &lcs {
            _ if same => 0,
            Some(t) if i < n && j < m => {
                let down = t[(i + 1) * (m + 1) + j];
                let right = t[i * (m + 1) + j + 1];
                let here = t[i * (m + 1) + j];
                if down == here && right == here {
                    3
                } else if down >= right {
                    1
                } else {
                    2
                }
            }
            None if i < n && j < m => 3,
            _ if i < n => 1,
            _ => 2,
        };
        match step {
            0 => {
                out.push(format!("{}   {}", col(a[i]), col(b[j])));
                i += 1;
                j += 1;
            }
            1 => {
                out.push(format!("{} < {}", col(a[i]), col("")));
                i += 1;
            }
            2 => {
                out.push(format!("{} > {}", col(""), col(b[j])));
                j += 1;
            }
            _ => {
                out.push(format!("{} | {}", col(a[i]), col(b[j])));
                i += 1;
                j += 1;
            }
        }
    }
    out.iter().map(|l| l.trim_end().to_string()).collect()
}

#[cfg(test)]
mod replay_tests {
    use super::*;

    #[test]
    fn side_by_side_lines_up_what_is_common_and_marks_what_is_not() {
        let old = "{\n  \"a\": 1,\n  \"b\": 2,\n  \"c\": 3\n}";
        let new = "{\n  \"a\": 1,\n  \"b\": 5,\n  \"c\": 3,\n  \"d\": 4\n}";
        let lines = side_by_side(old, new, 12);
        let marks: Vec<char> = lines[1..]
            .iter()
            .map(|l| l.chars().nth(13).unwrap_or(' '))
            .collect();
        assert_eq!(lines.len(), 1 + 6, "{lines:#?}");
        assert_eq!(marks, vec![' ', ' ', '|', '|', '>', ' '], "{lines:#?}");
        assert!(side_by_side("", "x", 5)[1].contains("> x"));
        assert!(side_by_side("x", "", 5)[1].starts_with("x"));
    }

    #[test]
    fn a_streams_answer_reads_as_its_text() {
        let sse = serde_json::Value::String(
            "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n".into(),
        );
        assert_eq!(answer_text(&sse), "(stream) Hello\nfinish: stop");
    }
}
