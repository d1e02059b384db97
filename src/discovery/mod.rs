//! Docker and Swarm discovery and remediation (bollard; `DOCKER_HOST` or the default socket).
//!
//! Every `docker.interval` the watcher lists Swarm services and plain containers labelled
//! `autohedge.endpoint=<name>`. A config endpoint with `discover: docker` is backed by them: its
//! address is a running task's (resolved from the API, which is what `tasks.<service>` DNS would
//! give without the DNS cache lag), and no running task — or the engine reporting the container
//! unhealthy — makes it unhealthy at once. A labelled service or container the config does not
//! name becomes an endpoint of its own (type and model from its `autohedge.type` and
//! `autohedge.model` labels), appended to the fallback chain and listed in `/status` under
//! `docker.discovered_endpoints`; it goes when its label does.
//!
//! Besides the poll, the watcher follows the engine's event stream (container die, stop, kill,
//! start, oom, health_status): each such event triggers a scan at once, so a dead task's address
//! leaves the pool within milliseconds rather than at the next `docker.interval`. A scan only
//! lists a task whose container (when it runs on this node) is running. When an endpoint's
//! addresses change, what was learned about the old ones (passive ejection, probe verdicts) is
//! dropped: a replacement task starts fresh.
//!
//! Labels are not trust: with `docker.stack` set only services and containers of that stack
//! (`com.docker.stack.namespace`) are seen at all, and an unconfigured labelled service becomes
//! an endpoint only with `docker.adopt_unconfigured: true`.
//!
//! When the daemon cannot be reached, `/status` says `docker_daemon_unreachable` (and an
//! `endpoint_events` row records the transition); HTTP probing and routing carry on with the last
//! known addresses.
//!
//! Remediation is opt-in and allow-listed (services labelled `autohedge.manage=true` or named in
//! `docker.remediation.manage`). It counts only the service's own evidence — its tasks down,
//! Docker's health check failing, or probes of its current addresses failing — never `warming`,
//! `half_open` or a passive ejection (restart → warming → restart must not loop). Every engine
//! call, remediation included, runs under `docker.timeout`. After `unhealthy_after` consecutive
//! unhealthy observations the
//! primary is force-updated (restarted) and its standby scaled from 0 to 1; once the primary has
//! been healthy for `healthy_for`, the standby goes back to 0. At most one action per service per
//! `min_interval`, so nothing flaps; `dry_run` records what it would do. Every action is an
//! `endpoint_events` row with its reason and result.

pub mod engine;
pub mod probe;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bollard::Docker;
use bollard::models::TaskState;
use bollard::query_parameters::{
    InspectContainerOptions, ListContainersOptionsBuilder, ListServicesOptionsBuilder,
    ListTasksOptionsBuilder,
};
use futures_util::{StreamExt, stream};
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{DockerConfig, EndpointKind};
pub use crate::routing::observed::{Discovered, DockerStatus, SharedStatus};
use crate::state::AppState;
use crate::store::{EndpointEvent, Record};

pub const LABEL_ENDPOINT: &str = "autohedge.endpoint";
pub const LABEL_PORT: &str = "autohedge.port";
pub const LABEL_TYPE: &str = "autohedge.type";
pub const LABEL_MODEL: &str = "autohedge.model";
pub const LABEL_MANAGE: &str = "autohedge.manage";
/// Set by `docker stack deploy` on a stack's services and their containers.
pub const LABEL_STACK: &str = "com.docker.stack.namespace";

/// Container events that change where an endpoint runs or whether it is healthy.
const WAKE_EVENTS: &[&str] = &["die", "stop", "kill", "start", "oom", "health_status"];

/// A container coming up: its task may serve again, so discovery looks again every
/// `EAGER_RESCAN` until it runs (Docker reports the container before Swarm's task is RUNNING).
const UP_EVENTS: &[&str] = &["start", "health_status: healthy"];

/// How often discovery looks again while a container that came up has no running task yet: a
/// recovered backend is back in rotation within about this of Docker calling it healthy.
const EAGER_RESCAN: Duration = Duration::from_millis(100);

/// What an engine event asks of the watcher.
enum Wake {
    /// This container died: its address leaves the pool at once.
    Died(String),
    /// A container started: rescan until its task runs.
    Up,
    /// A container's Docker health check passed: its task serves once a scan sees it, so the
    /// scan comes sooner than for other events (the gap is [`EAGER_RESCAN`]). Docker sends it
    /// only when the status changes.
    Healthy,
    /// Something else changed: rescan.
    Changed,
}

/// Events waiting for the watcher; more are coalesced anyway.
const EVENT_QUEUE: usize = 256;

/// Container events after which its address must not get another request.
const DEATH_EVENTS: &[&str] = &["die", "stop", "kill", "oom"];

/// Events arriving together (a kill is die + stop) trigger one scan.
const EVENT_COALESCE: Duration = Duration::from_millis(20);

/// Scans triggered by events start at least this far apart (a dead container's address is
/// dropped at its event all the same).
const EVENT_RESCAN_GAP: Duration = Duration::from_millis(250);

/// How long the event follower waits before reconnecting to the engine's event stream.
const EVENTS_RECONNECT: Duration = Duration::from_secs(1);

#[derive(Clone, Debug)]
struct Found {
    endpoint: String,
    service_id: Option<String>,
    discovered: Discovered,
    labels: HashMap<String, String>,
    replicas: Option<i64>,
    /// Tasks Swarm is bringing up right now, or whose Docker health check is still `starting`
    /// (restarting is its job, not ours, meanwhile).
    starting: usize,
    /// A task's Docker health check is failing (`unhealthy`): evidence whatever else starts.
    health_failing: bool,
    /// (container id, `http://ip:port`) of each address, so a `die` event can drop it at once.
    containers: Vec<(String, String)>,
    /// (container id, its health check's start period) of each running task on this node that
    /// has a start period: remediation takes no evidence from a task still within it.
    start_periods: Vec<(String, Duration)>,
}

fn task_path(kind: EndpointKind) -> &'static str {
    match kind {
        EndpointKind::Openai | EndpointKind::Vllm => "/v1",
        EndpointKind::Ollama => "",
    }
}

/// A container's address, Docker health status, restart count and whether it runs.
struct ContainerView {
    ip: Option<String>,
    health: Option<String>,
    restarts: u64,
    /// `None` when the container is not on this node (cannot be inspected).
    running: Option<bool>,
    /// Its health check's start period (the service's, or its image's), at most
    /// [`MAX_START_PERIOD`]; zero without one.
    start_period: Duration,
}

/// Services, and containers of a service, a scan asks the engine about at once: concurrency, but
/// not a connection per task of an engine that lists thousands.
const ENGINE_CALLS_AT_ONCE: usize = 8;

/// The longest health-check start period remediation waits out: the engine's word is not
/// trusted to hold a sick task off remediation for longer.
const MAX_START_PERIOD: Duration = Duration::from_secs(600);

async fn container_view(docker: &Docker, id: &str, network: Option<&str>) -> ContainerView {
    let Ok(c) = docker
        .inspect_container(id, None::<InspectContainerOptions>)
        .await
    else {
        return ContainerView {
            ip: None,
            health: None,
            restarts: 0,
            running: None,
            start_period: Duration::ZERO,
        };
    };
    let running = c.state.as_ref().and_then(|s| s.running);
    let start_period = c
        .config
        .as_ref()
        .and_then(|c| c.healthcheck.as_ref())
        .and_then(|h| h.start_period)
        .map(|ns| Duration::from_nanos(ns.max(0) as u64).min(MAX_START_PERIOD))
        .unwrap_or_default();
    let health = c
        .state
        .as_ref()
        .and_then(|s| s.health.as_ref())
        .and_then(|h| h.status)
        .map(|s| s.to_string());
    let restarts = c.restart_count.unwrap_or(0).max(0) as u64;
    let nets = c
        .network_settings
        .and_then(|n| n.networks)
        .unwrap_or_default();
    let ip = match network {
        Some(n) => nets.get(n).and_then(|e| e.ip_address.clone()),
        None => nets
            .iter()
            .filter(|(name, _)| name.as_str() != "ingress")
            .find_map(|(_, e)| e.ip_address.clone().filter(|ip| !ip.is_empty())),
    };
    ContainerView {
        ip: ip.filter(|ip| !ip.is_empty()),
        health,
        restarts,
        running,
        start_period,
    }
}

/// `http://ip:port` for an address the engine gave, or `None` when it is not an IP address.
/// The engine's word decides where requests (and the endpoint's key) go, so nothing else is
/// taken from it: not a host name, a path or a `user@` — and an IPv6 address is bracketed.
fn task_url(ip: &str, port: u16) -> Option<String> {
    let ip: std::net::IpAddr = ip.parse().ok()?;
    Some(format!("http://{}", std::net::SocketAddr::new(ip, port)))
}

/// With `docker.stack` set, only that stack's services and containers count.
fn in_stack(labels: &HashMap<String, String>, cfg: &DockerConfig) -> bool {
    match &cfg.stack {
        None => true,
        Some(stack) => labels.get(LABEL_STACK) == Some(stack),
    }
}

/// One labelled Swarm service of the scan: its running, healthy tasks' addresses and how the
/// rest stand; `None` when it is not one of ours (no endpoint label, another stack).
async fn scan_service(
    docker: &Docker,
    cfg: &DockerConfig,
    svc: bollard::models::Service,
) -> Result<Option<Found>, bollard::errors::Error> {
    let spec = svc.spec.clone().unwrap_or_default();
    let labels = spec.labels.clone().unwrap_or_default();
    let Some(endpoint) = labels.get(LABEL_ENDPOINT).cloned() else {
        return Ok(None);
    };
    if !in_stack(&labels, cfg) {
        return Ok(None);
    }
    // Docker caps names at 63 characters; an engine that does not is clipped, since the
    // name is shown in `/status`, logs and `endpoint_events`.
    let name = crate::discovery::engine::clip(&spec.name.clone().unwrap_or_default());
    let port = labels
        .get(LABEL_PORT)
        .and_then(|p| p.parse::<u16>().ok())
        .unwrap_or(8000);
    let replicas = spec
        .mode
        .as_ref()
        .and_then(|m| m.replicated.as_ref())
        .and_then(|r| r.replicas);
    let mut tf = HashMap::new();
    tf.insert("service".to_string(), vec![name.clone()]);
    // The tasks, and their addresses from the raw API (what `tasks.<service>` DNS gives, for
    // tasks on any node), asked at once.
    let (tasks, raw_ips) = tokio::join!(
        docker.list_tasks(Some(
            ListTasksOptionsBuilder::default().filters(&tf).build(),
        )),
        task_addresses(&name, cfg.network.as_deref(), cfg.timeout)
    );
    let tasks = tasks?;
    // Each running task's container (health, and a fallback address when it is on this node),
    // a few inspected at once.
    let inspect: Vec<_> = tasks
        .iter()
        .map(|t| {
            let running = t.status.as_ref().and_then(|s| s.state) == Some(TaskState::RUNNING)
                && t.desired_state == Some(TaskState::RUNNING);
            let cid = t
                .status
                .as_ref()
                .and_then(|s| s.container_status.as_ref())
                .and_then(|c| c.container_id.clone())
                .filter(|_| running);
            let network = cfg.network.clone();
            async move {
                match cid {
                    Some(cid) => Some(container_view(docker, &cid, network.as_deref()).await),
                    None => None,
                }
            }
        })
        .collect();
    let views: Vec<Option<ContainerView>> = stream::iter(inspect)
        .buffered(ENGINE_CALLS_AT_ONCE)
        .collect()
        .await;
    let mut addresses = Vec::new();
    let mut running = 0;
    let mut restarts = 0u64;
    let mut unhealthy = None;
    let mut starting = 0;
    let mut containers = Vec::new();
    let mut start_periods = Vec::new();
    for (t, view) in tasks.iter().zip(views) {
        let state = t.status.as_ref().and_then(|s| s.state);
        if matches!(state, Some(TaskState::FAILED) | Some(TaskState::REJECTED)) {
            restarts += 1;
        }
        if t.desired_state == Some(TaskState::RUNNING)
            && matches!(
                state,
                Some(TaskState::NEW)
                    | Some(TaskState::ALLOCATED)
                    | Some(TaskState::PENDING)
                    | Some(TaskState::ASSIGNED)
                    | Some(TaskState::ACCEPTED)
                    | Some(TaskState::PREPARING)
                    | Some(TaskState::READY)
                    | Some(TaskState::STARTING)
            )
        {
            starting += 1;
        }
        if state != Some(TaskState::RUNNING) || t.desired_state != Some(TaskState::RUNNING) {
            continue;
        }
        let cid = t
            .status
            .as_ref()
            .and_then(|s| s.container_status.as_ref())
            .and_then(|c| c.container_id.clone());
        let raw_ip = t.id.as_ref().and_then(|id| raw_ips.get(id).cloned());
        if view.as_ref().and_then(|v| v.running) == Some(false) {
            // The container died; Swarm has not updated the task yet. Its address is gone.
            continue;
        }
        if let (Some(cid), Some(v)) = (&cid, &view)
            && !v.start_period.is_zero()
        {
            start_periods.push((cid.clone(), v.start_period));
        }
        let (local_ip, health) = view.map(|v| (v.ip, v.health)).unwrap_or((None, None));
        let ip = raw_ip.or(local_ip);
        if health.as_deref() == Some("unhealthy") {
            unhealthy = Some(format!(
                "docker health check failing (task {} of {name})",
                t.id.clone().unwrap_or_default()
            ));
            continue;
        }
        if health.as_deref() == Some("starting") {
            // Docker's health check has not passed yet (its start period, or its first
            // interval): not serving, and not sick either.
            starting += 1;
            continue;
        }
        running += 1;
        if let Some(addr) = ip.as_deref().and_then(|ip| task_url(ip, port)) {
            if let Some(cid) = &cid {
                containers.push((cid.clone(), addr.clone()));
            }
            addresses.push(addr);
        }
    }
    // A service deployed a moment ago may have no task at all yet: it is starting.
    if tasks.is_empty() && replicas.unwrap_or(1) > 0 {
        starting += 1;
    }
    let down = if running == 0 {
        Some(unhealthy.clone().unwrap_or_else(|| {
            if starting > 0 {
                format!("service {name} is starting")
            } else {
                format!("service {name} has no running task")
            }
        }))
    } else {
        None
    };
    Ok(Some(Found {
        endpoint,
        service_id: svc.id.clone(),
        discovered: Discovered {
            service: name,
            addresses,
            running,
            restarts,
            down,
        },
        labels,
        replicas,
        starting,
        health_failing: unhealthy.is_some(),
        containers,
        start_periods,
    }))
}

/// One scan: Swarm services (when the engine is a manager) and plain containers.
async fn scan(docker: &Docker, cfg: &DockerConfig) -> Result<Vec<Found>, bollard::errors::Error> {
    docker.ping().await?;
    let mut out = Vec::new();
    let mut filters = HashMap::new();
    filters.insert("label".to_string(), vec![LABEL_ENDPOINT.to_string()]);
    let services = match docker
        .list_services(Some(
            ListServicesOptionsBuilder::default()
                .filters(&filters)
                .build(),
        ))
        .await
    {
        Ok(services) => services,
        // Not a swarm manager ("This node is not a swarm manager", 503), or an engine without
        // Swarm's API at all (Podman's Docker-compatible socket: 404 or 501): no services,
        // which is fine.
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 503 | 404 | 501,
            ..
        }) => Vec::new(),
        // Anything else fails the scan: read as "no services", it would have taken every
        // Swarm-backed endpoint down while their tasks ran on.
        Err(e) => return Err(e),
    };
    // Services are looked at a few at a time: each costs a few engine calls (its tasks, their
    // addresses, each running task's container), and a scan in series grew with every service —
    // the time between a recovered backend's `healthy` event and its first request.
    let found: Vec<_> = stream::iter(
        services
            .into_iter()
            .map(|svc| scan_service(docker, cfg, svc)),
    )
    .buffered(ENGINE_CALLS_AT_ONCE)
    .collect()
    .await;
    for f in found {
        if let Some(f) = f? {
            out.push(f);
        }
    }
    // Plain containers (not Swarm tasks).
    let mut cf = HashMap::new();
    cf.insert("label".to_string(), vec![LABEL_ENDPOINT.to_string()]);
    let containers = docker
        .list_containers(Some(
            ListContainersOptionsBuilder::default()
                .all(true)
                .filters(&cf)
                .build(),
        ))
        .await?;
    for c in containers {
        let labels = c.labels.clone().unwrap_or_default();
        if labels.contains_key("com.docker.swarm.service.id") {
            continue;
        }
        let Some(endpoint) = labels.get(LABEL_ENDPOINT).cloned() else {
            continue;
        };
        if !in_stack(&labels, cfg) {
            continue;
        }
        let name = crate::discovery::engine::clip(
            c.names
                .as_deref()
                .and_then(<[String]>::first)
                .map(String::as_str)
                .unwrap_or_default()
                .trim_start_matches('/'),
        );
        let port = labels
            .get(LABEL_PORT)
            .and_then(|p| p.parse::<u16>().ok())
            .unwrap_or(8000);
        let id = c.id.clone().unwrap_or_default();
        let is_running = c.state.map(|s| s.to_string()) == Some("running".into());
        let ContainerView {
            ip,
            health,
            restarts,
            ..
        } = container_view(docker, &id, cfg.network.as_deref()).await;
        let down = if !is_running {
            Some(format!("container {name} is not running"))
        } else if health.as_deref() == Some("unhealthy") {
            Some(format!("docker health check failing (container {name})"))
        } else {
            None
        };
        let addresses = if down.is_none() {
            ip.as_deref()
                .and_then(|ip| task_url(ip, port))
                .into_iter()
                .collect()
        } else {
            vec![]
        };
        let containers = addresses.iter().map(|a| (id.clone(), a.clone())).collect();
        out.push(Found {
            endpoint,
            service_id: None,
            discovered: Discovered {
                service: name,
                running: usize::from(down.is_none()),
                addresses,
                restarts,
                down,
            },
            labels,
            replicas: None,
            starting: 0,
            health_failing: health.as_deref() == Some("unhealthy"),
            containers,
            // Plain containers are not remediated.
            start_periods: Vec::new(),
        });
    }
    Ok(out)
}

/// Task ID → address on `network` (or the first non-ingress network), read from the raw `/tasks`
/// JSON: the typed model lacks `NetworksAttachments`. Empty on any error (the caller falls back to
/// inspecting local containers).
async fn task_addresses(
    service: &str,
    network: Option<&str>,
    timeout: Duration,
) -> HashMap<String, String> {
    let filters =
        crate::discovery::engine::percent_encode(&json!({"service": [service]}).to_string());
    let Ok(Value::Array(tasks)) =
        engine("GET", &format!("/tasks?filters={filters}"), None, timeout).await
    else {
        return HashMap::new();
    };
    let mut out = HashMap::new();
    for t in tasks {
        let Some(id) = t.get("ID").and_then(Value::as_str) else {
            continue;
        };
        let atts = t
            .get("NetworksAttachments")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let pick = atts.iter().find(|a| {
            let name = a
                .pointer("/Network/Spec/Name")
                .and_then(Value::as_str)
                .unwrap_or("");
            match network {
                Some(n) => name == n,
                None => name != "ingress",
            }
        });
        let ip = pick
            .and_then(|a| a.get("Addresses"))
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .and_then(|cidr| cidr.split('/').next())
            .map(str::to_string);
        if let Some(ip) = ip {
            out.insert(id.to_string(), ip);
        }
    }
    out
}

/// Per-service remediation memory.
#[derive(Default, Debug)]
struct Remedy {
    unhealthy_streak: u32,
    healthy_since: Option<Instant>,
    last_action: Option<Instant>,
    standby_up: bool,
    /// When this gateway first saw each running task's container (those with a start period).
    first_seen: HashMap<String, Instant>,
}

/// Whether any of a service's running tasks is still within its health check's start period,
/// counted from when this gateway first saw it (a gateway started later waits the period out
/// again: its first observations are no evidence either). Forgets containers no longer running.
fn within_start_period(
    first_seen: &mut HashMap<String, Instant>,
    start_periods: &[(String, Duration)],
    now: Instant,
) -> bool {
    first_seen.retain(|cid, _| start_periods.iter().any(|(c, _)| c == cid));
    start_periods.iter().fold(false, |young, (cid, period)| {
        let seen = *first_seen.entry(cid.clone()).or_insert(now);
        young || now.saturating_duration_since(seen) < *period
    })
}

/// Records that remediation left `standby` up (or brought it back down), in memory and in the
/// audit database, so a gateway started later knows it is its to scale down.
fn remember_standby(state: &AppState, standby: &str, primary: &str, up: bool) {
    if let Ok(mut set) = state.standbys_up.lock() {
        if up {
            set.insert(standby.to_string());
        } else {
            set.remove(standby);
        }
    }
    state.store.send(Record::Standby {
        standby: standby.to_string(),
        primary: primary.to_string(),
        up,
    });
}

fn event(state: &AppState, endpoint: &str, ev: &str, reason: String) {
    tracing::info!(endpoint, event = ev, %reason, "docker event");
    state.alerts.endpoint_event(endpoint, ev, &reason);
    state.store.send(Record::Event(EndpointEvent {
        ts: SystemTime::now(),
        endpoint: endpoint.to_string(),
        event: ev.to_string(),
        reason,
    }));
}

/// A raw Engine API call ([`crate::discovery::engine::call`]: read bounded) under `timeout`. Service
/// updates go through raw JSON so the read-modify-write of a service spec keeps every field,
/// including ones a typed model does not know (a typed round trip dropped `--no-healthcheck`,
/// for one).
async fn engine(
    method: &str,
    path: &str,
    body: Option<Value>,
    timeout: Duration,
) -> Result<Value, String> {
    tokio::time::timeout(timeout, crate::discovery::engine::call(method, path, body))
        .await
        .map_err(|_| {
            format!(
                "docker_daemon_unreachable: no answer within {}ms",
                timeout.as_millis()
            )
        })?
}

/// The `com.docker.stack.namespace` label of the container this process runs in (Docker names a
/// container's host after its id): `Some(None)` when the engine says this is no stack's (or no
/// container of its), `None` when it could not be asked (try again next scan).
async fn learn_own_stack(timeout: Duration) -> Option<Option<String>> {
    let host = std::env::var("HOSTNAME").ok()?;
    if host.is_empty() || !host.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Some(None);
    }
    match engine("GET", &format!("/containers/{host}/json"), None, timeout).await {
        Ok(c) => Some(
            c.pointer("/Config/Labels")
                .and_then(|l| l.get(LABEL_STACK))
                .and_then(Value::as_str)
                .map(crate::discovery::engine::clip),
        ),
        Err(e) if e.contains("404") || e.contains("No such container") => Some(None),
        Err(_) => None,
    }
}

/// A standby's service as the config names it, or the same name in this stack (`service:
/// ollama-standby` finds `mystack_ollama-standby`), whichever the engine knows.
async fn stack_service(service: &str, stack: Option<&str>, timeout: Duration) -> String {
    if let Some(stack) = stack
        && !service.starts_with(&format!("{stack}_"))
        && engine("GET", &format!("/services/{service}"), None, timeout)
            .await
            .is_err()
    {
        return format!("{stack}_{service}");
    }
    service.to_string()
}

/// Reads a service's spec as raw JSON, lets `change` edit it, and posts it back at that version.
async fn update_spec(
    service: &str,
    timeout: Duration,
    change: impl FnOnce(&mut Value),
) -> Result<(), String> {
    let svc = engine("GET", &format!("/services/{service}"), None, timeout).await?;
    let version = svc
        .pointer("/Version/Index")
        .and_then(Value::as_u64)
        .ok_or("service has no version")?;
    let mut spec = svc.get("Spec").cloned().ok_or("service has no spec")?;
    change(&mut spec);
    engine(
        "POST",
        &format!("/services/{service}/update?version={version}"),
        Some(spec),
        timeout,
    )
    .await
    .map(|_| ())
}

async fn force_update(service: &str, timeout: Duration) -> Result<(), String> {
    update_spec(service, timeout, |spec| {
        let n = spec
            .pointer("/TaskTemplate/ForceUpdate")
            .and_then(Value::as_u64)
            .unwrap_or(0);
        spec["TaskTemplate"]["ForceUpdate"] = json!(n + 1);
    })
    .await
}

async fn scale(service: &str, replicas: i64, timeout: Duration) -> Result<(), String> {
    update_spec(service, timeout, |spec| {
        spec["Mode"]["Replicated"]["Replicas"] = json!(replicas);
    })
    .await
}

/// Runs the watcher until cancelled.
pub async fn run(state: Arc<AppState>, status: SharedStatus, cancel: CancellationToken) {
    let mut remedies: BTreeMap<String, Remedy> = BTreeMap::new();
    let mut was_reachable: Option<bool> = None;
    let (wake_tx, mut wake) = tokio::sync::mpsc::channel::<Wake>(EVENT_QUEUE);
    // After a container started or turned healthy: rescan every EAGER_RESCAN until every
    // labelled service has a running task again, for at most `docker.interval` (the rescan the
    // event sets off may still find the task not RUNNING).
    let mut eager_until: Option<Instant> = None;
    let mut all_running = true;
    // Owned here and stopped with the watcher (the token is a child of the gateway's).
    let stop = cancel.child_token();
    let _follower = FollowerGuard(
        stop.clone(),
        tokio::spawn(follow_events(state.clone(), wake_tx, stop)),
    );
    // Container id -> (endpoint, address) from the last scan.
    let mut by_container: HashMap<String, (String, String)> = HashMap::new();
    // The stack this gateway runs in, from its own container's `com.docker.stack.namespace`
    // label (the engine's word about our own container), when the config names none: `docker
    // stack deploy -c docker-compose.yml anyname` works without editing the config. `None` until
    // the engine answered; `Some(None)` outside a stack.
    let mut own_stack: Option<Option<String>> = None;
    loop {
        let cfg = state.config.load_full();
        let mut dcfg = cfg.docker.clone();
        if dcfg.enabled && dcfg.stack.is_none() {
            if own_stack.is_none() {
                own_stack = learn_own_stack(dcfg.timeout).await;
            }
            dcfg.stack = own_stack.clone().flatten();
        }
        if !dcfg.enabled {
            if let Ok(mut s) = status.lock() {
                s.enabled = false;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(5)) => continue,
            }
        }
        let scanned_at = Instant::now();
        let result = match crate::discovery::engine::docker() {
            Ok(d) => match tokio::time::timeout(dcfg.timeout, scan(&d, &dcfg)).await {
                Ok(Ok(found)) => Ok((d, found)),
                Ok(Err(e)) => Err(crate::discovery::engine::clip(
                    &crate::upstream::error_chain(&e),
                )),
                Err(_) => Err(format!("no answer within {}ms", dcfg.timeout.as_millis())),
            },
            Err(e) => Err(crate::discovery::engine::clip(&e.to_string())),
        };
        match result {
            Err(e) => {
                if was_reachable != Some(false) {
                    for name in cfg.endpoints.keys() {
                        event(
                            &state,
                            name,
                            "docker_daemon_unreachable",
                            format!(
                                "docker daemon unreachable: {e}; HTTP probing and routing carry on"
                            ),
                        );
                    }
                    state.alerts.raise(
                        crate::config::AlertEvent::DockerUnreachable,
                        None,
                        format!("docker daemon unreachable: {e}; HTTP probing and routing carry on with the last known addresses"),
                    );
                    tracing::warn!(error = %e, "docker_daemon_unreachable");
                }
                was_reachable = Some(false);
                if let Ok(mut s) = status.lock() {
                    s.enabled = true;
                    s.reachable = Some(false);
                    s.error = Some(e);
                    s.last_scan = Some(SystemTime::now());
                }
            }
            Ok((docker, found)) => {
                // (A standby scaled to 0 is not waited for.)
                all_running = found
                    .iter()
                    .filter(|f| f.replicas != Some(0))
                    .all(|f| f.discovered.running > 0);
                if was_reachable == Some(false) {
                    for name in cfg.endpoints.keys() {
                        event(
                            &state,
                            name,
                            "docker_daemon_reachable",
                            "docker daemon reachable again".into(),
                        );
                    }
                }
                was_reachable = Some(true);
                // Labelled services the file does not name become endpoints of their own.
                let mut wanted: Vec<crate::config::DiscoveredEndpoint> = Vec::new();
                for f in found.iter().filter(|_| dcfg.adopt_unconfigured) {
                    let synthetic = cfg.discovered_extra.contains(&f.endpoint);
                    if (synthetic || !cfg.endpoints.contains_key(&f.endpoint))
                        && !cfg.routes.contains_key(&f.endpoint)
                        && !wanted.iter().any(|w| w.name == f.endpoint)
                    {
                        let kind = match f.labels.get(LABEL_TYPE).map(String::as_str) {
                            Some("vllm") => EndpointKind::Vllm,
                            Some("ollama") => EndpointKind::Ollama,
                            _ => EndpointKind::Openai,
                        };
                        wanted.push(crate::config::DiscoveredEndpoint {
                            name: f.endpoint.clone(),
                            kind,
                            model: f.labels.get(LABEL_MODEL).cloned(),
                        });
                    }
                }
                wanted.sort_by(|a, b| a.name.cmp(&b.name));
                let changed = state
                    .discovered
                    .lock()
                    .map(|d| *d != wanted)
                    .unwrap_or(false);
                if changed {
                    let kinds: Vec<(String, EndpointKind)> =
                        wanted.iter().map(|w| (w.name.clone(), w.kind)).collect();
                    // Building a config is blocking work — `vault:` secrets are read over the
                    // network (up to `vault.timeout` a call), clients and TLS built — so it runs
                    // on the blocking pool, as a reload does: on a runtime worker it stalled
                    // every request queued there until Vault answered.
                    let st = state.clone();
                    let installed =
                        tokio::task::spawn_blocking(move || st.install_discovered(wanted))
                            .await
                            .unwrap_or_else(|e| {
                                Err(crate::config::ConfigError(format!(
                                    "the install task failed: {e}"
                                )))
                            });
                    match installed {
                        Ok(added) => {
                            for name in added {
                                let kind = kinds
                                    .iter()
                                    .find(|(n, _)| *n == name)
                                    .map(|(_, k)| *k)
                                    .unwrap_or(EndpointKind::Openai);
                                event(
                                    &state,
                                    &name,
                                    "discovered",
                                    format!(
                                        "labelled {LABEL_ENDPOINT}={name} ({kind}); added to the routing table"
                                    ),
                                );
                            }
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "discovered endpoints could not be added")
                        }
                    }
                }
                let cfg = state.config.load_full();
                by_container.clear();
                for (name, ep) in &cfg.endpoints {
                    if !ep.discover {
                        continue;
                    }
                    let mine: Vec<&Found> = found.iter().filter(|f| &f.endpoint == name).collect();
                    for f in &mine {
                        for (cid, addr) in &f.containers {
                            by_container.insert(
                                cid.clone(),
                                (name.clone(), format!("{addr}{}", task_path(ep.kind))),
                            );
                        }
                    }
                    let d = if mine.is_empty() {
                        Discovered {
                            service: String::new(),
                            addresses: vec![],
                            running: 0,
                            restarts: 0,
                            down: Some(format!(
                                "no service or container labelled {LABEL_ENDPOINT}={name}"
                            )),
                        }
                    } else {
                        let mut d = mine[0].discovered.clone();
                        for f in &mine[1..] {
                            d.addresses.extend(f.discovered.addresses.iter().cloned());
                            d.running += f.discovered.running;
                            d.restarts += f.discovered.restarts;
                            d.service = format!("{},{}", d.service, f.discovered.service);
                        }
                        if d.running > 0 {
                            d.down = None;
                        }
                        let path = task_path(ep.kind);
                        d.addresses = d.addresses.iter().map(|a| format!("{a}{path}")).collect();
                        d
                    };
                    state.registry.observe_docker(name, Some(d));
                }
                // The endpoints are known: a new gateway may serve (remediation can wait).
                state.startup.scanned();
                let actions = match tokio::time::timeout(
                    // Each engine call has its own bound; this bounds the round as a whole.
                    dcfg.timeout * 4,
                    remediate(&state, &cfg, dcfg.stack.as_deref(), &found, &mut remedies),
                )
                .await
                {
                    Ok(n) => n,
                    Err(_) => {
                        tracing::warn!("remediation round timed out (docker_daemon_unreachable?)");
                        0
                    }
                };
                drop(docker);
                if let Ok(mut s) = status.lock() {
                    s.enabled = true;
                    s.reachable = Some(true);
                    s.error = None;
                    s.last_scan = Some(SystemTime::now());
                    s.added = cfg.discovered_extra.clone();
                    s.actions += actions;
                }
            }
        }
        // A scan that failed is done too: the gateway serves on what it has (the bound would
        // let it anyway).
        state.startup.scanned();
        let eager = eager_until.is_some_and(|u| Instant::now() < u) && !all_running;
        if !eager {
            eager_until = None;
        }
        let pause = if eager { EAGER_RESCAN } else { dcfg.interval };
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
            Some(ev) = wake.recv() => {
                // A burst of events (die, stop, kill) makes one scan, and a host whose containers
                // come and go all the time (a CI runner beside the backends, or an engine that
                // floods) one every EVENT_RESCAN_GAP at most. A dead container's address leaves
                // the pool as its event arrives, before the rescan confirms.
                let gap = if matches!(ev, Wake::Healthy) { EAGER_RESCAN } else { EVENT_RESCAN_GAP };
                let until = (Instant::now() + EVENT_COALESCE).max(scanned_at + gap);
                let mut next = Some(ev);
                while let Some(ev) = next.take() {
                    match ev {
                        Wake::Died(cid) => {
                            if let Some((endpoint, addr)) = by_container.remove(&cid) {
                                state.registry.drop_address(&endpoint, &addr, &format!(
                                    "container {} of the task died", cid.chars().take(12).collect::<String>()
                                ));
                            }
                        }
                        Wake::Up | Wake::Healthy => {
                            eager_until = Some(Instant::now() + dcfg.interval)
                        }
                        Wake::Changed => {}
                    }
                    if let Ok(Some(more)) = tokio::time::timeout_at(until, wake.recv()).await {
                        next = Some(more);
                    }
                }
            }
        }
    }
}

/// Stops the event follower when the watcher returns.
struct FollowerGuard(CancellationToken, tokio::task::JoinHandle<()>);

impl Drop for FollowerGuard {
    fn drop(&mut self) {
        self.0.cancel();
        self.1.abort();
    }
}

/// Follows the engine's event stream ([`crate::discovery::engine::events`]: read bounded) and wakes the
/// watcher on container events that move or sicken an endpoint. Reconnects after errors; idle
/// while Docker is off in the config.
async fn follow_events(
    state: Arc<AppState>,
    wake: tokio::sync::mpsc::Sender<Wake>,
    cancel: CancellationToken,
) {
    let filters = json!({"type": ["container"], "event": WAKE_EVENTS});
    loop {
        if state.config.load().docker.enabled {
            let opened = tokio::select! {
                _ = cancel.cancelled() => return,
                opened = crate::discovery::engine::events(&filters) => opened,
            };
            if let Ok(events) = opened {
                let mut events = std::pin::pin!(events);
                loop {
                    tokio::select! {
                        _ = cancel.cancelled() => return,
                        ev = events.next() => match ev {
                            Some(Ok(ev)) => {
                                let action = ev.action.as_deref().unwrap_or("");
                                let id = ev.actor.and_then(|a| a.id);
                                let w = match id {
                                    Some(id) if DEATH_EVENTS.contains(&action) => Wake::Died(id),
                                    _ if action == "health_status: healthy" => Wake::Healthy,
                                    _ if UP_EVENTS.contains(&action) => Wake::Up,
                                    _ => Wake::Changed,
                                };
                                // A full queue already holds a wake-up; the rescan finds the rest.
                                let _ = wake.try_send(w);
                            }
                            Some(Err(e)) => {
                                tracing::debug!(error = %crate::discovery::engine::clip(&e), "docker event stream ended");
                                break;
                            }
                            None => break,
                        },
                    }
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(EVENTS_RECONNECT) => {}
        }
    }
}

/// Carries out one remediation action (or, in dry-run, only records it) and records it as an
/// `endpoint_events` row with its reason and result. Returns whether it took effect (a dry run
/// counts, so its bookkeeping advances the same way).
async fn act(
    state: &AppState,
    endpoint: &str,
    dry_run: bool,
    event_name: &str,
    what: String,
    reason: &str,
    action: impl std::future::Future<Output = Result<(), String>>,
) -> bool {
    if dry_run {
        let detail = format!("would {what}: {reason}");
        state.alerts.raise(
            crate::config::AlertEvent::Remediation,
            Some(endpoint),
            format!("(dry run) {detail}"),
        );
        event(state, endpoint, "remediation_dry_run", detail);
        return true;
    }
    let res = action.await;
    let ok = res.is_ok();
    state.alerts.raise(
        crate::config::AlertEvent::Remediation,
        Some(endpoint),
        format!(
            "{what}: {reason}; result: {}",
            res.as_ref().err().map(String::as_str).unwrap_or("ok")
        ),
    );
    event(
        state,
        endpoint,
        event_name,
        format!(
            "{what}: {reason}; result: {}",
            res.err().unwrap_or_else(|| "ok".into())
        ),
    );
    ok
}

/// One remediation round. Returns the number of actions taken (or, in dry-run, proposed).
async fn remediate(
    state: &AppState,
    cfg: &crate::config::Config,
    stack: Option<&str>,
    found: &[Found],
    remedies: &mut BTreeMap<String, Remedy>,
) -> u64 {
    let r = &cfg.docker.remediation;
    if !r.enabled {
        return 0;
    }
    let now = Instant::now();
    let mut actions = 0;
    for f in found {
        let Some(ep) = cfg.endpoints.get(&f.endpoint) else {
            continue;
        };
        let svc = f.discovered.service.clone();
        let managed = f.labels.get(LABEL_MANAGE).map(String::as_str) == Some("true")
            || r.manage.contains(&svc);
        // Standbys are acted on through their primary, not for their own health.
        let is_standby = r.standby.iter().any(|s| {
            s.service == svc || stack.is_some_and(|st| svc == format!("{st}_{}", s.service))
        });
        if !managed || f.service_id.is_none() || is_standby {
            continue;
        }
        // Only the service's own evidence: its tasks down or failing Docker's health check, or
        // probes of its current addresses failing. Warming, half-open and passive ejection are
        // not evidence (a restart warms; an old task's connect errors eject).
        // A service whose tasks are all still starting (no task yet, or Docker's health check
        // still `starting`) is not sick: its first minute is no evidence.
        let probe_says = state.registry.probe_unhealthy(&ep.name);
        let only_starting = f.discovered.running == 0 && f.starting > 0 && !f.health_failing;
        let evidence = (f.discovered.down.is_some() && !only_starting) || probe_says.is_some();
        let standby = r.standby.iter().find(|s| s.primary == ep.name);
        let m = remedies.entry(svc.clone()).or_insert_with(|| Remedy {
            // A standby an earlier run of the gateway scaled up is still up: this one scales it
            // back down when the primary has been healthy long enough.
            standby_up: standby.is_some_and(|sb| {
                state
                    .standbys_up
                    .lock()
                    .is_ok_and(|up| up.contains(&sb.service))
            }),
            ..Remedy::default()
        });
        // Nor is a task within its health check's start period (a model still loading). Either
        // way the round is no observation at all, not a healthy one: a standby stays up while
        // its restarted primary is still starting.
        let young = within_start_period(&mut m.first_seen, &f.start_periods, now);
        if (only_starting && probe_says.is_none()) || (evidence && young) {
            continue;
        }
        let unhealthy = evidence;
        if unhealthy {
            m.unhealthy_streak += 1;
            m.healthy_since = None;
        } else {
            m.unhealthy_streak = 0;
            m.healthy_since.get_or_insert(now);
        }
        let reason = format!(
            "{} consecutive unhealthy observations ({})",
            m.unhealthy_streak,
            f.discovered.down.clone().or(probe_says).unwrap_or_default()
        );
        if unhealthy && m.unhealthy_streak >= r.unhealthy_after {
            // The standby comes up whenever the primary is down, whatever the cause.
            if let Some(sb) = standby
                && !m.standby_up
            {
                actions += 1;
                m.standby_up = act(
                    state,
                    &ep.name,
                    r.dry_run,
                    "remediation_scale_up",
                    format!("scale standby {} 0 -> 1", sb.service),
                    &reason,
                    scale(
                        &stack_service(&sb.service, stack, cfg.docker.timeout).await,
                        1,
                        cfg.docker.timeout,
                    ),
                )
                .await;
                if m.standby_up && !r.dry_run {
                    remember_standby(state, &sb.service, &ep.name, true);
                }
            }
            // A restart helps a task that runs but is sick. With no running task Swarm is already
            // rescheduling it; restarting then would only interrupt its start.
            let allowed = m
                .last_action
                .is_none_or(|t| now.duration_since(t) >= r.min_interval);
            if f.discovered.running > 0 && f.starting == 0 && f.replicas.unwrap_or(1) > 0 && allowed
            {
                m.last_action = Some(now);
                m.unhealthy_streak = 0;
                actions += 1;
                act(
                    state,
                    &ep.name,
                    r.dry_run,
                    "remediation_restart",
                    format!("force-update (restart) service {svc}"),
                    &reason,
                    force_update(&svc, cfg.docker.timeout),
                )
                .await;
            }
        }
        if let (Some(sb), Some(since)) = (standby, m.healthy_since)
            && m.standby_up
            && now.duration_since(since) >= sb.healthy_for
        {
            actions += 1;
            let down = act(
                state,
                &ep.name,
                r.dry_run,
                "remediation_scale_down",
                format!("scale standby {} 1 -> 0", sb.service),
                &format!("primary healthy for {}s", sb.healthy_for.as_secs()),
                scale(
                    &stack_service(&sb.service, stack, cfg.docker.timeout).await,
                    0,
                    cfg.docker.timeout,
                ),
            )
            .await;
            if down {
                m.standby_up = false;
                if !r.dry_run {
                    remember_standby(state, &sb.service, &ep.name, false);
                }
            }
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_within_its_start_period_is_no_evidence() {
        let mut seen = HashMap::new();
        let t0 = Instant::now();
        let periods = vec![("c1".to_string(), Duration::from_secs(30))];
        assert!(within_start_period(&mut seen, &periods, t0));
        assert!(within_start_period(
            &mut seen,
            &periods,
            t0 + Duration::from_secs(29)
        ));
        // Counted from when it was first seen, not from each look.
        assert!(!within_start_period(
            &mut seen,
            &periods,
            t0 + Duration::from_secs(30)
        ));
        // A replacement task starts its own period; the old one is forgotten.
        let t1 = t0 + Duration::from_secs(40);
        let replaced = vec![("c2".to_string(), Duration::from_secs(30))];
        assert!(within_start_period(&mut seen, &replaced, t1));
        assert_eq!(seen.keys().collect::<Vec<_>>(), ["c2"]);
        // One young task among old ones holds the service's evidence.
        let both = vec![
            ("c2".to_string(), Duration::from_secs(30)),
            ("c3".to_string(), Duration::from_secs(30)),
        ];
        assert!(within_start_period(
            &mut seen,
            &both,
            t1 + Duration::from_secs(31)
        ));
        assert!(!within_start_period(
            &mut seen,
            &both,
            t1 + Duration::from_secs(62)
        ));
        // No start period: never young.
        assert!(!within_start_period(&mut seen, &[], t1));
    }

    #[test]
    fn only_an_ip_address_from_the_engine_becomes_a_task_url() {
        assert_eq!(
            task_url("10.0.1.7", 8000).as_deref(),
            Some("http://10.0.1.7:8000")
        );
        // IPv6 (an overlay network with IPv6 on): bracketed, or the port would read as part of it.
        assert_eq!(
            task_url("fd00::1:7", 8000).as_deref(),
            Some("http://[fd00::1:7]:8000")
        );
        for hostile in [
            "evil.example",
            "10.0.1.7/steal",
            "user@10.0.1.7",
            "10.0.1.7:1@evil.example",
            "10.0.1.7#",
            " 10.0.1.7",
            "",
        ] {
            assert_eq!(task_url(hostile, 8000), None, "{hostile:?}");
        }
    }

    use proptest::strategy::Strategy as _;

    proptest::proptest! {
        /// Whatever the engine says, a task URL is `http://`, an IP literal and the port —
        /// never a host name, a path or credentials.
        #[test]
        fn a_task_url_is_an_ip_and_a_port(
            raw in proptest::prop_oneof![
                "\\PC{0,40}",
                proptest::arbitrary::any::<std::net::IpAddr>().prop_map(|ip| ip.to_string()),
                (proptest::arbitrary::any::<std::net::IpAddr>(), "[/@:#?a-z. \\]\\[]{1,6}")
                    .prop_map(|(ip, s)| format!("{ip}{s}")),
                ("[/@:#?a-z. \\]\\[]{1,6}", proptest::arbitrary::any::<std::net::IpAddr>())
                    .prop_map(|(s, ip)| format!("{s}{ip}")),
            ],
            port in 1u16..,
        ) {
            if let Some(u) = task_url(&raw, port) {
                let parsed = reqwest::Url::parse(&u).unwrap();
                proptest::prop_assert_eq!(parsed.scheme(), "http");
                let host = parsed.host_str().unwrap_or("");
                let bare = host.trim_start_matches('[').trim_end_matches(']');
                proptest::prop_assert!(bare.parse::<std::net::IpAddr>().is_ok(), "{}", u);
                proptest::prop_assert_eq!(parsed.port_or_known_default(), Some(port));
                proptest::prop_assert_eq!(parsed.path(), "/");
                proptest::prop_assert_eq!(parsed.username(), "");
            }
        }
    }
}
