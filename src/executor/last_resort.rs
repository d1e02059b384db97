//! The last resort (`last_resort:` on a route, or on an endpoint for requests that name it):
//! 2xx answers kept under an exact key — the request's canonical body (object keys sorted, the
//! `model` as the client asked it), the model it named, and the client key's name unless
//! `shared: true` — and served only where every attempt of the same request failed, instead of
//! the 503. A full answer is kept as its body; a stream as the events it was, only when it
//! ended in `[DONE]` whole (not broken, not continued elsewhere). Never an error, never a
//! request with `n > 1` or a `seed` (whether an answer honoured it cannot be told).
//!
//! Bounded in memory: each model's shelf by `max_bytes`, each client key's part of it by
//! `max_bytes_per_key` (its own oldest go first: one key's answers never push out another's),
//! answers past `ttl` are let go; an answer larger than a key's share is not kept.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::HeaderValue;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::config::LastResortSpec;
use crate::op::Op;

/// What an answer is kept under.
pub type Key = [u8; 32];

/// A kept answer.
#[derive(Clone, Debug)]
pub enum Kept {
    /// A full answer's body and content type.
    Full {
        content_type: HeaderValue,
        body: Bytes,
    },
    /// A stream's events as the client got them, `[DONE]` last.
    Stream(Bytes),
}

impl Kept {
    fn bytes(&self) -> usize {
        match self {
            Kept::Full { body, .. } => body.len(),
            Kept::Stream(b) => b.len(),
        }
    }

    /// As the shared store keeps it: the key it is kept under (32 bytes), `F` or `S`, when it
    /// was kept (Unix ms, 8 bytes LE), the content type's length (2 bytes LE) and the content
    /// type, then the body.
    pub fn encode(&self, key: &Key, at_unix_ms: u64) -> Vec<u8> {
        let (kind, ct, body): (u8, &[u8], &Bytes) = match self {
            Kept::Full { content_type, body } => (b'F', content_type.as_bytes(), body),
            Kept::Stream(b) => (b'S', b"", b),
        };
        let ct = &ct[..ct.len().min(u16::MAX as usize)];
        let mut out = Vec::with_capacity(43 + ct.len() + body.len());
        out.extend_from_slice(key);
        out.push(kind);
        out.extend_from_slice(&at_unix_ms.to_le_bytes());
        out.extend_from_slice(&(ct.len() as u16).to_le_bytes());
        out.extend_from_slice(ct);
        out.extend_from_slice(body);
        out
    }

    /// What [`Kept::encode`] wrote under `key`, and when it was kept; `None` for anything else
    /// (the store's bytes are read as any outside bytes are: a value that is not one, or that
    /// was kept under another key, is no answer).
    pub fn decode(key: &Key, b: &[u8]) -> Option<(Kept, u64)> {
        if b.get(..32)? != key.as_slice() {
            return None;
        }
        let b = &b[32..];
        let kind = *b.first()?;
        let at = u64::from_le_bytes(b.get(1..9)?.try_into().ok()?);
        let n = usize::from(u16::from_le_bytes(b.get(9..11)?.try_into().ok()?));
        let ct = b.get(11..11 + n)?;
        let body = Bytes::copy_from_slice(b.get(11 + n..)?);
        let kept = match kind {
            b'F' => Kept::Full {
                content_type: HeaderValue::from_bytes(ct).ok()?,
                body,
            },
            b'S' if ct.is_empty() => Kept::Stream(body),
            _ => return None,
        };
        Some((kept, at))
    }
}

/// The key of a request that may be kept and served, or `None` when it may not: only chat and
/// completions, without `n > 1` or `seed`. `client` is the key's name (`None` with `shared`).
pub fn key_of(
    op: Op,
    model: &str,
    client: Option<&str>,
    body: &serde_json::Map<String, Value>,
) -> Option<Key> {
    if !matches!(op, Op::Chat | Op::Completions) {
        return None;
    }
    let n = body.get("n");
    if n.is_some_and(|n| !n.is_null() && n.as_u64() != Some(1)) {
        return None;
    }
    if body.get("seed").is_some_and(|s| !s.is_null()) {
        return None;
    }
    let mut h = Sha256::new();
    for part in [op.name(), model, client.unwrap_or("")] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update([u8::from(client.is_some())]);
    canonical_map(&mut h, body);
    Some(h.finalize().into())
}

/// `v` as JSON with every object's keys in order, into `h`.
fn canonical(h: &mut Sha256, v: &Value) {
    match v {
        Value::Object(m) => canonical_map(h, m),
        Value::Array(a) => {
            h.update(b"[");
            for v in a {
                canonical(h, v);
                h.update(b",");
            }
            h.update(b"]");
        }
        other => h.update(other.to_string().as_bytes()),
    }
}

/// Where a request's answer may be kept: its model, key, owner and the spec.
#[derive(Clone, Debug)]
pub struct Slot {
    pub model: String,
    pub key: Key,
    /// The request asked for a stream: only a stream answers it.
    pub stream: bool,
    /// The client key's name (`""` for none): whose share the answer takes.
    pub owner: String,
    pub spec: LastResortSpec,
}

impl Slot {
    /// The slot of a request to `model` with `last_resort:` as `spec`, of client key `client`;
    /// `None` when the request may not be kept ([`key_of`]).
    pub fn of(
        op: Op,
        model: &str,
        client: Option<&str>,
        body: &serde_json::Map<String, Value>,
        spec: LastResortSpec,
    ) -> Option<Slot> {
        let owner = client.unwrap_or("");
        let key = key_of(op, model, (!spec.shared).then_some(owner), body)?;
        Some(Slot {
            model: model.to_string(),
            key,
            stream: body.get("stream").and_then(Value::as_bool) == Some(true),
            owner: owner.to_string(),
            spec,
        })
    }

    /// Keeps `kept` here, and with `cluster:` in the shared store too (off the request path).
    pub fn keep(&self, (store, cluster): Stores<'_>, kept: Kept) {
        if matches!(kept, Kept::Stream(_)) != self.stream {
            return;
        }
        // Shared only for the last resort (a cache is each replica's own), a bounded number
        // of writes at once: past it an answer is kept here only.
        if let Some(cluster) = cluster
            && self.spec.last_resort.is_some()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
            && (kept.bytes() as u64) <= self.spec.max_bytes_per_key.min(self.spec.max_bytes)
            && let Some(permit) = store.sharing.clone().try_acquire_owned().ok()
        {
            let value = kept.encode(&self.key, unix_ms(SystemTime::now()));
            let (cluster, slot) = (cluster.clone(), self.clone());
            rt.spawn(async move {
                cluster
                    .put_kept(&slot.model, &slot.id(), &slot.owner, value, slot.spec)
                    .await;
                drop(permit);
            });
        }
        store.keep(&self.model, self.key, &self.owner, kept, &self.spec);
    }

    /// The answer kept for this request, for the last resort (`last_resort:`'s age), with
    /// its age: this replica's, else (with `cluster:`) one another replica shared, asked within
    /// `cluster.timeout`.
    pub async fn find(&self, (store, cluster): Stores<'_>) -> Option<(Kept, Duration)> {
        let ttl = self.spec.last_resort?;
        if let Some(found) = store.find(&self.model, &self.key, ttl) {
            return Some(found);
        }
        let cluster = cluster?;
        let deadline = tokio::time::Instant::now() + cluster.settings().timeout;
        let max = self.spec.max_bytes_per_key.min(self.spec.max_bytes) + 64 * 1024;
        let raw = cluster
            .get_kept(&self.model, &self.id(), max, deadline)
            .await?;
        let (kept, at) = Kept::decode(&self.key, &raw)?;
        if matches!(kept, Kept::Stream(_)) != self.stream {
            return None;
        }
        let age = Duration::from_millis(unix_ms(SystemTime::now()).saturating_sub(at));
        (age <= ttl).then_some((kept, age))
    }

    /// The answer kept for this very request, for the cache (`cache:`): only for a request of
    /// `temperature: 0` (or none, where the route says so), this replica's, within the cache's
    /// age.
    pub fn cached(
        &self,
        store: &LastResort,
        body: &serde_json::Map<String, Value>,
    ) -> Option<(Kept, Duration)> {
        let c = self.spec.cache?;
        let zero = match body.get("temperature") {
            None | Some(Value::Null) => c.temperature_absent,
            Some(t) => t.as_f64() == Some(0.0),
        };
        if !zero {
            return None;
        }
        store.find(&self.model, &self.key, c.ttl)
    }

    /// The key as the shared store names it (hex).
    pub fn id(&self) -> String {
        self.key.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// This replica's kept answers, and the shared store (`cluster:`) when there is one.
pub type Stores<'a> = (&'a LastResort, Option<&'a std::sync::Arc<Cluster>>);

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The bytes of streams being captured ([`Capture`]), in all and by client key: a key's
/// streams in flight hold at most its share (`max_bytes_per_key`), all of them at most
/// `max_bytes` — one key's many long streams cannot hold memory the others' need.
#[derive(Default)]
pub struct Inflight {
    held: Mutex<(usize, HashMap<String, usize>)>,
}

impl Inflight {
    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, HashMap<String, usize>)> {
        self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `n` more bytes for `owner`, if they fit `spec`'s bounds.
    fn take(&self, owner: &str, n: usize, spec: &LastResortSpec) -> bool {
        let mut g = self.lock();
        let mine = g.1.get(owner).copied().unwrap_or(0);
        let fits = (mine + n) as u64 <= spec.max_bytes_per_key.min(spec.max_bytes)
            && (g.0 + n) as u64 <= spec.max_bytes;
        if fits {
            g.0 += n;
            *g.1.entry(owner.to_string()).or_default() += n;
        }
        fits
    }

    fn give_back(&self, owner: &str, n: usize) {
        if n == 0 {
            return;
        }
        let mut g = self.lock();
        g.0 = g.0.saturating_sub(n);
        if let Some(m) = g.1.get_mut(owner) {
            *m = m.saturating_sub(n);
            if *m == 0 {
                g.1.remove(owner);
            }
        }
    }

    /// Bytes held by streams being captured.
    pub fn bytes(&self) -> usize {
        self.lock().0
    }
}

/// A stream's events as they reach the client, kept when it ends whole (`[DONE]`, nothing
/// broken or continued): no more than [`Inflight`] lets it hold.
pub struct Capture {
    pub slot: Slot,
    buf: bytes::BytesMut,
    /// What it took of [`Inflight`]: given back when it is dropped.
    held: usize,
    inflight: Arc<Inflight>,
}

impl Capture {
    pub fn new(slot: Slot, inflight: Arc<Inflight>) -> Capture {
        Capture {
            slot,
            buf: bytes::BytesMut::new(),
            held: 0,
            inflight,
        }
    }

    /// Adds what was sent; `false` once it no longer fits (nothing is kept).
    pub fn push(&mut self, b: &[u8]) -> bool {
        if !self
            .inflight
            .take(&self.slot.owner, b.len(), &self.slot.spec)
        {
            return false;
        }
        self.held += b.len();
        self.buf.extend_from_slice(b);
        true
    }

    /// The whole stream, kept.
    pub fn keep(mut self, stores: Stores<'_>) {
        let buf = std::mem::take(&mut self.buf);
        self.slot.keep(stores, Kept::Stream(buf.freeze()));
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.inflight.give_back(&self.slot.owner, self.held);
    }
}

/// An object with its keys in order, into `h`.
fn canonical_map(h: &mut Sha256, m: &serde_json::Map<String, Value>) {
    let mut keys: Vec<&String> = m.keys().collect();
    keys.sort();
    h.update(b"{");
    for k in keys {
        h.update(Value::String(k.clone()).to_string().as_bytes());
        h.update(b":");
        if let Some(v) = m.get(k) {
            canonical(h, v);
        }
        h.update(b",");
    }
    h.update(b"}");
}

/// What an entry is charged: its body, its owner's name and a fixed part for the rest (the key
/// twice, the content type, the maps' own).
fn cost(kept: &Kept, owner: &str) -> usize {
    kept.bytes() + owner.len() + 256
}

/// One kept answer.
struct Entry {
    kept: Kept,
    at: Instant,
    owner: String,
    /// Its place in its owner's order (a later keep of the same key supersedes it).
    n: u64,
}

/// One model's kept answers.
#[derive(Default)]
struct Shelf {
    /// The bounds it was last kept under (what a sweep applies).
    spec: Option<LastResortSpec>,
    entries: HashMap<Key, Entry>,
    /// Each owner's keys in the order they were kept, with their bytes in all.
    owners: HashMap<String, (VecDeque<(Key, u64)>, usize)>,
    bytes: usize,
    n: u64,
}

impl Shelf {
    fn remove(&mut self, key: &Key) {
        if let Some(e) = self.entries.remove(key) {
            let size = cost(&e.kept, &e.owner);
            self.bytes = self.bytes.saturating_sub(size);
            if let Some((_, b)) = self.owners.get_mut(&e.owner) {
                *b = b.saturating_sub(size);
            }
        }
    }

    /// `owner`'s oldest key still standing, taken off its order.
    fn pop_oldest(&mut self, owner: &str) -> Option<Key> {
        loop {
            let (order, _) = self.owners.get_mut(owner)?;
            let (key, n) = order.pop_front()?;
            if self.entries.get(&key).is_some_and(|e| e.n == n) {
                return Some(key);
            }
        }
    }

    /// Lets go of what is past `ttl` (each owner's order is oldest first), then of each key's
    /// oldest past its share, then — while the shelf is over `max_bytes` — of the oldest of the
    /// owner holding the most (a key keeping little never loses its answers to one keeping
    /// much).
    fn evict(&mut self, now: Instant, spec: &LastResortSpec) {
        let owners: Vec<String> = self.owners.keys().cloned().collect();
        for owner in &owners {
            loop {
                let front = self.owners.get(owner).and_then(|(o, _)| o.front().copied());
                let Some((key, n)) = front else { break };
                let stale = match self.entries.get(&key) {
                    Some(e) if e.n == n => now.saturating_duration_since(e.at) > spec.ttl,
                    _ => true,
                };
                if !stale {
                    break;
                }
                if let Some((o, _)) = self.owners.get_mut(owner) {
                    o.pop_front();
                }
                if self.entries.get(&key).is_some_and(|e| e.n == n) {
                    self.remove(&key);
                }
            }
            while self
                .owners
                .get(owner)
                .is_some_and(|(_, b)| *b as u64 > spec.max_bytes_per_key)
            {
                match self.pop_oldest(owner) {
                    Some(k) => self.remove(&k),
                    None => break,
                }
            }
        }
        while self.bytes as u64 > spec.max_bytes {
            // The owner holding the most; of equals, the one whose oldest was kept first.
            let most = self
                .owners
                .iter()
                .max_by_key(|(_, (o, b))| {
                    (*b, std::cmp::Reverse(o.front().map_or(u64::MAX, |f| f.1)))
                })
                .map(|(o, _)| o.clone());
            match most.and_then(|o| self.pop_oldest(&o)) {
                Some(k) => self.remove(&k),
                None => break,
            }
        }
        self.owners.retain(|_, (o, b)| *b > 0 || !o.is_empty());
    }
}

/// Keeps between two sweeps of every shelf.
const SWEEP_EVERY: u64 = 256;

/// Writes to the shared store at once at most (each holds its answer's copy until the store
/// answers, `cluster`'s background timeout at most).
const SHARING: usize = 64;

/// The kept answers of every model with `last_resort:`.
pub struct LastResort {
    shelves: Mutex<HashMap<String, Shelf>>,
    inflight: Arc<Inflight>,
    sharing: Arc<tokio::sync::Semaphore>,
}

impl Default for LastResort {
    fn default() -> LastResort {
        LastResort {
            shelves: Mutex::default(),
            inflight: Arc::default(),
            sharing: Arc::new(tokio::sync::Semaphore::new(SHARING)),
        }
    }
}

impl LastResort {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Shelf>> {
        self.shelves.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `kept` for `model` under `key`, as `owner`'s (the client key's name, `""` for
    /// none). An answer larger than a key's share is not kept.
    pub fn keep(&self, model: &str, key: Key, owner: &str, kept: Kept, spec: &LastResortSpec) {
        let size = cost(&kept, owner);
        if size as u64 > spec.max_bytes_per_key.min(spec.max_bytes) {
            return;
        }
        let now = Instant::now();
        let mut g = self.lock();
        let shelf = g.entry(model.to_string()).or_default();
        shelf.spec = Some(*spec);
        shelf.remove(&key);
        shelf.n += 1;
        let n = shelf.n;
        shelf.entries.insert(
            key,
            Entry {
                kept,
                at: now,
                owner: owner.to_string(),
                n,
            },
        );
        shelf.bytes = shelf.bytes.saturating_add(size);
        let (order, bytes) = shelf.owners.entry(owner.to_string()).or_default();
        order.push_back((key, n));
        *bytes = bytes.saturating_add(size);
        shelf.evict(now, spec);
        // An owner churning one key leaves superseded places behind: bounded by what stands.
        if let Some((order, _)) = shelf.owners.get_mut(owner)
            && order.len() > 2 * shelf.entries.len() + 64
        {
            let entries = &shelf.entries;
            order.retain(|(k, n)| entries.get(k).is_some_and(|e| e.n == *n));
        }
        // Now and then every shelf lets go of what aged out (a model no longer kept for, or
        // kept for rarely, holds nothing past its ttl); an emptied one goes.
        if n.is_multiple_of(SWEEP_EVERY) {
            for shelf in g.values_mut() {
                if let Some(spec) = shelf.spec {
                    shelf.evict(now, &spec);
                }
            }
            g.retain(|_, s| !s.entries.is_empty());
        }
    }

    /// The answer kept for `model` under `key` within `ttl`, with its age.
    pub fn find(&self, model: &str, key: &Key, ttl: Duration) -> Option<(Kept, Duration)> {
        let now = Instant::now();
        let g = self.lock();
        let e = g.get(model)?.entries.get(key)?;
        let age = now.saturating_duration_since(e.at);
        (age <= ttl).then(|| (e.kept.clone(), age))
    }

    /// What streams being captured hold.
    pub fn inflight(&self) -> Arc<Inflight> {
        self.inflight.clone()
    }

    /// Bytes kept, in all.
    pub fn bytes(&self) -> usize {
        self.lock().values().map(|s| s.bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(max: u64, per_key: u64) -> LastResortSpec {
        LastResortSpec {
            ttl: Duration::from_secs(60),
            max_bytes: max,
            max_bytes_per_key: per_key,
            shared: false,
            last_resort: Some(Duration::from_secs(60)),
            cache: None,
        }
    }

    fn full(n: usize) -> Kept {
        Kept::Full {
            content_type: HeaderValue::from_static("application/json"),
            body: Bytes::from(vec![b'x'; n]),
        }
    }

    fn obj(v: Value) -> serde_json::Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    fn k(i: u8) -> Key {
        [i; 32]
    }

    #[test]
    fn the_key_is_exact_and_never_one_keys_for_another() {
        let body = obj(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}),
        );
        let same = obj(
            json!({"temperature": 0, "messages": [{"content": "hi", "role": "user"}], "model": "m"}),
        );
        let a = key_of(Op::Chat, "m", Some("team-a"), &body).unwrap();
        assert_eq!(
            Some(a),
            key_of(Op::Chat, "m", Some("team-a"), &same),
            "key order aside"
        );
        for (why, other) in [
            ("another key", key_of(Op::Chat, "m", Some("team-b"), &body)),
            ("shared", key_of(Op::Chat, "m", None, &body)),
            (
                "another model",
                key_of(Op::Chat, "n", Some("team-a"), &body),
            ),
            (
                "another temperature",
                key_of(
                    Op::Chat,
                    "m",
                    Some("team-a"),
                    &obj(
                        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}),
                    ),
                ),
            ),
            (
                "a stream",
                key_of(
                    Op::Chat,
                    "m",
                    Some("team-a"),
                    &obj(
                        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stream": true}),
                    ),
                ),
            ),
        ] {
            assert_ne!(other, Some(a), "{why}");
            assert!(other.is_some(), "{why}");
        }
        // A name that runs into the body cannot pass for another split.
        assert_ne!(
            key_of(Op::Chat, "m", Some("ab"), &obj(json!({"x": "c"}))),
            key_of(Op::Chat, "m", Some("a"), &obj(json!({"x": "bc"})))
        );
        assert_eq!(key_of(Op::Chat, "m", None, &obj(json!({"n": 2}))), None);
        assert_eq!(key_of(Op::Chat, "m", None, &obj(json!({"seed": 7}))), None);
        assert!(key_of(Op::Chat, "m", None, &obj(json!({"n": 1, "seed": null}))).is_some());
        assert_eq!(key_of(Op::Embeddings, "m", None, &obj(json!({}))), None);
    }

    /// What an answer of `n` bytes' cost is: its body is 257 bytes less (a one-letter owner).
    fn costing(n: usize) -> Kept {
        full(n - 257)
    }

    #[tokio::test(start_paused = true)]
    async fn one_keys_answers_never_push_out_anothers_and_age_out() {
        let lr = LastResort::default();
        let s = spec(10_000, 4_000);
        lr.keep("m", k(0), "b", costing(3_000), &s);
        for i in 1..50 {
            lr.keep("m", k(i), "a", costing(1_000), &s);
        }
        assert!(lr.find("m", &k(0), s.ttl).is_some(), "b's answer stands");
        assert!(lr.find("m", &k(49), s.ttl).is_some(), "a's newest stands");
        assert!(
            lr.find("m", &k(46), s.ttl).is_some(),
            "a's fourth newest stands"
        );
        assert!(
            lr.find("m", &k(45), s.ttl).is_none(),
            "a's older went: its share is 4,000"
        );
        assert_eq!(lr.bytes(), 7_000);
        lr.keep("m", k(99), "c", costing(4_001), &s);
        assert!(
            lr.find("m", &k(99), s.ttl).is_none(),
            "over a key's share: not kept"
        );
        lr.keep("m", k(100), "c", costing(3_000), &s);
        assert_eq!(lr.bytes(), 10_000, "the whole, exactly");
        // Past the whole, the key holding the most (a: 4,000) gives first.
        lr.keep("m", k(101), "d", costing(3_000), &s);
        assert!(lr.bytes() <= 10_000, "{}", lr.bytes());
        assert!(
            lr.find("m", &k(46), s.ttl).is_none(),
            "a's oldest went first"
        );
        assert!(lr.find("m", &k(100), s.ttl).is_some(), "c's stands");
        assert!(lr.find("m", &k(101), s.ttl).is_some(), "the newest stands");
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(lr.find("m", &k(101), s.ttl).is_none(), "past ttl");
        lr.keep("m", k(200), "f", costing(300), &s);
        assert_eq!(lr.bytes(), 300, "what aged out is let go at the next keep");
    }

    #[test]
    fn a_key_kept_again_supersedes_and_churn_stays_bounded() {
        let lr = LastResort::default();
        let s = spec(1 << 20, 1 << 20);
        for _ in 0..10_000 {
            lr.keep("m", k(1), "a", costing(300), &s);
        }
        assert_eq!(lr.bytes(), 300);
        let g = lr.lock();
        let order = &g["m"].owners["a"].0;
        assert!(order.len() <= 2 + 64 + 1, "{}", order.len());
    }

    /// One key's streams being captured hold at most its share, all at most `max_bytes`; what
    /// a capture held is given back when it ends, kept or not.
    #[test]
    fn streams_in_flight_hold_a_keys_share_at_most() {
        let lr = LastResort::default();
        let s = spec(2_000, 600);
        let slot = |owner: &str| Slot {
            model: "m".into(),
            key: k(1),
            stream: true,
            owner: owner.into(),
            spec: s,
        };
        let mut a: Vec<Capture> = (0..8)
            .map(|_| Capture::new(slot("a"), lr.inflight()))
            .collect();
        let pushed = a
            .iter_mut()
            .map(|c| c.push(&[0; 100]))
            .filter(|p| *p)
            .count();
        assert_eq!(pushed, 6, "A's share is 600");
        let mut b = Capture::new(slot("b"), lr.inflight());
        assert!(b.push(&[0; 300]), "B's share is its own");
        assert_eq!(lr.inflight().bytes(), 900);
        drop(a);
        assert_eq!(lr.inflight().bytes(), 300, "given back");
        b.keep((&lr, None));
        assert_eq!(lr.inflight().bytes(), 0);
        assert_eq!(lr.bytes(), 300 + 257, "kept");
    }

    proptest::proptest! {
        /// The shared store's bytes: what was encoded comes back; anything else is an answer
        /// or nothing, never a panic.
        #[test]
        fn a_kept_answer_decodes_as_encoded_and_any_bytes_never_panic(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
            at in proptest::num::u64::ANY,
            stream in proptest::bool::ANY,
            junk in proptest::collection::vec(proptest::num::u8::ANY, 0..64),
        ) {
            let kept = if stream {
                Kept::Stream(Bytes::from(body.clone()))
            } else {
                Kept::Full {
                    content_type: HeaderValue::from_static("application/json; charset=utf-8"),
                    body: Bytes::from(body.clone()),
                }
            };
            let (back, when) = Kept::decode(&k(7), &kept.encode(&k(7), at)).expect("decodes");
            proptest::prop_assert_eq!(when, at);
            proptest::prop_assert_eq!(back.encode(&k(7), at), kept.encode(&k(7), at));
            proptest::prop_assert!(Kept::decode(&k(8), &kept.encode(&k(7), at)).is_none(), "another key's");
            let _ = Kept::decode(&k(7), &junk);
            let mut keyed = k(7).to_vec();
            keyed.extend_from_slice(&junk);
            let _ = Kept::decode(&k(7), &keyed);
        }
    }
}
