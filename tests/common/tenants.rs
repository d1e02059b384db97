//! Two client keys (teams A and B) and the config that gives them their models.

use super::{Cfg, MockUp, ep};

pub const TEAM_A: &str = "sk-team-a-0123456789abcdef";

pub const TEAM_B: &str = "sk-team-b-fedcba9876543210";

pub fn cfg(m: &MockUp, extra_keys: &str) -> String {
    Cfg::new()
        .endpoint(ep(
            "a",
            m,
            ", api_key: sk-upstream-9999, cost: { input_per_mtok: 1000000, output_per_mtok: 1000000 }",
        ))
        .endpoint(ep("b", m, ""))
        .route("chat", &["a", "b"])
        .tail(&format!(
            "auth:\n  keys:\n    - {{ name: team-a, key: env:TEAM_A_KEY, models: [chat] }}\n    - {{ name: team-b, key: \"sha256:{}\" }}\n{extra_keys}",
            hex_sha256(TEAM_B)
        ))
        .to_yaml()
}

pub fn hex_sha256(s: &str) -> String {
    autohedge::config::key_digest(s)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
