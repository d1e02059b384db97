//! `autohedge`: the command line. Parsing lives here; each command is a function in `cli`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use autohedge::cli;
use autohedge::demo::mock::Flavor;

/// The request path allocates many small JSON maps and buffers; mimalloc's thread-local free
/// lists cut the allocator's share of CPU that glibc malloc showed in profiles (`alloc` says how
/// it is called).
#[global_allocator]
static GLOBAL: autohedge::alloc::Allocator = autohedge::alloc::Allocator;

/// Transparent huge pages off for this process, unless the operator set `MIMALLOC_ALLOW_THP`
/// (mimalloc's own switch) in the environment.
///
/// mimalloc asks for huge pages on its arenas (`madvise(MADV_HUGEPAGE)`), so the first touch of
/// every 2 MiB region makes the kernel find and zero a whole huge page. For a heap of a few tens
/// of MiB that buys no TLB relief worth having, and it cost two things measured on this machine
/// (README, Benchmark, session 14): the first request after `serve` started waited 10-32 ms
/// instead of 2 ms, stalled in the kernel zeroing pages (slowest after the machine had been
/// idle), and peak RSS under load was 49.6 MB instead of 28.8 MB. `PR_SET_THP_DISABLE` is the
/// process's own flag: it also covers the arena mimalloc reserved before `main`, and changes
/// nothing system-wide. Failing (a kernel without the call) leaves things as they were.
fn huge_pages_off() {
    #[cfg(target_os = "linux")]
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        let _ = rustix::thread::disable_transparent_huge_pages(true);
    }
}

#[derive(Parser)]
#[command(
    name = "autohedge",
    version,
    about = "One OpenAI-compatible endpoint over a fleet of LLM backends that fails over on the errors that really happen."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve {
        /// Config file (default: config/config.yaml, or the embedded default if that is absent).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Listen address (default: the config's server.listen).
        #[arg(long)]
        listen: Option<String>,
        /// Where autohedge.db lives (a Swarm service sets it per task with
        /// `AUTOHEDGE_DATA_DIR=/data/slot-{{.Task.Slot}}`).
        #[arg(long, env = "AUTOHEDGE_DATA_DIR", default_value = "./data")]
        data_dir: PathBuf,
    },
    /// Run a scriptable upstream that speaks the OpenAI, vLLM or Ollama wire format.
    MockUpstream {
        #[arg(long)]
        listen: String,
        #[arg(long, value_enum, default_value = "openai")]
        flavor: Flavor,
        /// Script file (YAML); see README.md "mock-upstream script".
        #[arg(long)]
        script: Option<PathBuf>,
    },
    /// Start the gateway with two in-process mock upstreams, send a burst, show where each
    /// request went and why.
    Demo {
        /// Requests to send.
        #[arg(long, default_value_t = 24)]
        requests: u32,
    },
    /// Per-endpoint figures from the audit trail.
    Stats {
        /// Where autohedge.db lives; name it once per replica (`--data-dir a --data-dir b`) to
        /// merge their trails.
        #[arg(long, default_value = "./data")]
        data_dir: Vec<PathBuf>,
        /// How far back: 1h, 30m, 7d …
        #[arg(long, default_value = "1h")]
        since: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// Per client key (`auth.keys[].name`): requests, tokens and spend.
        #[arg(long)]
        by_key: bool,
        /// Refresh in place every 2 s until interrupted.
        #[arg(long)]
        watch: bool,
        /// Read the trail from the store this config names (`audit.store: postgres`).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The failure report from the audit trail: totals, top failure causes, failover
    /// performance, per-endpoint reliability and recommended actions (Markdown, or HTML with
    /// SVG charts).
    Report {
        /// How far back: 24h, 7d, 30m …
        #[arg(long, default_value = "24h")]
        since: String,
        #[arg(long, value_enum, default_value = "md")]
        format: autohedge::ops::report::Format,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Where autohedge.db lives; name it once per replica (`--data-dir a --data-dir b`) to
        /// merge their trails.
        #[arg(long, default_value = "./data")]
        data_dir: Vec<PathBuf>,
        /// Read the trail from the store this config names (`audit.store: postgres`).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Move the audit trail between stores: export it as JSON lines, import them.
    Audit {
        #[command(subcommand)]
        action: AuditAction,
    },
    /// Validate a config and print what it resolved (key sources, never key values).
    CheckConfig { path: Option<PathBuf> },
    /// Print the prompt-token count the gateway would use for a request body (or plain text)
    /// read from FILE or stdin.
    CountTokens {
        /// An endpoint or route name (a route counts with its first endpoint's tokenizer).
        #[arg(long)]
        model: String,
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Count the input as plain text even if it is a JSON request body.
        #[arg(long)]
        text: bool,
        file: Option<PathBuf>,
    },
    /// Operator actions on endpoints.
    Endpoint {
        #[command(subcommand)]
        action: EndpointAction,
    },
    /// Send a request the audit trail kept (`audit.capture_bodies`) again through the running
    /// gateway, as the client key that sent it; its new row says `replay_of`.
    Replay {
        /// The request id (`x-request-id`) to replay.
        id: String,
        /// Send it to this endpoint alone (the key must cover it).
        #[arg(long)]
        to: Option<String>,
        /// Print the old and the new answer side by side.
        #[arg(long)]
        diff: bool,
        /// The running gateway (default: http://<server.listen of the config>).
        #[arg(long)]
        url: Option<String>,
        #[arg(long)]
        config: Option<PathBuf>,
        /// The client key whose request it was, when the id names several keys' requests.
        #[arg(long)]
        key: Option<String>,
        /// Print the gateway's JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// Exit 0 if the gateway at URL answers /health (for container health checks).
    Healthcheck {
        #[arg(long, default_value = "http://127.0.0.1:8000")]
        url: String,
    },
}

#[derive(Subcommand)]
enum AuditAction {
    /// Write the trail (requests with their attempts, endpoint events, client keys' spend) as
    /// JSON lines.
    Export {
        /// How far back: 24h, 7d …
        #[arg(long, default_value = "24h")]
        since: String,
        #[arg(long, default_value = "./data")]
        data_dir: PathBuf,
        /// Read from the store this config names (`audit.store: postgres`).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Write here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Load exported lines into the configured store (`--config` with `audit.store:
    /// postgres`, else the SQLite trail in `--data-dir`).
    Import {
        file: PathBuf,
        #[arg(long, default_value = "./data")]
        data_dir: PathBuf,
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum EndpointAction {
    /// Lift a retirement (410 Gone), auth failure or cooldown.
    Clear {
        name: String,
        #[arg(long, default_value = "./data")]
        data_dir: PathBuf,
        /// The running gateway to tell (default: http://<server.listen of the config>).
        #[arg(long)]
        url: Option<String>,
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    huge_pages_off();
    let args = Cli::parse();
    // The demo prints its own report; its logs would only interleave with it.
    let _log_guard = cli::init_tracing(match args.command {
        Command::Demo { .. }
        | Command::Stats { .. }
        | Command::Report { .. }
        | Command::Audit { .. }
        | Command::CheckConfig { .. }
        | Command::CountTokens { .. }
        | Command::Replay { .. } => "warn",
        _ => "info",
    });
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(autohedge::alloc::on_worker_park)
        .on_thread_unpark(autohedge::alloc::on_worker_unpark)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("autohedge: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match args.command {
            Command::Serve {
                config,
                listen,
                data_dir,
            } => {
                autohedge::alloc::start_purger(tokio::runtime::Handle::current());
                cli::serve(config, listen, data_dir).await
            }
            Command::MockUpstream {
                listen,
                flavor,
                script,
            } => cli::mock_upstream(listen, flavor, script).await,
            Command::Demo { requests } => autohedge::demo::run(requests).await,
            Command::Stats {
                data_dir,
                since,
                json,
                by_key,
                watch,
                config,
            } => {
                if watch {
                    cli::stats_watch(&data_dir, &since, by_key, config.as_deref()).await
                } else {
                    cli::stats(&data_dir, &since, json, by_key, config.as_deref())
                }
            }
            Command::Report {
                since,
                format,
                out,
                data_dir,
                config,
            } => cli::report(&data_dir, &since, format, out.as_deref(), config.as_deref()),
            Command::Audit {
                action:
                    AuditAction::Export {
                        since,
                        data_dir,
                        config,
                        out,
                    },
            } => cli::audit_export(&data_dir, &since, config.as_deref(), out.as_deref()),
            Command::Audit {
                action:
                    AuditAction::Import {
                        file,
                        data_dir,
                        config,
                    },
            } => cli::audit_import(&file, &data_dir, config.as_deref()),
            Command::CheckConfig { path } => cli::check_config(path),
            Command::CountTokens {
                model,
                config,
                json,
                text,
                file,
            } => cli::count_tokens(&model, config, json, text, file),
            Command::Endpoint {
                action:
                    EndpointAction::Clear {
                        name,
                        data_dir,
                        url,
                        config,
                    },
            } => cli::endpoint_clear(&name, &data_dir, url, config).await,
            Command::Healthcheck { url } => cli::healthcheck(&url).await,
            Command::Replay {
                id,
                to,
                diff,
                url,
                config,
                key,
                json,
            } => {
                cli::replay(
                    &id,
                    cli::ReplayArgs {
                        to,
                        key,
                        url,
                        config,
                        diff,
                        json,
                    },
                )
                .await
            }
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("autohedge: {e:#}");
            ExitCode::from(2)
        }
    }
}
