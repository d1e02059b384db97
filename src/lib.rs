//! AutoHedge: one OpenAI-compatible endpoint over a fleet of LLM backends. See ARCHITECTURE.md
//! for how a request flows through these modules.

pub mod cli;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod error;
pub mod executor;
pub mod health;
pub mod http;
pub mod mock;
pub mod probe;
pub mod registry;
pub mod router;
pub mod server;
pub mod state;
pub mod stats;
pub mod store;
pub mod tokens;
pub mod upstream;
pub mod wire;
