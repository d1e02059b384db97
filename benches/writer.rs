//! The audit writer alone, fed the rows of a loaded gateway: `writer N` queues N request rows
//! (each with one attempt, as the overhead bench's requests are) into a real SQLite file in a
//! temporary directory, as fast as the queue takes them, and closes the store once all are
//! written. `benches/writer.sh` runs it under callgrind at two sizes: the difference between the
//! writer thread's instructions, divided by the rows between them, is the cost of a row in the
//! batches a load gathers (the serial client of `benches/instructions.sh` gives the writer a row
//! or two a commit, so each of its rows also pays most of a commit).

use std::time::{Duration, SystemTime};

use autohedge::routing::outcome::Outcome;
use autohedge::store::{AttemptRow, Record, RequestRow, Store};

/// The gateway's allocator (src/main.rs): the writer frees each row it wrote, at the price the
/// gateway pays for it.
#[global_allocator]
static GLOBAL: autohedge::alloc::Allocator = autohedge::alloc::Allocator;

fn main() {
    // `cargo test --benches` (CI's smoke run) gives no count: a few thousand rows.
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000);
    let dir = tempfile::tempdir().expect("temporary directory");
    let opened = Store::open(dir.path(), 1024).expect("store");
    let handle = opened.store.handle();
    let start = SystemTime::now();
    for i in 0..n {
        let ts = start + Duration::from_micros(i as u64 * 200);
        let mut row = RequestRow::new(format!("{:032x}-{i:04}", i * 7919), ts, "chat");
        row.requested_model = Some("a".into());
        row.endpoint = Some("a".into());
        row.status = 200;
        row.latency_ms = 1.25 + (i % 7) as f64;
        row.tokens_in = Some(9);
        row.tokens_out = Some(12);
        row.cost_usd = Some(0.000_008_55);
        row.attempts.push(AttemptRow {
            seq: 1,
            endpoint: "a".into(),
            class: Outcome::Ok,
            status: Some(200),
            error: None,
            latency_ms: row.latency_ms - 0.1,
            panic_mode: false,
            own_key: false,
            address: None,
            trace: None,
        });
        handle.send_waiting(Record::Request(Box::new(row)));
    }
    opened.store.close();
    assert_eq!(handle.written(), n as u64, "every row written");
    assert_eq!(handle.dropped(), 0);
}
