#!/usr/bin/env python3
"""The gateway's instructions a request against the bare hyper proxy floor's, from the callgrind
files benches/instructions.sh leaves (target/callgrind for the gateway, target/callgrind/floor
for the floor, each a SMALL and a LARGE run in front of the same mock upstream, driven by the same
client): self instructions grouped by component, so what the gateway spends beyond the floor can
be read off by part, and beside it what a ratio to the floor allows.

  python3 benches/versus_floor.py 1000 9000 [RATIO]   # RATIO default 1.6 (issue #32's goal)

Components are read from the function's name: the crate its path starts with for Rust, and for
C functions the library (SQLite and mimalloc are built into the gateway, glibc's malloc serves
the floor).
"""
import re, sys

sys.path.insert(0, "benches")
from inclusive import costs, name_of  # noqa: E402

GROUPS = [
    ("gateway's own code", ("autohedge",)),
    ("SQLite (audit trail), other C", ("rusqlite", "libsqlite3_sys", "fallible_streaming_iterator", "hashlink")),
    ("HTTP: hyper, http, httparse", ("hyper", "hyper_util", "http", "httparse", "http_body", "http_body_util", "h2", "want", "axum", "axum_core", "tower")),
    ("tokio (scheduler, timers, I/O)", ("tokio", "mio", "tokio_util", "tokio_stream", "futures_util", "futures_core", "futures_channel", "atomic_waker", "parking_lot", "parking_lot_core", "lock_api")),
    ("Rust std (core, alloc, std)", ("core", "alloc", "std", "__rustc", "hashbrown", "foldhash")),
    ("bytes", ("bytes",)),
    ("metrics, tracing, serde, others", ()),
]


def component(line):
    """line: a function as callgrind_annotate prints it (file:function [object])."""
    m = re.match(r"(.*?)(?: \[([^\]]*)\])?$", line.strip())
    fn, obj = m.group(1), m.group(2) or ""
    name = name_of(fn)
    glibc = fn.startswith("./") or any(x in obj for x in ("libc.so", "libm.so", "ld-linux", "vdso"))
    if re.match(r"_?mi_", name):
        return "allocator (mimalloc / glibc malloc)"
    if glibc:
        if re.search(r"malloc|free|realloc|calloc|tcache|arena|sysmalloc|consolidate", name):
            return "allocator (mimalloc / glibc malloc)"
        if re.match(r"_*(mem|str|wmem)", name):
            return "libc memcpy, memmove, memset"
        return "libc: clock, syscalls, locks, loader"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.@']*", name):
        return "SQLite (audit trail), other C"  # the only other C code in the gateway's binary
    crate = re.match(r"[<&\s]*(?:(?:core::ptr::drop_in_place|dyn )<)?[<&\s]*(?:dyn )?([A-Za-z_][A-Za-z0-9_]*)::", name)
    crate = crate.group(1) if crate else ""
    for label, crates in GROUPS:
        if crate in crates:
            return label
    return GROUPS[-1][0]


def per_request(root, small, large):
    a = costs("small", "self", None, root, component)
    b = costs("large", "self", None, root, component)
    return {k: (b[k] - a.get(k, 0)) / (large - small) for k in set(a) | set(b)}


def main():
    small, large = int(sys.argv[1]), int(sys.argv[2])
    ratio = float(sys.argv[3]) if len(sys.argv) > 3 else 1.6
    gw = per_request("target/callgrind", small, large)
    fl = per_request("target/callgrind/floor", small, large)
    g_total, f_total = sum(gw.values()), sum(fl.values())
    beyond = g_total - f_total
    print(f"\nthe gateway against the bare hyper proxy floor, self instructions a request by component"
          f" (same client, same mock upstream; audit writer and log writer included):")
    print("| component | floor | gateway | gateway - floor | share of the difference |")
    print("|---|---|---|---|---|")
    for k in sorted(set(gw) | set(fl), key=lambda k: -(gw.get(k, 0) - fl.get(k, 0))):
        g, f = gw.get(k, 0), fl.get(k, 0)
        if abs(g) < 50 and abs(f) < 50:
            continue
        print(f"| {k} | {f:,.0f} | {g:,.0f} | {g - f:+,.0f} | {100 * (g - f) / beyond:.0f}% |")
    print(f"| **all** | {f_total:,.0f} | {g_total:,.0f} | {beyond:+,.0f} | 100% |")
    allowed = (ratio - 1) * f_total
    print("(the audit writer commits what it gathered in 50 ms: a few dozen rows a commit at this"
          " serial client's pace under valgrind, hundreds under load; benches/writer.sh counts a row"
          " in a load's batches)")
    print(f"gateway / floor: {g_total / f_total:.2f}x in instructions; {ratio}x of the floor allows"
          f" {allowed:,.0f} a request beyond it, the gateway spends {beyond:,.0f}"
          f" ({beyond / allowed:.1f}x that allowance)")


if __name__ == "__main__":
    main()
