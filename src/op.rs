//! The three operations the gateway serves. A leaf: every layer (config, tokens, wire, upstream)
//! speaks of operations, so the type lives below all of them and depends on nothing.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Chat = 0,
    Completions = 1,
    Embeddings = 2,
}

impl Op {
    pub const ALL: [Op; 3] = [Op::Chat, Op::Completions, Op::Embeddings];

    pub fn name(self) -> &'static str {
        match self {
            Op::Chat => "chat",
            Op::Completions => "completions",
            Op::Embeddings => "embeddings",
        }
    }

    /// Path under an OpenAI-compatible API root.
    pub fn openai_path(self) -> &'static str {
        match self {
            Op::Chat => "/chat/completions",
            Op::Completions => "/completions",
            Op::Embeddings => "/embeddings",
        }
    }

    /// Path of Ollama's native API.
    pub fn ollama_path(self) -> &'static str {
        match self {
            Op::Chat => "/api/chat",
            Op::Completions => "/api/generate",
            Op::Embeddings => "/api/embed",
        }
    }
}
