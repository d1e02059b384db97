//! The bodies a request's audit row keeps (`audit.capture_bodies`, for `autohedge replay`):
//! the client's request as it came (before truncation, and before a `/v1/responses`
//! conversation was joined to it) and the answer it got — a full body, or a committed stream's
//! bytes as sent — attached to the row when the mode wants it ([`bodies::wanted`]), redacted and
//! cut ([`bodies::kept_text`]). Memory: a stream's bytes are charged to the shared
//! [`bodies::Budget`] as they are gathered (past it the answer is kept cut), the kept bodies
//! until the writer has them.

use std::sync::Arc;

use crate::config::{CaptureBodies, Config, Secret};
use crate::state::AppState;
use crate::store::RequestRow;
use crate::store::bodies::{self, Bodies, Charge};
use crate::wire::Inbound;

/// What the front door hands over for the capture, when `audit.capture_bodies` is on.
pub struct CaptureIn {
    /// The request as the client sent it, when the front door changed it before the executor
    /// (a `/v1/responses` continuation).
    pub original: Option<Inbound>,
    /// The client key as presented: never kept either.
    pub presented: Option<Secret>,
}

pub(super) struct Audit {
    mode: CaptureBodies,
    max: usize,
    /// The request as the client sent it (shared with the run until truncation copies it).
    request: Arc<Inbound>,
    /// The request carried its own upstream key (`x-encrypted-key`).
    own_key: bool,
    presented: Option<Secret>,
    /// Whose bytes these are, and whether the gateway has several keys (a key's half).
    client: Option<String>,
    shared: bool,
    /// A stream's bytes as the client got them, up to `max`, and their hold on the budget.
    sent: Vec<u8>,
    sent_cut: bool,
    sent_charge: Option<Charge>,
}

impl Audit {
    /// `None` unless `audit.capture_bodies` keeps something.
    pub(super) fn of(
        cfg: &Config,
        request: &Arc<Inbound>,
        own_key: bool,
        client: Option<&str>,
        given: Option<Box<CaptureIn>>,
    ) -> Option<Box<Audit>> {
        if cfg.capture_bodies == CaptureBodies::None {
            return None;
        }
        let (original, presented) = given.map_or((None, None), |g| {
            let g = *g;
            (g.original, g.presented)
        });
        Some(Box::new(Audit {
            mode: cfg.capture_bodies,
            max: cfg.capture_max_bytes,
            request: original.map_or_else(|| request.clone(), Arc::new),
            own_key,
            presented,
            client: client.map(str::to_string),
            shared: cfg.auth.keys.as_ref().is_some_and(|k| k.len() > 1),
            sent: Vec::new(),
            sent_cut: false,
            sent_charge: None,
        }))
    }

    /// A stream's next bytes to the client: kept while they are within `max` and the budget.
    pub(super) fn push(&mut self, app: &AppState, b: &[u8]) {
        if self.sent_cut {
            return;
        }
        let room = self.max.saturating_sub(self.sent.len());
        let take = b.len().min(room);
        if take > 0 {
            let limit = bodies::held_max_bytes(self.max);
            match app
                .bodies
                .charge(self.client.as_deref(), take as u64, self.shared, limit)
            {
                Some(c) => {
                    match &mut self.sent_charge {
                        Some(held) => held.absorb(c),
                        None => self.sent_charge = Some(c),
                    }
                    self.sent.extend_from_slice(&b[..take]);
                }
                None => {
                    self.sent_cut = true;
                    return;
                }
            }
        }
        if take < b.len() {
            self.sent_cut = true;
        }
    }

    /// Attaches the bodies to `row` when the mode keeps it and the budget has room; `response`:
    /// a full answer (else what [`Audit::push`] gathered, if anything). `own_key`: the request's
    /// own upstream key, never kept either.
    pub(super) fn attach(
        mut self,
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
        secrets.extend(own_key.map(Secret::expose));
        secrets.extend(self.presented.as_ref().map(Secret::expose));
        let raw: std::borrow::Cow<[u8]> = match self.request.raw() {
            Some(raw) => raw.into(),
            None => serde_json::to_vec(self.request.body())
                .unwrap_or_default()
                .into(),
        };
        let (request, request_cut) = bodies::kept_text(&raw, &secrets, self.max);
        let sent = std::mem::take(&mut self.sent);
        let (response, response_cut) = match response {
            Some(r) => {
                let (t, cut) = bodies::kept_text(r, &secrets, self.max);
                (Some(t), cut)
            }
            None if !sent.is_empty() => {
                let (t, cut) = bodies::kept_text(&sent, &secrets, self.max);
                (Some(t), cut || self.sent_cut)
            }
            None => (None, false),
        };
        // The stream's own hold goes; the kept text is charged as what it is now.
        drop(self.sent_charge.take());
        let mut kept = Bodies {
            own_key: self.own_key,
            ..Bodies::stored(request, request_cut, response, response_cut)
        };
        match app.bodies.charge(
            self.client.as_deref(),
            kept.bytes() as u64,
            self.shared,
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
