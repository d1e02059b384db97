//! The one config builder, [`Cfg`], and the presets several test files start their gateways on,
//! written with it.

use super::{Endless, MockUp, RawUp};

/// Anything with an OpenAI-style base URL (`http://ADDR/v1`).
pub trait Upstream {
    fn base(&self) -> String;
}

impl Upstream for MockUp {
    fn base(&self) -> String {
        MockUp::base(self)
    }
}

impl Upstream for RawUp {
    fn base(&self) -> String {
        RawUp::base(self)
    }
}

impl Upstream for Endless {
    fn base(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

impl Upstream for str {
    fn base(&self) -> String {
        self.to_string()
    }
}

impl Upstream for String {
    fn base(&self) -> String {
        self.clone()
    }
}

/// A gateway config, section by section: `Cfg::new().top("server: {..}").endpoint(ep("a", &up,
/// "")).chain(&["a", "b"]).policy("  max_wait: 0s").route("chat", &["a", "b"]).to_yaml()`.
/// Sections come out in this order: `top` lines, `models:`, `routing_policy:` (the fallback
/// chain, then `policy` lines verbatim), `routes:`, `tail` lines.
#[derive(Clone, Default)]
pub struct Cfg {
    top: String,
    models: Vec<String>,
    chain: Option<Vec<String>>,
    policy: String,
    routes: Vec<(String, Vec<String>)>,
    tail: String,
}

impl Cfg {
    pub fn new() -> Cfg {
        Cfg::default()
    }

    /// Lines before `models:` (`server:`, `health:` …), verbatim.
    pub fn top(mut self, yaml: &str) -> Cfg {
        push_line(&mut self.top, yaml);
        self
    }

    /// One endpoint line under `models:`, as [`ep`] writes it.
    pub fn endpoint(mut self, line: String) -> Cfg {
        self.models.push(line);
        self
    }

    /// `  name: { body }` under `models:`.
    pub fn model(self, name: &str, body: &str) -> Cfg {
        self.endpoint(format!("  {name}: {{ {body} }}\n"))
    }

    /// `  name:` under `models:`, then each field on its own line (block style, as the tests that
    /// edit a config's text expect).
    pub fn block(self, name: &str, fields: &[&str]) -> Cfg {
        let mut s = format!("  {name}:\n");
        for f in fields {
            s.push_str(&format!("    {f}\n"));
        }
        self.endpoint(s)
    }

    /// `routing_policy.fallback_chain`.
    pub fn chain(mut self, names: &[&str]) -> Cfg {
        self.chain = Some(names.iter().map(|n| n.to_string()).collect());
        self
    }

    /// Lines right after the fallback chain, verbatim, each call ended by a newline (indented:
    /// more `routing_policy` keys; not indented: more sections).
    pub fn policy(mut self, yaml: &str) -> Cfg {
        self.policy.push_str(yaml);
        self.policy.push('\n');
        self
    }

    /// `routes.name`.
    pub fn route(mut self, name: &str, names: &[&str]) -> Cfg {
        self.routes.push((
            name.to_string(),
            names.iter().map(|n| n.to_string()).collect(),
        ));
        self
    }

    /// Text after everything else, verbatim.
    pub fn tail(mut self, yaml: &str) -> Cfg {
        self.tail.push_str(yaml);
        self
    }

    pub fn to_yaml(&self) -> String {
        let mut s = self.top.clone();
        s.push_str("models:\n");
        for m in &self.models {
            s.push_str(m);
        }
        if let Some(chain) = &self.chain {
            s.push_str(&format!(
                "routing_policy:\n  fallback_chain: [{}]\n",
                chain.join(", ")
            ));
        }
        s.push_str(&self.policy);
        if !self.routes.is_empty() {
            s.push_str("routes:\n");
            for (name, names) in &self.routes {
                s.push_str(&format!("  {name}: [{}]\n", names.join(", ")));
            }
        }
        s.push_str(&self.tail);
        s
    }
}

fn push_line(to: &mut String, yaml: &str) {
    if !yaml.is_empty() {
        to.push_str(yaml);
        if !yaml.ends_with('\n') {
            to.push('\n');
        }
    }
}

/// One endpoint line: `  name: { type: openai, base_url: "BASE"EXTRA }` (`extra` starts with a
/// comma).
pub fn ep(name: &str, up: &(impl Upstream + ?Sized), extra: &str) -> String {
    format!(
        "  {name}: {{ type: openai, base_url: \"{}\"{extra} }}\n",
        up.base()
    )
}

/// `a` then `b` (models `upstream-a`/`upstream-b`, connect 1 s, first token 500 ms, total 5 s)
/// in the fallback chain and in route `chat`, with `extra_policy` under `routing_policy`.
/// Block style, and the text as it always was: tests edit it (`model: upstream-b`).
pub fn two(a: &MockUp, b: &MockUp, extra_policy: &str) -> String {
    const T: &str = "timeouts: { connect: 1s, first_token: 500ms, total: 5s }";
    let (a, b) = (
        format!("base_url: {}", a.base()),
        format!("base_url: {}", b.base()),
    );
    let cfg = Cfg::new()
        .block("a", &["type: openai", &a, "model: upstream-a", T])
        .block("b", &["type: openai", &b, "model: upstream-b", T])
        .chain(&["a", "b"])
        .policy(extra_policy)
        .route("chat", &["a", "b"])
        .to_yaml();
    format!("\n{cfg}")
}

/// An Ollama endpoint `local` on `o`, then `b`, in the fallback chain.
pub fn ollama_cfg(o: &MockUp, b: &MockUp) -> String {
    let host = format!("host: \"http://{}\"", o.addr);
    Cfg::new()
        .block(
            "local",
            &[
                "type: ollama",
                &host,
                "model: \"qwen2.5:7b\"",
                "max_tokens: 256",
                "capabilities: [chat, completions, embeddings, tools, vision]",
                "timeouts: { connect: 1s, first_token: 500ms, total: 5s }",
            ],
        )
        .endpoint(ep("b", b, ", model: upstream-b"))
        .chain(&["local", "b"])
        .to_yaml()
}

/// `eps` in order (connect 1 s, first token 2 s, total 5 s), in the fallback chain and in route
/// `chat`; `extra` right after the fallback chain.
pub fn chain_cfg(eps: &[(&str, &MockUp)], extra: &str) -> String {
    let names: Vec<&str> = eps.iter().map(|(n, _)| *n).collect();
    let mut c = Cfg::new();
    for (name, m) in eps {
        c = c.endpoint(ep(
            name,
            *m,
            ", timeouts: { connect: 1s, first_token: 2s, total: 5s }",
        ));
    }
    c.chain(&names)
        .policy(extra)
        .route("chat", &names)
        .to_yaml()
}

/// One plain endpoint `name` on `m`.
pub fn one_endpoint(m: &MockUp, name: &str) -> String {
    Cfg::new().endpoint(ep(name, m, "")).to_yaml()
}
