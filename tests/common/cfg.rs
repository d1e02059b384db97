//! Config presets several test files start their gateways on.

use super::MockUp;

pub fn two(a: &MockUp, b: &MockUp, extra_policy: &str) -> String {
    format!(
        r#"
models:
  a:
    type: openai
    base_url: {}
    model: upstream-a
    timeouts: {{ connect: 1s, first_token: 500ms, total: 5s }}
  b:
    type: openai
    base_url: {}
    model: upstream-b
    timeouts: {{ connect: 1s, first_token: 500ms, total: 5s }}
routing_policy:
  fallback_chain: [a, b]
{extra_policy}
routes:
  chat: [a, b]
"#,
        a.base(),
        b.base()
    )
}

pub fn ollama_cfg(o: &MockUp, b: &MockUp) -> String {
    format!(
        r#"
models:
  local:
    type: ollama
    host: "http://{}"
    model: "qwen2.5:7b"
    max_tokens: 256
    capabilities: [chat, completions, embeddings, tools, vision]
    timeouts: {{ connect: 1s, first_token: 500ms, total: 5s }}
  b: {{ type: openai, base_url: "{}", model: upstream-b }}
routing_policy: {{ fallback_chain: [local, b] }}
"#,
        o.addr,
        b.base()
    )
}

pub fn chain_cfg(eps: &[(&str, &MockUp)], extra: &str) -> String {
    let mut s = String::from("models:\n");
    for (name, m) in eps {
        s.push_str(&format!(
            "  {name}: {{ type: openai, base_url: \"{}\", timeouts: {{ connect: 1s, first_token: 2s, total: 5s }} }}\n",
            m.base()
        ));
    }
    let names: Vec<&str> = eps.iter().map(|(n, _)| *n).collect();
    s.push_str(&format!(
        "routing_policy:\n  fallback_chain: [{}]\n{extra}\nroutes:\n  chat: [{}]\n",
        names.join(", "),
        names.join(", ")
    ));
    s
}

pub fn ep(name: &str, m: &MockUp, extra: &str) -> String {
    format!(
        "  {name}: {{ type: openai, base_url: \"{}\"{extra} }}\n",
        m.base()
    )
}
