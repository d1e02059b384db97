//! Two client keys (teams A and B) and the config that gives them their models.

use super::MockUp;

pub const TEAM_A: &str = "sk-team-a-0123456789abcdef";

pub const TEAM_B: &str = "sk-team-b-fedcba9876543210";

pub fn cfg(m: &MockUp, extra_keys: &str) -> String {
    format!(
        r#"models:
  a: {{ type: openai, base_url: "{}", api_key: sk-upstream-9999, cost: {{ input_per_mtok: 1000000, output_per_mtok: 1000000 }} }}
  b: {{ type: openai, base_url: "{}" }}
routes:
  chat: [a, b]
auth:
  keys:
    - {{ name: team-a, key: env:TEAM_A_KEY, models: [chat] }}
    - {{ name: team-b, key: "sha256:{}" }}
{extra_keys}"#,
        m.base(),
        m.base(),
        hex_sha256(TEAM_B)
    )
}

pub fn hex_sha256(s: &str) -> String {
    autohedge::config::key_digest(s)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
