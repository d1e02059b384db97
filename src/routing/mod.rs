//! What decides where a request goes: the closed set of attempt outcomes and what each does
//! (`outcome`), pure ranking (`router`), the hedging and rate-limit policies (`hedge`,
//! `ratelimit`), balancing over an endpoint's several addresses (`balance`), the health state machine (`health`), the rolling statistics (`stats`), what the
//! watchers observed (`observed`), and the live per-endpoint state that holds them all
//! (`registry`), and the pins and kept history of `/v1/responses` conversations
//! (`conversations`). Everything but the registry and the conversations is pure and
//! clock-injected.

pub mod balance;
pub mod blame;
pub mod conversations;
pub mod health;
pub mod hedge;
pub mod observed;
pub mod outcome;
pub mod ratelimit;
pub mod registry;
pub mod router;
pub mod stats;
