//! The mock upstream's simulated inference server (`sim:` in its script): what makes a fleet
//! of replicas behave like vLLM's for the balancing bench — a fixed number of sequences served
//! at once with a queue behind them, a time to first token that follows the prompt tokens not
//! found in the server's own prefix cache (an LRU of 16-token blocks, chained as vLLM's
//! automatic prefix caching hashes them), and a decode time per output token. Its `/metrics`
//! report the queue and the cache as vLLM's do.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// `sim:`: the server's capacity and speed.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SimSpec {
    /// Sequences served at once (vLLM's `--max-num-seqs`); more wait in a queue.
    pub slots: usize,
    /// Microseconds of prefill per prompt token not found in the prefix cache.
    pub prefill_us: f64,
    /// Milliseconds per output token (each a stream chunk).
    pub decode_ms: f64,
    /// The prefix cache's size in tokens (LRU over 16-token blocks).
    pub cache_tokens: u64,
    /// Output tokens of a request that sets no `max_tokens` (default 32).
    pub output_tokens: Option<u64>,
}

/// Characters of a block: 16 tokens at the 4 characters a token the mock counts by.
pub const BLOCK_CHARS: usize = 64;
/// Tokens of a block.
pub const BLOCK_TOKENS: u64 = 16;

/// A server's running state.
pub struct Sim {
    pub spec: SimSpec,
    slots: std::sync::Arc<Semaphore>,
    waiting: AtomicU32,
    running: std::sync::Arc<AtomicU32>,
    cache: Mutex<Lru>,
    /// Prompt tokens looked up, and found, in the prefix cache (vLLM's counters).
    pub queries: AtomicU64,
    pub hits: AtomicU64,
}

/// What serving one request takes, once its slot is held: the slot (kept until the answer's
/// last byte), the output tokens and the time per token.
pub struct Admitted {
    pub slot: Slot,
    pub output_tokens: u64,
    pub per_token: Duration,
}

/// A held sequence slot; counted as running until dropped.
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
    running: std::sync::Arc<AtomicU32>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Sim {
    pub fn new(spec: SimSpec) -> Sim {
        let blocks = (spec.cache_tokens / BLOCK_TOKENS).max(1) as usize;
        Sim {
            slots: std::sync::Arc::new(Semaphore::new(spec.slots.clamp(1, 4096))),
            spec,
            waiting: AtomicU32::new(0),
            running: std::sync::Arc::new(AtomicU32::new(0)),
            cache: Mutex::new(Lru::new(blocks)),
            queries: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        }
    }

    /// Waits for a slot, then for the prefill of what the cache does not hold (which it then
    /// holds).
    pub async fn admit(&self, body: &Value) -> Admitted {
        // Counted waiting until it has a slot, or its caller gave up (the future dropped).
        struct Waiting<'a>(&'a AtomicU32);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let waiting = Waiting(&self.waiting);
        let permit = self.slots.clone().acquire_owned().await;
        drop(waiting);
        self.running.fetch_add(1, Ordering::Relaxed);
        let slot = Slot {
            // The semaphore is never closed; were it, the call would run unbounded.
            _permit: permit.ok(),
            running: self.running.clone(),
        };
        let text = prompt_text(body);
        let blocks = block_hashes(&text);
        let tokens = (text.len() as u64).div_ceil(4).max(1);
        let cached = {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let hit = c.longest_prefix(&blocks);
            for b in &blocks {
                c.touch(*b);
            }
            hit as u64 * BLOCK_TOKENS
        };
        let cached = cached.min(tokens);
        self.queries.fetch_add(tokens, Ordering::Relaxed);
        self.hits.fetch_add(cached, Ordering::Relaxed);
        let prefill = secs((tokens - cached) as f64 * self.spec.prefill_us / 1e6);
        tokio::time::sleep(prefill).await;
        let asked = body
            .get("max_completion_tokens")
            .or_else(|| body.get("max_tokens"))
            .and_then(Value::as_u64);
        Admitted {
            slot,
            output_tokens: asked
                .or(self.spec.output_tokens)
                .unwrap_or(32)
                .clamp(1, 4096),
            per_token: secs(self.spec.decode_ms / 1e3),
        }
    }

    /// (running, waiting) now.
    pub fn load(&self) -> (u32, u32) {
        (
            self.running.load(Ordering::Relaxed),
            self.waiting.load(Ordering::Relaxed),
        )
    }

    /// Its part of `/__mock/stats`.
    pub fn stats(&self) -> Value {
        let (running, waiting) = self.load();
        serde_json::json!({
            "running": running,
            "waiting": waiting,
            "prefix_queries": self.queries.load(Ordering::Relaxed),
            "prefix_hits": self.hits.load(Ordering::Relaxed),
        })
    }
}

/// A script's time, whatever it says: negative, not a number or endless is none, at most a
/// minute.
fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s)
        .unwrap_or(Duration::ZERO)
        .min(Duration::from_secs(60))
}

/// The text a prompt's cache blocks are made of: each message's role and content (text parts
/// joined), in order; a completion's prompt.
pub fn prompt_text(body: &Value) -> String {
    let mut s = String::new();
    if let Some(messages) = body.get("messages").and_then(Value::as_array) {
        for m in messages {
            s.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
            s.push(':');
            match m.get("content") {
                Some(Value::String(t)) => s.push_str(t),
                Some(Value::Array(parts)) => {
                    for p in parts {
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            s.push_str(t);
                        }
                    }
                }
                _ => {}
            }
            s.push('\n');
        }
    } else if let Some(p) = body.get("prompt").and_then(Value::as_str) {
        s.push_str(p);
    }
    s
}

/// The chained hashes of the text's whole blocks: a block's hash covers everything before it,
/// so a block is reused only after the same prefix (vLLM's automatic prefix caching).
pub fn block_hashes(text: &str) -> Vec<u64> {
    let bytes = text.as_bytes();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    bytes
        .chunks_exact(BLOCK_CHARS)
        .map(|block| {
            for b in block {
                h ^= u64::from(*b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
            h
        })
        .collect()
}

/// Block hashes, least recently used first out.
struct Lru {
    cap: usize,
    tick: u64,
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn new(cap: usize) -> Lru {
        Lru {
            cap,
            tick: 0,
            at: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// How many of `blocks`, from the first, are held.
    fn longest_prefix(&self, blocks: &[u64]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.at.contains_key(b))
            .count()
    }

    fn touch(&mut self, block: u64) {
        self.tick += 1;
        if let Some(old) = self.at.insert(block, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, block);
        while self.at.len() > self.cap {
            let Some((_, b)) = self.order.pop_first() else {
                break;
            };
            self.at.remove(&b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(cache_tokens: u64) -> SimSpec {
        SimSpec {
            slots: 2,
            prefill_us: 0.0,
            decode_ms: 0.0,
            cache_tokens,
            output_tokens: None,
        }
    }

    /// A conversation's next turn finds its earlier turn's blocks; another conversation does
    /// not; a small cache forgets the oldest.
    #[tokio::test]
    async fn the_prefix_cache_hits_what_an_earlier_turn_left() {
        let sim = Sim::new(spec(10_000));
        let long = "x".repeat(BLOCK_CHARS * 10);
        let t1 = json!({"messages": [{"role": "user", "content": long}]});
        let t2 = json!({"messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]});
        drop(sim.admit(&t1).await);
        assert_eq!(sim.hits.load(Ordering::Relaxed), 0);
        drop(sim.admit(&t2).await);
        let hits = sim.hits.load(Ordering::Relaxed);
        assert!(hits >= 9 * BLOCK_TOKENS, "{hits}");
        let other =
            json!({"messages": [{"role": "user", "content": "y".repeat(BLOCK_CHARS * 10)}]});
        drop(sim.admit(&other).await);
        assert_eq!(sim.hits.load(Ordering::Relaxed), hits);
        // Two blocks of room: the first conversation's leading blocks are gone.
        let small = Sim::new(spec(2 * BLOCK_TOKENS));
        drop(small.admit(&t1).await);
        drop(small.admit(&t1).await);
        assert_eq!(small.hits.load(Ordering::Relaxed), 0);
    }

    /// Slots bound what runs; the rest wait, and are counted waiting.
    #[tokio::test]
    async fn requests_beyond_the_slots_wait() {
        let sim = std::sync::Arc::new(Sim::new(spec(1000)));
        let a = sim.admit(&json!({})).await;
        let b = sim.admit(&json!({})).await;
        assert_eq!(sim.load(), (2, 0));
        let s = sim.clone();
        let third = tokio::spawn(async move { s.admit(&json!({})).await.output_tokens });
        while sim.load().1 == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(sim.load(), (2, 1));
        drop(a);
        assert_eq!(third.await.unwrap(), 32);
        drop(b);
        assert_eq!(sim.load(), (0, 0));
    }
}
