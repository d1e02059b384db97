//! Webhook alerts (`alerts:`): what an on-call engineer must act on — an endpoint retired, a
//! key rejected, an endpoint gone unhealthy, a burst of 503s, audit records dropped, a config
//! reload refused, the Docker engine unreachable, a remediation carried out.
//!
//! Raising an alert is a `try_send` on a bounded channel: nothing on the request path waits for
//! it, and a full channel drops the alert with a counter. One background task owns the policy:
//! the events the config selects, deduplication per event and endpoint (`repeat`, default 5 m;
//! what was held back is counted into the next message), the `all_failed` window, and delivery —
//! each message posted to every webhook by a task of its own, retried with exponential backoff
//! on connection errors, 429 and 5xx (a 4xx other than 429 is final), at most
//! `MAX_DELIVERIES` in flight. Webhook URLs are secrets: logs name only their scheme and host.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{AlertEvent, Webhook, WebhookFormat};

/// Alerts waiting for the task; more are dropped (and counted).
const QUEUE: usize = 1024;
/// Deliveries (one message to one webhook, retries included) in flight at once.
const MAX_DELIVERIES: usize = 32;
/// Attempts per delivery: 1 s, 2 s, 4 s, 8 s apart (plus jitter).
const DELIVERY_ATTEMPTS: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const POST_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the task looks at counters no one pushes (audit records dropped).
const TICK: Duration = Duration::from_secs(1);

/// One thing that happened.
#[derive(Clone, Debug)]
pub struct Alert {
    pub event: AlertEvent,
    pub endpoint: Option<String>,
    pub detail: String,
    pub at: SystemTime,
}

pub enum Signal {
    Alert(Alert),
    /// A request was answered 503 (for `all_failed`).
    Unavailable,
}

/// The sending side, cloned into whatever raises alerts. Never blocks.
#[derive(Clone)]
pub struct Alerts {
    tx: mpsc::Sender<Signal>,
    dropped: Arc<AtomicU64>,
}

impl Alerts {
    pub fn channel() -> (Alerts, mpsc::Receiver<Signal>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        (
            Alerts {
                tx,
                dropped: Arc::new(AtomicU64::new(0)),
            },
            rx,
        )
    }

    pub fn raise(&self, event: AlertEvent, endpoint: Option<&str>, detail: impl Into<String>) {
        self.send(Signal::Alert(Alert {
            event,
            endpoint: endpoint.map(str::to_string),
            detail: detail.into(),
            at: SystemTime::now(),
        }));
    }

    pub fn unavailable(&self) {
        self.send(Signal::Unavailable);
    }

    fn send(&self, s: Signal) {
        if self.tx.try_send(s).is_err() {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Alerts lost to a full queue (or after the task stopped).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The alert an endpoint event (an `endpoint_events` row) implies, if any. (The Docker
    /// engine going away is one alert for the gateway, raised by discovery itself, not one per
    /// endpoint.)
    pub fn endpoint_event(&self, endpoint: &str, event: &str, reason: &str) {
        let kind = match event {
            "retired" => AlertEvent::EndpointRetired,
            "key_rejected" | "auth_failed" => AlertEvent::EndpointAuthFailed,
            e if e.starts_with("health:") && e.ends_with("->unhealthy") => {
                AlertEvent::EndpointUnhealthy
            }
            "kv_cache_purge" => AlertEvent::Remediation,
            _ => return,
        };
        self.raise(kind, Some(endpoint), reason);
    }
}

/// Per event and endpoint, at most one message per `repeat`; the ones held back are counted
/// into the next. Pure: the clock is passed in.
#[derive(Default)]
pub struct Dedupe {
    last: HashMap<(AlertEvent, Option<String>), (Instant, u64)>,
}

impl Dedupe {
    /// `Some(n)`: send now, with `n` similar alerts held back since the last one.
    pub fn admit(&mut self, a: &Alert, repeat: Duration, now: Instant) -> Option<u64> {
        let key = (a.event, a.endpoint.clone());
        match self.last.get_mut(&key) {
            Some((sent, held)) if now.saturating_duration_since(*sent) < repeat => {
                *held += 1;
                None
            }
            Some((sent, held)) => {
                let n = *held;
                *sent = now;
                *held = 0;
                Some(n)
            }
            None => {
                self.last.insert(key, (now, 0));
                Some(0)
            }
        }
    }
}

/// 503s within a sliding window. Pure: the clock is passed in.
#[derive(Default)]
pub struct FailWindow {
    at: VecDeque<Instant>,
}

impl FailWindow {
    /// Records one 503; `Some(n)` when more than `count` fell within `window`.
    pub fn hit(&mut self, count: u64, window: Duration, now: Instant) -> Option<usize> {
        self.at.push_back(now);
        while self
            .at
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) > window)
        {
            self.at.pop_front();
        }
        // Bounded: only `count + 1` entries matter.
        while self.at.len() as u64 > count.saturating_add(1) {
            self.at.pop_front();
        }
        (self.at.len() as u64 > count).then_some(self.at.len())
    }
}

/// The message body for one webhook.
pub fn payload(format: WebhookFormat, a: &Alert, held_back: u64, gateway: &str) -> Value {
    let at_ms =
        a.at.duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
    match format {
        WebhookFormat::Json => json!({
            "source": "autohedge",
            "gateway": gateway,
            "event": a.event.as_str(),
            "endpoint": a.endpoint,
            "detail": a.detail,
            "at_unix_ms": at_ms,
            "suppressed_since_last": held_back,
        }),
        WebhookFormat::Slack => {
            let what = match &a.endpoint {
                Some(e) => format!("`{}` on endpoint `{}`", a.event.as_str(), slack_escape(e)),
                None => format!("`{}`", a.event.as_str()),
            };
            let more = if held_back > 0 {
                format!(" ({held_back} more since the last message)")
            } else {
                String::new()
            };
            json!({
                "text": format!(
                    ":rotating_light: AutoHedge {}: {what}{more}\n{}",
                    slack_escape(gateway),
                    slack_escape(&a.detail)
                ),
            })
        }
    }
}

/// Slack's three control characters in message text.
fn slack_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// What the alert task reads of the gateway, now and then: its live config and the audit
/// trail's drop counter. `AppState` provides it; the task reaches into nothing else.
pub trait Source: Send + Sync + 'static {
    fn config(&self) -> Arc<crate::config::Config>;
    fn audit_dropped(&self) -> u64;
}

/// The alert task: filters, deduplicates and delivers. Stops on `cancel` (deliveries in
/// flight are given up: they are retries of something already attempted).
pub async fn run<S: Source>(
    state: Arc<S>,
    mut rx: mpsc::Receiver<Signal>,
    cancel: CancellationToken,
) {
    let client = match reqwest::Client::builder()
        .timeout(POST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "alerts: no HTTP client; alerts are off");
            return;
        }
    };
    let gateway = gateway_name(&state.config());
    let mut dedupe = Dedupe::default();
    let mut fails = FailWindow::default();
    let mut deliveries: JoinSet<()> = JoinSet::new();
    let mut audit_dropped = state.audit_dropped();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let signal = tokio::select! {
            _ = cancel.cancelled() => break,
            s = rx.recv() => match s {
                Some(s) => s,
                None => break,
            },
            _ = tick.tick() => {
                while deliveries.try_join_next().is_some() {}
                let now = state.audit_dropped();
                if now > audit_dropped {
                    let n = now - audit_dropped;
                    audit_dropped = now;
                    Signal::Alert(Alert {
                        event: AlertEvent::AuditDropped,
                        endpoint: None,
                        detail: format!("{n} audit records dropped (queue full or the database failing); {now} in all"),
                        at: SystemTime::now(),
                    })
                } else {
                    continue;
                }
            }
        };
        let cfg = state.config();
        let Some(settings) = cfg.alerts.as_ref() else {
            continue;
        };
        let alert = match signal {
            Signal::Alert(a) => a,
            Signal::Unavailable => {
                match fails.hit(
                    settings.all_failed_count,
                    settings.all_failed_window,
                    Instant::now(),
                ) {
                    Some(n) => Alert {
                        event: AlertEvent::AllFailed,
                        endpoint: None,
                        detail: format!(
                            "{n} requests were answered 503 (no endpoint could serve them) within {}s",
                            settings.all_failed_window.as_secs_f64()
                        ),
                        at: SystemTime::now(),
                    },
                    None => continue,
                }
            }
        };
        if !settings.events.contains(&alert.event) || settings.webhooks.is_empty() {
            continue;
        }
        let Some(held) = dedupe.admit(&alert, settings.repeat, Instant::now()) else {
            continue;
        };
        for hook in &settings.webhooks {
            if deliveries.len() >= MAX_DELIVERIES {
                while deliveries.try_join_next().is_some() {}
            }
            if deliveries.len() >= MAX_DELIVERIES {
                tracing::warn!(event = alert.event.as_str(), webhook = %hook.label, "alerts: too many deliveries in flight; alert dropped");
                continue;
            }
            let body = payload(hook.format, &alert, held, &gateway);
            deliveries.spawn(deliver(client.clone(), hook.clone(), body, alert.event));
        }
    }
    deliveries.abort_all();
}

/// Posts one message, retrying with backoff.
async fn deliver(client: reqwest::Client, hook: Webhook, body: Value, event: AlertEvent) {
    let mut backoff = FIRST_BACKOFF;
    for attempt in 1..=DELIVERY_ATTEMPTS {
        let res = client.post(hook.url.expose()).json(&body).send().await;
        let retry = match res {
            Ok(r) if r.status().is_success() => {
                tracing::info!(event = event.as_str(), webhook = %hook.label, "alert sent");
                return;
            }
            Ok(r) => {
                let s = r.status();
                tracing::warn!(event = event.as_str(), webhook = %hook.label, status = s.as_u16(), attempt, "alert webhook refused the message");
                s.as_u16() == 429 || s.is_server_error()
            }
            // reqwest's error text can carry the URL: only its kind is logged.
            Err(e) => {
                let kind = if e.is_timeout() {
                    "timeout"
                } else if e.is_connect() {
                    "connect"
                } else {
                    "request"
                };
                tracing::warn!(event = event.as_str(), webhook = %hook.label, error = kind, attempt, "alert webhook unreachable");
                true
            }
        };
        if !retry || attempt == DELIVERY_ATTEMPTS {
            break;
        }
        tokio::time::sleep(backoff + backoff.mul_f64(fastrand::f64() * 0.2)).await;
        backoff *= 2;
    }
    tracing::error!(event = event.as_str(), webhook = %hook.label, "alert not delivered");
}

/// What the messages call this gateway: `$HOSTNAME` (a container's id in Swarm) and the listen
/// address.
fn gateway_name(cfg: &crate::config::Config) -> String {
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "autohedge".into());
    format!("{host} ({})", cfg.listen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(event: AlertEvent, ep: Option<&str>) -> Alert {
        Alert {
            event,
            endpoint: ep.map(str::to_string),
            detail: "d".into(),
            at: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn dedupe_is_per_event_and_endpoint_and_counts_what_it_held() {
        let mut d = Dedupe::default();
        let t0 = Instant::now();
        let r = Duration::from_secs(60);
        let a = alert(AlertEvent::EndpointRetired, Some("a"));
        assert_eq!(d.admit(&a, r, t0), Some(0));
        assert_eq!(d.admit(&a, r, t0 + Duration::from_secs(1)), None);
        assert_eq!(d.admit(&a, r, t0 + Duration::from_secs(2)), None);
        // Another endpoint, another event: their own.
        let b = alert(AlertEvent::EndpointRetired, Some("b"));
        assert_eq!(d.admit(&b, r, t0 + Duration::from_secs(2)), Some(0));
        let c = alert(AlertEvent::EndpointUnhealthy, Some("a"));
        assert_eq!(d.admit(&c, r, t0 + Duration::from_secs(2)), Some(0));
        // After `repeat`: sent, with the two held back.
        assert_eq!(d.admit(&a, r, t0 + Duration::from_secs(61)), Some(2));
        assert_eq!(d.admit(&a, r, t0 + Duration::from_secs(62)), None);
    }

    #[test]
    fn all_failed_fires_above_count_within_the_window_only() {
        let mut w = FailWindow::default();
        let t0 = Instant::now();
        let win = Duration::from_secs(60);
        for i in 0..3 {
            assert_eq!(w.hit(3, win, t0 + Duration::from_secs(i)), None);
        }
        assert_eq!(w.hit(3, win, t0 + Duration::from_secs(3)), Some(4));
        // Spread out: never more than 3 within a minute.
        let mut w = FailWindow::default();
        for i in 0..20 {
            assert_eq!(w.hit(3, win, t0 + Duration::from_secs(i * 21)), None);
        }
    }

    #[test]
    fn endpoint_events_map_to_alerts() {
        let (a, mut rx) = Alerts::channel();
        a.endpoint_event("x", "health:healthy->unhealthy", "probe failed");
        a.endpoint_event("x", "health:unhealthy->healthy", "probe ok");
        a.endpoint_event("x", "cooldown", "429");
        a.endpoint_event("x", "key_rejected", "401");
        let mut got = vec![];
        while let Ok(Signal::Alert(s)) = rx.try_recv() {
            got.push(s.event);
        }
        assert_eq!(
            got,
            vec![
                AlertEvent::EndpointUnhealthy,
                AlertEvent::EndpointAuthFailed
            ]
        );
    }

    #[test]
    fn slack_text_escapes_and_json_carries_the_fields() {
        let mut a = alert(AlertEvent::EndpointRetired, Some("<a>"));
        a.detail = "410 & gone".into();
        let s = payload(WebhookFormat::Slack, &a, 2, "gw");
        let text = s["text"].as_str().unwrap();
        assert!(
            text.contains("`endpoint_retired` on endpoint `&lt;a&gt;`"),
            "{text}"
        );
        assert!(
            text.contains("410 &amp; gone") && text.contains("2 more"),
            "{text}"
        );
        let j = payload(WebhookFormat::Json, &a, 0, "gw");
        assert_eq!(j["event"], "endpoint_retired");
        assert_eq!(j["endpoint"], "<a>");
        assert_eq!(j["detail"], "410 & gone");
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let (a, _rx) = Alerts::channel();
        for _ in 0..QUEUE + 5 {
            a.unavailable();
        }
        assert_eq!(a.dropped(), 5);
    }
}
