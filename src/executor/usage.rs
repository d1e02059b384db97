//! What an answer used and cost: the upstream's `usage`, else the gateway's estimates, at the
//! serving endpoint's prices. Shared by the response path (`respond`) and the committed stream
//! (`stream`), which is why it is a module of its own.

use crate::config::Endpoint;
use crate::store::RequestRow;
use crate::wire::{Op, Usage};

pub(super) fn fill_usage(
    row: &mut RequestRow,
    ep: &Endpoint,
    usage: Option<Usage>,
    prompt_estimate: u64,
    out_estimate: u64,
    op: Op,
) {
    let leg = Leg::of(ep, usage, prompt_estimate, out_estimate, op);
    row.tokens_in = Some(leg.tokens_in);
    row.tokens_out = Some(leg.tokens_out);
    row.tokens_estimated = leg.estimated;
    row.cost_usd = leg.cost_usd;
}

/// What one upstream's part of an answer used and cost: the upstream's `usage`, else the
/// estimates, at that endpoint's prices.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Leg {
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub estimated: bool,
    pub cost_usd: Option<f64>,
}

impl Leg {
    pub(super) fn of(
        ep: &Endpoint,
        usage: Option<Usage>,
        prompt_estimate: u64,
        out_estimate: u64,
        op: Op,
    ) -> Leg {
        let (tin, tout, est) = match usage {
            Some(u) => (u.prompt, u.completion, false),
            None => (
                prompt_estimate,
                if op == Op::Embeddings {
                    0
                } else {
                    out_estimate
                },
                true,
            ),
        };
        let priced = ep.cost.input_per_mtok > 0.0 || ep.cost.output_per_mtok > 0.0;
        Leg {
            tokens_in: tin,
            tokens_out: tout,
            estimated: est,
            cost_usd: priced.then(|| {
                (tin as f64 * ep.cost.input_per_mtok + tout as f64 * ep.cost.output_per_mtok) / 1e6
            }),
        }
    }

    /// Both legs' figures together.
    pub(super) fn plus(self, other: Leg) -> Leg {
        Leg {
            tokens_in: self.tokens_in.saturating_add(other.tokens_in),
            tokens_out: self.tokens_out.saturating_add(other.tokens_out),
            estimated: self.estimated || other.estimated,
            cost_usd: match (self.cost_usd, other.cost_usd) {
                (None, None) => None,
                (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
            },
        }
    }

    /// Adds `other` (an earlier leg of the same answer) to the row's figures.
    pub(super) fn add_to(self, row: &mut RequestRow) {
        row.tokens_in = Some(row.tokens_in.unwrap_or(0).saturating_add(self.tokens_in));
        row.tokens_out = Some(row.tokens_out.unwrap_or(0).saturating_add(self.tokens_out));
        row.tokens_estimated |= self.estimated;
        row.cost_usd = match (row.cost_usd, self.cost_usd) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
        };
    }
}
