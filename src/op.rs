//! The four operations the gateway serves. A leaf: every layer (config, tokens, wire, upstream)
//! speaks of operations, so the type lives below all of them and depends on nothing.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Chat = 0,
    Completions = 1,
    Embeddings = 2,
    /// OpenAI's Responses API (`/v1/responses`): passed through to endpoints that speak it,
    /// translated to chat for the others.
    Responses = 3,
}

/// The calls of a key that are not an [`Op`] (nothing is routed or generated) but count
/// against its `rpm`, take a concurrency slot and write an audit row: their `operation` names.
pub const SIDE_CALLS: [&str; 3] = ["models", "responses_get", "responses_delete"];

impl Op {
    pub const ALL: [Op; 4] = [Op::Chat, Op::Completions, Op::Embeddings, Op::Responses];

    pub fn name(self) -> &'static str {
        match self {
            Op::Chat => "chat",
            Op::Completions => "completions",
            Op::Embeddings => "embeddings",
            Op::Responses => "responses",
        }
    }

    /// Path under an OpenAI-compatible API root.
    pub fn openai_path(self) -> &'static str {
        match self {
            Op::Chat => "/chat/completions",
            Op::Completions => "/completions",
            Op::Embeddings => "/embeddings",
            Op::Responses => "/responses",
        }
    }

    /// Path of Ollama's native API (Responses: its OpenAI-compatible one; the gateway translates
    /// Responses requests to `/api/chat` for Ollama).
    pub fn ollama_path(self) -> &'static str {
        match self {
            Op::Chat => "/api/chat",
            Op::Completions => "/api/generate",
            Op::Embeddings => "/api/embed",
            Op::Responses => "/v1/responses",
        }
    }
}
