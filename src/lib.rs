//! AutoHedge: one OpenAI-compatible endpoint over a fleet of LLM backends. See ARCHITECTURE.md
//! for how a request flows through these modules.

/// `println!` that never panics: a closed stdout (`autohedge check-config | head -1`, a parent
/// that went away) must not take the command — or a serving gateway — down.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

pub mod cli;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod error;
pub mod executor;
pub mod health;
pub mod http;
pub mod mock;
pub mod outcome;
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
