//! What operators see: metrics and the access line (`telemetry`), webhook alerts (`alerts`), the
//! failure report (`report`), and where log lines go and which request they belong to
//! (`logwriter`, `logctx`). Fed events and plain data; none of it is on a request's decision
//! path.

pub mod alerts;
pub mod logctx;
pub mod logwriter;
pub mod otel;
pub mod reload;
pub mod report;
pub mod telemetry;
pub mod timeline;
