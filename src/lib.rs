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

pub mod alerts;
pub mod cli;
pub mod clients;
pub mod config;
pub mod demo;
pub mod discovery;
pub mod engine;
pub mod error;
pub mod executor;
pub mod h1pool;
pub mod health;
pub mod hedge;
pub mod http;
pub mod logctx;
pub mod logwriter;
pub mod mock;
pub mod op;
pub mod outcome;
pub mod probe;
pub mod ratelimit;
pub mod registry;
pub mod reload;
pub mod report;
pub mod router;
pub mod send_deadline;
pub mod server;
pub mod state;
pub mod stats;
pub mod store;
pub mod telemetry;
pub mod tokens;
pub mod upstream;
pub mod vault;
pub mod wire;

/// The layering ARCHITECTURE.md promises, checked on the source: the policy and vocabulary
/// modules below the request path import nothing of it, so a change to the request path cannot
/// reach into config, counting or health policy (and no import circle can form again).
#[cfg(test)]
mod layering {
    /// (module, its files, what it may import from the crate)
    const LAYERS: &[(&str, &[&str], &[&str])] = &[
        ("op", &[include_str!("op.rs")], &[]),
        ("outcome", &[include_str!("outcome.rs")], &[]),
        ("stats", &[include_str!("stats.rs")], &[]),
        ("health", &[include_str!("health.rs")], &[]),
        ("hedge", &[include_str!("hedge.rs")], &[]),
        ("h1pool", &[include_str!("h1pool.rs")], &[]),
        ("send_deadline", &[include_str!("send_deadline.rs")], &[]),
        ("ratelimit", &[include_str!("ratelimit.rs")], &[]),
        ("vault", &[include_str!("vault.rs")], &[]),
        (
            "tokens",
            &[
                include_str!("tokens/mod.rs"),
                include_str!("tokens/truncate.rs"),
            ],
            &["op", "tokens"],
        ),
        (
            "config",
            &[
                include_str!("config/mod.rs"),
                include_str!("config/raw.rs"),
                include_str!("config/types.rs"),
                include_str!("config/resolve.rs"),
                include_str!("config/describe.rs"),
                include_str!("config/duration.rs"),
            ],
            &[
                "op", "tokens", "health", "hedge", "vault", "h1pool", "config",
            ],
        ),
    ];

    #[test]
    fn lower_layers_import_nothing_of_the_request_path() {
        for (module, files, allowed) in LAYERS {
            for text in *files {
                for (at, _) in text.match_indices("crate::") {
                    let name: String = text[at + 7..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    assert!(
                        allowed.contains(&name.as_str()),
                        "`{module}` imports `crate::{name}`: it may import only {allowed:?}"
                    );
                }
            }
        }
    }
}
