//! The bodies a request's audit row keeps (`audit.capture_bodies`, for `autohedge replay`):
//! the client's request as it came (before any truncation) and the answer it got — a full body,
//! or a committed stream's bytes as sent — attached to the row when the mode wants it
//! ([`bodies::wanted`]), redacted and cut ([`bodies::kept_text`]), and held in memory only
//! within the shared [`bodies::Budget`].

use std::sync::Arc;

use crate::config::{CaptureBodies, Config, Secret};
use crate::state::AppState;
use crate::store::RequestRow;
use crate::store::bodies::{self, Bodies};
use crate::wire::Inbound;

pub(super) struct Audit {
    mode: CaptureBodies,
    max: usize,
    /// The request as the client sent it (shared with the run until truncation copies it).
    request: Arc<Inbound>,
    /// A stream's bytes as the client got them, up to `max`.
    sent: Vec<u8>,
    sent_cut: bool,
}

impl Audit {
    /// `None` unless `audit.capture_bodies` keeps something.
    pub(super) fn of(cfg: &Config, request: &Arc<Inbound>) -> Option<Box<Audit>> {
        (cfg.capture_bodies != CaptureBodies::None).then(|| {
            Box::new(Audit {
                mode: cfg.capture_bodies,
                max: cfg.capture_max_bytes,
                request: request.clone(),
                sent: Vec::new(),
                sent_cut: false,
            })
        })
    }

    /// A stream's next bytes to the client.
    pub(super) fn push(&mut self, b: &[u8]) {
        let room = self.max.saturating_sub(self.sent.len());
        if b.len() > room {
            self.sent_cut = true;
        }
        self.sent.extend_from_slice(&b[..b.len().min(room)]);
    }

    /// Attaches the bodies to `row` when the mode keeps it and the budget has room; `response`:
    /// a full answer (else what [`Audit::push`] gathered, if anything). `own_key`: the request's
    /// own upstream key, never kept either.
    pub(super) fn attach(
        self,
        app: &AppState,
        cfg: &Config,
        row: &mut RequestRow,
        response: Option<&[u8]>,
        own_key: Option<&Secret>,
    ) {
        if !bodies::wanted(self.mode, row) {
            return;
        }
        let mut secrets: Vec<&str> = cfg
            .endpoints
            .values()
            .flat_map(|ep| ep.secret_values())
            .collect();
        if let Some(k) = own_key {
            secrets.push(k.expose());
        }
        let raw: std::borrow::Cow<[u8]> = match self.request.raw() {
            Some(raw) => raw.into(),
            None => serde_json::to_vec(self.request.body())
                .unwrap_or_default()
                .into(),
        };
        let (request, request_cut) = bodies::kept_text(&raw, &secrets, self.max);
        let (response, response_cut) = match response {
            Some(r) => {
                let (t, cut) = bodies::kept_text(r, &secrets, self.max);
                (Some(t), cut)
            }
            None if !self.sent.is_empty() => {
                let (t, cut) = bodies::kept_text(&self.sent, &secrets, self.max);
                (Some(t), cut || self.sent_cut)
            }
            None => (None, false),
        };
        let mut kept = Bodies::stored(request, request_cut, response, response_cut);
        let shared = cfg.auth.keys.as_ref().is_some_and(|k| k.len() > 1);
        match app.bodies.charge(
            row.client_key.as_deref(),
            kept.bytes() as u64,
            shared,
            bodies::held_max_bytes(self.max),
        ) {
            Some(charge) => {
                kept.charge = Some(charge);
                row.bodies = Some(Box::new(kept));
            }
            None => {
                metrics::counter!("autohedge_audit_bodies_dropped_total").increment(1);
            }
        }
    }
}
