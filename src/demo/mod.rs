//! `autohedge demo`: the gateway on the embedded default policy, in front of two in-process mock
//! upstreams — `primary`, which fails part of the time (503s, a 429 with `Retry-After`, a stream
//! that stalls), and `backup`. It sends a bounded burst, then reads the audit trail back and
//! prints where each request went and why. Its upstreams are [`mock`]'s, the scriptable upstream
//! `autohedge mock-upstream` serves and the tests drive.

use std::process::ExitCode;
use std::time::Duration;

pub mod mock;
pub mod sim;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::cli::spawn_mock;
use crate::config::Config;
use crate::front::server::{Gateway, GatewayOptions};
use mock::Flavor;

const PRIMARY_SCRIPT: &str = r#"
name: primary
reply: "Hello from the primary endpoint!"
rules:
  - when: { every: 3 }
    times: 2
    status: 503
  - when: { every: 5 }
    times: 1
    status: 429
    headers: { retry-after: "1" }
  - when: { stream: true, every: 2 }
    times: 1
    stall_after: 0
"#;

const BACKUP_SCRIPT: &str = r#"
name: backup
reply: "Hello from the backup endpoint!"
"#;

/// endpoint, class, status, latency (ms), error
type AttemptLine = (String, String, Option<u16>, f64, Option<String>);

pub async fn run(requests: u32) -> anyhow::Result<ExitCode> {
    let requests = requests.clamp(1, 1000);
    let cancel = CancellationToken::new();
    let (primary, _) = spawn_mock(
        Flavor::Openai,
        mock::parse_script(PRIMARY_SCRIPT).map_err(anyhow::Error::msg)?,
        cancel.clone(),
    )
    .await?;
    let (backup, _) = spawn_mock(
        Flavor::Openai,
        mock::parse_script(BACKUP_SCRIPT).map_err(anyhow::Error::msg)?,
        cancel.clone(),
    )
    .await?;
    // The embedded default's policy, with its endpoints replaced by the two mocks.
    let yaml = format!(
        r#"
models:
  primary:
    type: openai
    base_url: http://{primary}/v1
    model: gpt-4o-mini
    timeouts: {{ connect: 1s, first_token: 300ms, total: 10s }}
  backup:
    type: openai
    base_url: http://{backup}/v1
    model: gpt-4o-mini
routing_policy:
  fallback_chain: [primary, backup]
  success_threshold: 0.85
  cache_ttl: 300
routes:
  chat: [primary, backup]
"#
    );
    let cfg = Config::load(&yaml).map_err(|e| anyhow::anyhow!("demo config: {e}"))?;
    let data_dir = std::env::temp_dir().join(format!("autohedge-demo-{}", std::process::id()));
    let gw = Gateway::start(GatewayOptions {
        config: cfg,
        config_path: None,
        data_dir: data_dir.clone(),
        listener: crate::front::server::bind("127.0.0.1:0").await?,
        watch: false,
    })
    .await?;
    let base = format!("http://{}", gw.addr);
    crate::say!(
        "AutoHedge demo: gateway on {base}, primary mock on {primary}, backup mock on {backup}"
    );
    crate::say!(
        "chain `chat`: primary -> backup. primary answers 503 twice, 429 once (Retry-After: 1s), and stalls one stream before its first token.\n"
    );

    let client = reqwest::Client::new();
    let mut ids = Vec::new();
    for i in 0..requests {
        let stream = i % 2 == 1;
        let id = format!("demo-{:03}", i + 1);
        let body = serde_json::json!({
            "model": "chat",
            "stream": stream,
            "messages": [{"role": "user", "content": format!("Request number {}", i + 1)}],
        });
        let resp = client
            .post(format!("{base}/v1/chat/completions"))
            .header("x-request-id", &id)
            .json(&body)
            .send()
            .await
            .context("sending a demo request")?;
        let status = resp.status();
        let _ = resp.bytes().await;
        ids.push((id, stream, status.as_u16()));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let status: serde_json::Value = client
        .get(format!("{base}/status"))
        .send()
        .await?
        .json()
        .await?;
    gw.shutdown().await;
    cancel.cancel();

    let conn = crate::store::open_connection(&crate::store::db_path(&data_dir))?;
    let mut stmt = conn.prepare(
        "SELECT a.endpoint, a.class, a.status, a.latency_ms, a.error FROM attempts a JOIN requests r ON a.request_row = r.id WHERE r.request_id = ?1 ORDER BY a.seq",
    )?;
    crate::say!(
        "{:<9} {:<7} {:>6}  {:<8} why",
        "request",
        "kind",
        "status",
        "served by"
    );
    for (id, stream, code) in &ids {
        let attempts: Vec<AttemptLine> = stmt
            .query_map([id], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            })?
            .collect::<Result<_, _>>()?;
        let served = attempts
            .iter()
            .rev()
            .find(|a| a.1 == "ok")
            .map(|a| a.0.clone())
            .unwrap_or_else(|| "-".into());
        let why = attempts
            .iter()
            .map(|(ep, class, st, ms, _)| match (class.as_str(), st) {
                ("ok", _) => format!("{ep} ok ({ms:.1}ms)"),
                (c, Some(s)) => format!("{ep} {c} [{s}] ({ms:.1}ms)"),
                (c, None) => format!("{ep} {c} ({ms:.1}ms)"),
            })
            .collect::<Vec<_>>()
            .join(" -> ");
        crate::say!(
            "{:<9} {:<7} {:>6}  {:<8} {}",
            id,
            if *stream { "stream" } else { "json" },
            code,
            served,
            why
        );
    }
    crate::say!("\nendpoint state at the end (GET /status):");
    if let Some(eps) = status.get("endpoints").and_then(|e| e.as_object()) {
        for (name, e) in eps {
            crate::say!(
                "  {name:<8} state={:<9} successes={} failures={} last_error={}",
                e["state"].as_str().unwrap_or("?"),
                e["totals"]["successes"],
                e["totals"]["failures"],
                e["last_error"]["message"].as_str().unwrap_or("-")
            );
        }
    }
    crate::say!(
        "\nEvery request and attempt is in {}; try: autohedge stats --data-dir {}",
        crate::store::db_path(&data_dir).display(),
        data_dir.display()
    );
    let failed = ids.iter().filter(|(_, _, c)| *c >= 500).count();
    crate::say!(
        "{} of {} requests answered successfully.",
        ids.len() - failed,
        ids.len()
    );
    Ok(ExitCode::SUCCESS)
}
