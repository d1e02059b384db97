//! What the gateway keeps of the answers it gave on `/v1/responses`: for each of its own
//! response ids, the endpoint that produced it (the pin a `previous_response_id` follows), the
//! upstream's own id for it, the client key that owns it, and — for responses the gateway
//! answered by translation, or every response with `responses.history: keep` — that turn's input
//! and output items and the Response object, so a conversation can be replayed on another
//! endpoint and `GET /v1/responses/{id}` answered without one.
//!
//! Each turn keeps only its own items and the id of the turn before it: a conversation costs
//! its length once, not once per turn. Bounded by `history_ttl` (each turn from when it was
//! made) and `history_max_bytes` (the oldest turns go first); a conversation missing any of its
//! turns has no history. A lookup by another client key than the owner's finds nothing.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

/// The bytes a kept turn is charged besides its items (ids, names, the map's own overhead).
const ENTRY_BYTES: usize = 256;

/// One turn of a conversation, as kept.
#[derive(Clone, Debug)]
pub struct Turn {
    /// The endpoint that produced it.
    pub endpoint: String,
    /// The upstream's own id for it; `None` when the gateway answered by translation (the
    /// upstream keeps nothing of it).
    pub upstream_id: Option<String>,
    /// The client key that made it (`None`: the gateway has no `auth.keys`).
    pub client: Option<String>,
    /// The gateway's id of the turn before it.
    pub previous: Option<String>,
    /// The address of the endpoint that produced it, when the endpoint has several: the next
    /// turn goes back there (its prefix cache; for a native pin, the only server that holds
    /// the conversation). Only ever compared with the endpoint's own addresses.
    pub address: Option<String>,
    /// This turn's input items then its output items, when kept.
    pub items: Option<Arc<Vec<Value>>>,
    /// The Response object as the client got it, when kept.
    pub response: Option<Arc<Value>>,
}

impl Turn {
    /// The turn as JSON, for the store replicas share (`cluster:`).
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "endpoint": self.endpoint,
            "upstream_id": self.upstream_id,
            "client": self.client,
            "previous": self.previous,
            "address": self.address,
            "items": self.items.as_deref(),
            "response": self.response.as_deref(),
        })
        .to_string()
    }

    /// A turn another replica shared; `None` for anything that is not one.
    pub fn from_json(text: &str) -> Option<Turn> {
        let v: Value = serde_json::from_str(text).ok()?;
        let opt_str = |k: &str| -> Option<Option<String>> {
            match v.get(k) {
                None | Some(Value::Null) => Some(None),
                Some(Value::String(s)) => Some(Some(s.clone())),
                Some(_) => None,
            }
        };
        Some(Turn {
            endpoint: v.get("endpoint")?.as_str()?.to_string(),
            upstream_id: opt_str("upstream_id")?,
            client: opt_str("client")?,
            previous: opt_str("previous")?,
            address: opt_str("address")?,
            items: match v.get("items") {
                None | Some(Value::Null) => None,
                Some(Value::Array(a)) => Some(Arc::new(a.clone())),
                Some(_) => return None,
            },
            response: match v.get("response") {
                None | Some(Value::Null) => None,
                Some(r @ Value::Object(_)) => Some(Arc::new(r.clone())),
                Some(_) => return None,
            },
        })
    }

    fn bytes(&self) -> usize {
        let items = self
            .items
            .as_ref()
            .map_or(0, |i| i.iter().map(json_len).sum());
        let response = self.response.as_ref().map_or(0, |r| json_len(r));
        // The strings too: an upstream's id is its bytes, whatever their length.
        let strings = [
            &self.upstream_id,
            &self.client,
            &self.previous,
            &self.address,
        ]
        .into_iter()
        .flatten()
        .map(String::len)
        .sum::<usize>()
            + self.endpoint.len();
        ENTRY_BYTES + items + response + strings
    }
}

fn json_len(v: &Value) -> usize {
    serde_json::to_vec(v).map_or(0, |b| b.len())
}

/// Ids in the order they were kept, each with its keeping's number.
type Queue = VecDeque<(String, u64)>;

#[derive(Default)]
struct Inner {
    /// Each turn, when it was kept, its bytes, and its keeping's number (unique: it tells an
    /// order's entry for this keeping from one for an earlier keeping of the same id).
    turns: HashMap<String, (Turn, Instant, usize, u64)>,
    kept: u64,
    /// Ids in the order they were kept, with their keeping's number: the oldest leave first (an entry whose id is
    /// no longer kept, or kept again since, is skipped when it comes up).
    order: Queue,
    bytes: usize,
    /// Each client key's turns (oldest first, with their keepings' numbers) and bytes: a key over its share loses
    /// its own oldest turns, never another's.
    by_key: HashMap<Option<String>, (Queue, usize)>,
}

/// What the kept turns may take: in all, and one client key's share of it.
pub use crate::config::HistoryBounds as Bounds;

impl Inner {
    /// Forgets `id` (wherever it stands in the orders: they skip it later).
    fn forget(&mut self, id: &str) -> Option<Turn> {
        let (turn, _, size, _) = self.turns.remove(id)?;
        self.bytes = self.bytes.saturating_sub(size);
        if let Some((_, b)) = self.by_key.get_mut(&turn.client) {
            *b = b.saturating_sub(size);
        }
        Some(turn)
    }

    /// Whether an order's entry still stands for the turn kept under its id.
    fn current(&self, id: &str, n: u64) -> bool {
        self.turns.get(id).is_some_and(|(_, _, _, k)| *k == n)
    }

    /// The oldest turn still kept of `client`'s (entries that stand for nothing are let go).
    fn oldest_of(&mut self, client: &Option<String>) -> Option<String> {
        loop {
            let (order, _) = self.by_key.get_mut(client)?;
            let (id, n) = order.front()?.clone();
            if self.current(&id, n) {
                return Some(id);
            }
            if let Some((order, _)) = self.by_key.get_mut(client) {
                order.pop_front();
            }
        }
    }

    /// Lets go of the entries that stand for nothing once they outnumber the turns kept: a key
    /// churning its own turns (each evicting its last) cannot grow the orders past twice what
    /// is kept while an older turn of another key holds the front.
    fn compact(&mut self) {
        if self.order.len() <= 2 * self.turns.len() + 64 {
            return;
        }
        let turns = &self.turns;
        let stands = |(id, n): &(String, u64)| turns.get(id).is_some_and(|(_, _, _, k)| k == n);
        self.order.retain(stands);
        for (queue, _) in self.by_key.values_mut() {
            queue.retain(stands);
        }
        self.by_key
            .retain(|_, (queue, bytes)| *bytes > 0 || !queue.is_empty());
    }

    fn key_bytes(&self, client: &Option<String>) -> u64 {
        self.by_key.get(client).map_or(0, |(_, b)| *b as u64)
    }
}

/// The kept turns, behind one mutex (held for map operations only).
#[derive(Default)]
pub struct Conversations {
    inner: Mutex<Inner>,
}

/// What a lookup found: the turn, and the whole conversation's items up to and including it
/// when every turn of it is kept.
#[derive(Clone, Debug)]
pub struct Found {
    pub turn: Turn,
    pub history: Option<Vec<Value>>,
}

impl Conversations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `turn` under `id`. Its key's oldest turns go until the key fits its share
    /// (`max_bytes_per_key`: one key's turns never push out another's); then turns past `ttl`,
    /// and while the whole is over `max_bytes`, the oldest of a key over its share first, else
    /// the oldest of all. A turn larger than a key's share is not kept.
    pub fn keep(&self, id: &str, turn: Turn, b: Bounds) {
        let size = turn.bytes();
        if size as u64 > b.max_bytes_per_key.min(b.max_bytes) {
            return;
        }
        let client = turn.client.clone();
        let now = Instant::now();
        let mut g = self.lock();
        g.forget(id);
        g.kept += 1;
        let n = g.kept;
        g.turns.insert(id.to_string(), (turn, now, size, n));
        g.order.push_back((id.to_string(), n));
        g.bytes = g.bytes.saturating_add(size);
        let (order, bytes) = g.by_key.entry(client.clone()).or_default();
        order.push_back((id.to_string(), n));
        *bytes = bytes.saturating_add(size);
        while g.key_bytes(&client) > b.max_bytes_per_key {
            match g.oldest_of(&client) {
                Some(old) => {
                    g.forget(&old);
                }
                None => break,
            }
        }
        Self::evict(&mut g, now, b);
        g.compact();
    }

    fn evict(g: &mut Inner, now: Instant, b: Bounds) {
        // Expired first, from the front (the order is the order of keeping).
        while let Some((oldest, n)) = g.order.front().cloned() {
            let stands = g.current(&oldest, n);
            let at = g.turns.get(&oldest).map(|(_, at, _, _)| *at);
            if stands && at.is_some_and(|at| now.saturating_duration_since(at) <= b.ttl) {
                break;
            }
            g.order.pop_front();
            if stands {
                let client = g.turns.get(&oldest).map(|(t, _, _, _)| t.client.clone());
                g.forget(&oldest);
                // Its key's queue lets it go too (it was that key's oldest).
                if let Some(client) = client {
                    let _ = g.oldest_of(&client);
                }
            }
        }
        while g.bytes as u64 > b.max_bytes {
            // A key over its share (the share was lowered by a reload) gives first.
            let over = g
                .by_key
                .iter()
                .find(|(_, (_, bytes))| *bytes as u64 > b.max_bytes_per_key)
                .map(|(k, _)| k.clone());
            // Else the key holding the most gives its oldest: with more keys than shares, a
            // key keeping little never loses its turns to one keeping much (the fair share of
            // each is what the whole holds over the keys keeping turns).
            let over = over.or_else(|| {
                g.by_key
                    .iter()
                    .max_by_key(|(_, (_, bytes))| *bytes)
                    .map(|(k, _)| k.clone())
            });
            let victim = match over {
                Some(k) => g.oldest_of(&k),
                None => None,
            };
            match victim {
                Some(id) => {
                    g.forget(&id);
                }
                None => break,
            }
        }
        g.by_key
            .retain(|_, (order, bytes)| *bytes > 0 || !order.is_empty());
    }

    /// The turn `id` when `client` owns it and it has not expired, with its conversation's
    /// items when every turn of it is still kept.
    pub fn find(&self, id: &str, client: Option<&str>, ttl: Duration) -> Option<Found> {
        let now = Instant::now();
        let g = self.lock();
        let live = |id: &str| {
            g.turns
                .get(id)
                .filter(|(t, at, _, _)| {
                    now.saturating_duration_since(*at) <= ttl && t.client.as_deref() == client
                })
                .map(|(t, _, _, _)| t)
        };
        let turn = live(id)?.clone();
        // Walk back to the first turn; bounded by the number of turns kept (a cycle, which
        // ids made here cannot form, ends it too).
        let mut chain: Vec<Arc<Vec<Value>>> = Vec::new();
        let mut at = Some(id.to_string());
        let mut complete = true;
        let mut steps = 0usize;
        while let Some(cur) = at {
            steps += 1;
            match live(&cur) {
                Some(t) if steps <= g.turns.len() => match &t.items {
                    Some(items) => {
                        chain.push(items.clone());
                        at = t.previous.clone();
                    }
                    None => {
                        complete = false;
                        break;
                    }
                },
                _ => {
                    complete = false;
                    break;
                }
            }
        }
        // The items are copied with the lock let go: a long conversation's copy holds up no
        // other key's lookup.
        drop(g);
        let history = complete.then(|| {
            chain
                .iter()
                .rev()
                .flat_map(|items| items.iter().cloned())
                .collect()
        });
        Some(Found { turn, history })
    }

    /// Whether `id` is kept here (whoever owns it).
    pub fn has(&self, id: &str) -> bool {
        self.lock().turns.contains_key(id)
    }

    /// Forgets `id` when `client` owns it; the turn it was.
    pub fn remove(&self, id: &str, client: Option<&str>) -> Option<Turn> {
        let mut g = self.lock();
        if g.turns.get(id)?.0.client.as_deref() != client {
            return None;
        }
        let turn = g.forget(id);
        // Its key's queue lets go what stands for nothing at its front.
        let _ = g.oldest_of(&client.map(str::to_string));
        turn
    }

    /// How many turns and bytes are kept (for `/status`).
    pub fn usage(&self) -> (usize, usize) {
        let g = self.lock();
        (g.turns.len(), g.bytes)
    }
}

/// A new response id of the gateway's own, in OpenAI's form.
pub fn new_id() -> String {
    format!("resp_{:032x}{:016x}", fastrand::u128(..), fastrand::u64(..))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const HOUR: Duration = Duration::from_secs(3600);

    fn b(max: u64) -> Bounds {
        Bounds {
            ttl: HOUR,
            max_bytes: max,
            max_bytes_per_key: max,
        }
    }

    fn turn(prev: Option<&str>, text: &str, client: Option<&str>) -> Turn {
        Turn {
            endpoint: "a".into(),
            upstream_id: None,
            client: client.map(str::to_string),
            previous: prev.map(str::to_string),
            address: None,
            items: Some(Arc::new(vec![
                json!({"role": "user", "content": text}),
                json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": format!("re: {text}")}]}),
            ])),
            response: None,
        }
    }

    #[test]
    fn a_conversation_is_its_turns_in_order_and_only_its_owner_finds_it() {
        let c = Conversations::default();
        c.keep("r1", turn(None, "one", Some("team-a")), b(1 << 20));
        c.keep("r2", turn(Some("r1"), "two", Some("team-a")), b(1 << 20));
        let found = c.find("r2", Some("team-a"), HOUR).unwrap();
        let texts: Vec<String> = found
            .history
            .unwrap()
            .iter()
            .map(|i| i["content"].to_string())
            .collect();
        assert_eq!(texts.len(), 4);
        assert!(
            texts[0].contains("one") && texts[2].contains("two"),
            "{texts:?}"
        );
        assert!(
            c.find("r2", Some("team-b"), HOUR).is_none(),
            "another key's"
        );
        assert!(c.find("r2", None, HOUR).is_none());
        assert!(c.remove("r2", Some("team-b")).is_none());
        assert!(c.remove("r2", Some("team-a")).is_some());
        assert!(c.find("r2", Some("team-a"), HOUR).is_none());
    }

    #[test]
    fn the_oldest_turns_leave_first_and_a_conversation_missing_one_has_no_history() {
        let c = Conversations::default();
        let one = turn(None, "one", None).bytes() as u64;
        // Room for two turns (a later one is a few bytes longer: its text, the id before it).
        let room = one * 2 + 16;
        c.keep("r1", turn(None, "one", None), b(room));
        c.keep("r2", turn(Some("r1"), "two", None), b(room));
        assert!(c.find("r2", None, HOUR).unwrap().history.is_some());
        c.keep("r3", turn(Some("r2"), "three", None), b(room));
        assert!(
            c.find("r1", None, HOUR).is_none(),
            "over the bytes: the oldest left"
        );
        let found = c.find("r3", None, HOUR).unwrap();
        assert!(
            found.history.is_none(),
            "r1 is gone: the conversation is not whole"
        );
        assert!(c.usage().1 as u64 <= room);
    }

    /// One key's turns never push out another's: a key past its share loses its own oldest
    /// turns; the whole over its bound loses a key-over-its-share's first.
    #[test]
    fn each_keys_history_is_its_own() {
        let c = Conversations::default();
        let one = turn(None, "x", Some("a")).bytes() as u64;
        let bounds = Bounds {
            ttl: HOUR,
            max_bytes: one * 6,
            max_bytes_per_key: one * 3 + 8,
        };
        c.keep("a1", turn(None, "x", Some("a")), bounds);
        c.keep("a2", turn(Some("a1"), "x", Some("a")), bounds);
        // B keeps twenty turns: only B's own oldest go.
        let mut prev: Option<String> = None;
        for i in 0..20 {
            let id = format!("b{i}");
            c.keep(&id, turn(prev.as_deref(), "x", Some("b")), bounds);
            prev = Some(id);
        }
        assert!(
            c.find("a2", Some("a"), HOUR).unwrap().history.is_some(),
            "A's whole"
        );
        assert!(c.find("b19", Some("b"), HOUR).is_some());
        assert!(c.find("b0", Some("b"), HOUR).is_none());
        assert!(c.usage().1 as u64 <= bounds.max_bytes);
        // A turn larger than a key's share is not kept at all.
        let mut big = turn(None, &"y".repeat(10 * one as usize), Some("b"));
        big.previous = None;
        c.keep("huge", big, bounds);
        assert!(c.find("huge", Some("b"), HOUR).is_none());
        assert!(c.find("a2", Some("a"), HOUR).is_some());
    }

    /// More keys than shares: the whole is full with every key within its share, and the key
    /// holding the most gives its oldest when another keeps a turn — a key keeping little never
    /// loses its turns to one keeping much, however old they are.
    #[test]
    fn with_more_keys_than_shares_the_largest_gives() {
        let c = Conversations::default();
        // Keys of one length: their turns of one size.
        let one = turn(None, "x", Some("k0")).bytes() as u64;
        let bounds = Bounds {
            ttl: HOUR,
            max_bytes: one * 10,
            max_bytes_per_key: one * 4,
        };
        // Three small keys first (the oldest turns of all), then one keeping its whole share.
        for k in ["k1", "k2", "k3"] {
            for i in 0..2 {
                c.keep(&format!("{k}-{i}"), turn(None, "x", Some(k)), bounds);
            }
        }
        for i in 0..4 {
            c.keep(&format!("kb-{i}"), turn(None, "x", Some("kb")), bounds);
        }
        assert_eq!(c.usage().0, 10, "full, every key within its share");
        // A fifth key keeps one turn: the largest key gives its oldest, no small key anything.
        c.keep("ks-0", turn(None, "x", Some("ks")), bounds);
        assert!(c.find("ks-0", Some("ks"), HOUR).is_some());
        for k in ["k1", "k2", "k3"] {
            for i in 0..2 {
                assert!(
                    c.find(&format!("{k}-{i}"), Some(k), HOUR).is_some(),
                    "{k}-{i}"
                );
            }
        }
        assert!(
            c.find("kb-0", Some("kb"), HOUR).is_none(),
            "the largest gave"
        );
        assert!(c.find("kb-3", Some("kb"), HOUR).is_some());
        assert!(c.usage().1 as u64 <= bounds.max_bytes);
    }

    /// A key's queue holds only what it keeps: expired and deleted turns leave it, and a turn
    /// kept again under its id is the newest, not evicted in its old place.
    #[tokio::test(start_paused = true)]
    async fn a_keys_queue_holds_only_what_it_keeps() {
        let c = Conversations::default();
        let one = turn(None, "x", Some("a")).bytes() as u64;
        let bounds = Bounds {
            ttl: HOUR,
            max_bytes: one * 100,
            max_bytes_per_key: one * 2 + 8,
        };
        for i in 0..50 {
            c.keep(&format!("r{i}"), turn(None, "x", Some("a")), bounds);
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        tokio::time::advance(HOUR).await;
        c.keep("late", turn(None, "x", Some("a")), bounds);
        {
            let g = c.lock();
            assert_eq!(
                g.by_key[&Some("a".to_string())].0.len(),
                1,
                "expired entries left"
            );
            assert_eq!(g.order.len(), 1);
        }
        // Kept again: the old entry stands for nothing; the newest is kept over an older one.
        c.keep("other", turn(None, "x", Some("a")), bounds);
        c.keep("late", turn(None, "y", Some("a")), bounds);
        c.keep("third", turn(None, "z", Some("a")), bounds);
        assert!(
            c.find("late", Some("a"), HOUR).is_some(),
            "kept again: newest"
        );
        assert!(
            c.find("other", Some("a"), HOUR).is_none(),
            "the oldest went"
        );
        assert!(c.remove("late", Some("a")).is_some());
        assert_eq!(c.lock().by_key[&Some("a".to_string())].0.len(), 1);
    }

    /// One key keeping turn after turn, each pushing out its last, while another key's older
    /// turn holds the front: the orders stay within twice the turns kept.
    #[tokio::test(start_paused = true)]
    async fn a_key_churning_its_turns_leaves_no_trail_behind() {
        let c = Conversations::default();
        let one = turn(None, "x", Some("a")).bytes() as u64;
        let bounds = Bounds {
            ttl: HOUR,
            max_bytes: one * 100,
            max_bytes_per_key: one + 8,
        };
        c.keep("victim", turn(None, "x", Some("v")), bounds);
        let mut longest = 0;
        for i in 0..10_000 {
            c.keep(&format!("r{i}"), turn(None, "x", Some("a")), bounds);
            let g = c.lock();
            longest =
                longest.max(g.order.len() + g.by_key.values().map(|(q, _)| q.len()).sum::<usize>());
        }
        // The churn happened (the key holds only its newest) and the victim's turn stands...
        assert!(c.find("r9999", Some("a"), HOUR).is_some());
        assert!(c.find("r9998", Some("a"), HOUR).is_none());
        assert!(c.find("victim", Some("v"), HOUR).is_some());
        // ...and the orders never held the churn's ten thousand entries.
        assert!(
            longest <= 2 * (2 * 2 + 64) + 4,
            "{longest} entries for 2 turns"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_past_its_ttl_is_gone() {
        let c = Conversations::default();
        c.keep("r1", turn(None, "one", None), b(1 << 20));
        tokio::time::advance(HOUR + Duration::from_secs(1)).await;
        assert!(c.find("r1", None, HOUR).is_none());
        c.keep("r2", turn(None, "two", None), b(1 << 20));
        assert_eq!(c.usage().0, 1, "the expired turn left when the next came");
    }

    #[test]
    fn a_shared_turn_reads_back_as_it_was_and_anything_else_is_refused() {
        let mut t = turn(Some("r0"), "one", Some("team-a"));
        t.upstream_id = Some("resp_up".into());
        t.response = Some(Arc::new(json!({"id": "r1", "object": "response"})));
        let back = Turn::from_json(&t.to_json()).unwrap();
        assert_eq!(back.to_json(), t.to_json());
        for hostile in [
            "",
            "[]",
            "{}",
            r#"{"endpoint": 3}"#,
            r#"{"endpoint": "a", "client": 5}"#,
            r#"{"endpoint": "a", "items": "x"}"#,
            r#"{"endpoint": "a", "response": []}"#,
        ] {
            assert!(Turn::from_json(hostile).is_none(), "{hostile}");
        }
    }

    #[test]
    fn ids_look_like_openais() {
        let id = new_id();
        assert!(id.starts_with("resp_") && id.len() == 53, "{id}");
        assert_ne!(new_id(), new_id());
    }
}
