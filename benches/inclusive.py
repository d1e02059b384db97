#!/usr/bin/env python3
"""Instructions a request by function, from the callgrind files benches/instructions.sh leaves in
target/callgrind (one file a thread, a SMALL and a LARGE run): the difference between the runs
divided by the requests between them, so startup and shutdown cancel out.

  python3 benches/inclusive.py 1000 9000 'wire::|upstream::' 30          # inclusive
  python3 benches/inclusive.py 1000 9000 . 40 self                       # self (exclusive)
  python3 benches/inclusive.py 1000 9000 'Run::settle' 20 callees        # what one function calls
  python3 benches/inclusive.py 1000 9000 'String as .*Clone' 20 callers  # who calls one function

Inclusive figures take, per thread file, the largest `*` entry callgrind_annotate's call tree
gives a function (its other entries are the same function seen from recursion or inlining).
"""
import glob, re, subprocess, sys

ROOT = "target/callgrind"


def files(tag, root=ROOT):
    return sorted(f for f in glob.glob(f"{root}/cg.{tag}*") if re.search(r"-\d+$", f))


def name_of(s):
    s = re.sub(r" \[[^\]]*\]$", "", s.strip())
    s = re.sub(r" \(\d[\d,]*x\)$", "", s)
    if ":" in s and (".rs:" in s or ".c:" in s or ".h:" in s or ".S:" in s or s.startswith("???:")):
        s = s.split(":", 1)[1]
    return s


def annotate(f, *args):
    return subprocess.run(["callgrind_annotate", *args, "--threshold=100", "--auto=no", f],
                          capture_output=True, text=True).stdout


def costs(tag, mode, pat, root=ROOT, key=name_of):
    """key: what a line's function (as callgrind_annotate prints it) is counted under, in self
    mode (benches/versus_floor.py counts by component)."""
    d = {}
    for f in files(tag, root):
        if mode == "self":
            for line in annotate(f).splitlines():
                m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(.*)$", line)
                if m and "PROGRAM TOTALS" not in line:
                    k = key(m.group(2))
                    d[k] = d.get(k, 0) + int(m.group(1).replace(",", ""))
        elif mode == "incl":
            most = {}
            for line in annotate(f, "--tree=calling", "--inclusive=yes").splitlines():
                m = re.match(r"\s*([\d,]+) \([^)]*\)\s+\*\s+(.*)$", line)
                if m:
                    k = name_of(m.group(2))
                    most[k] = max(most.get(k, 0), int(m.group(1).replace(",", "")))
            for k, v in most.items():
                d[k] = d.get(k, 0) + v
        else:
            tree, mark = ("--tree=calling", ">") if mode == "callees" else ("--tree=caller", "<")
            for block in annotate(f, tree, "--inclusive=yes").split("\n\n"):
                lines = block.splitlines()
                star = [l for l in lines if re.match(r"\s*[\d,]+ \([^)]*\)\s+\*\s", l)]
                if not star or not pat.search(star[0]):
                    continue
                for l in lines:
                    m = re.match(r"\s*([\d,]+) \([^)]*\)\s+" + re.escape(mark) + r"\s+(.*)$", l)
                    if m:
                        k = name_of(m.group(2))
                        d[k] = d.get(k, 0) + int(m.group(1).replace(",", ""))
    return d


def main():
    small, large = int(sys.argv[1]), int(sys.argv[2])
    pat = re.compile(sys.argv[3] if len(sys.argv) > 3 else ".")
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    mode = sys.argv[5] if len(sys.argv) > 5 else "incl"
    a, b = costs("small", mode, pat), costs("large", mode, pat)
    n = large - small
    keep = (lambda k: True) if mode in ("callees", "callers") else pat.search
    rows = sorted(((b[k] - a.get(k, 0)) / n, k) for k in b if keep(k))
    for v, k in reversed(rows[-top:]):
        if v >= 1:
            print(f"{v:9.0f}  {k[:170]}")


if __name__ == "__main__":
    main()
