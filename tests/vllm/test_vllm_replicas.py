"""Two processes of vLLM's real OpenAI server on CPU (the tiny random-weight Llama, prefix caching
on) behind one endpoint of two `base_urls`: a multi-turn conversation stays on one server — its
own `vllm:prefix_cache_hits` rise, the other's do not — and a killed process is ejected alone
while the other serves every request."""

import json
import os
import pathlib
import re
import signal
import sqlite3
import subprocess
import tempfile
import textwrap
import time
import urllib.request

import openai
import pytest

from serverutil import listening_port, start_autohedge, wait_http

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))
VLLM_PYTHON = os.environ.get("AUTOHEDGE_VLLM_PYTHON", str(ROOT / ".cache" / "vllm-venv" / "bin" / "python"))

if not os.path.exists(VLLM_PYTHON):
    pytest.skip(f"vLLM is not installed at {VLLM_PYTHON} (run tests/vllm/install.sh)", allow_module_level=True)

GEN = {"ignore_eos": True}
SYSTEM = "You are a tiny model. " + "The quick brown fox jumps over the lazy dog. " * 12


def _get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _prefix_hits(root):
    """The server's prefix-cache hits (tokens), summed over its series."""
    _, text = _get(f"{root}/metrics", timeout=30)
    total = 0.0
    seen = False
    for line in text.decode().splitlines():
        if re.match(r"^vllm:(gpu_)?prefix_cache_hits(_total)?[{ ]", line):
            total += float(line.rsplit(" ", 1)[-1])
            seen = True
    assert seen, "the server exports vllm:prefix_cache_hits"
    return total


@pytest.fixture(scope="module")
def pair():
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    model = d / "tiny-llama"
    subprocess.run([VLLM_PYTHON, str(HERE / "make_tiny_llama.py"), str(model)], check=True,
                   stdout=log, stderr=log)
    procs = []
    roots = []
    try:
        # Each engine's OpenMP threads on a core of its own.
        for core in ("0", "1"):
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="INFO",
                       HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=core)
            p = subprocess.Popen(
                [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                 "--served-model-name", "tiny", "--max-model-len", "1024", "--dtype", "float32",
                 "--enforce-eager", "--max-num-seqs", "2", "--enable-prefix-caching",
                 "--host", "127.0.0.1", "--port", "0"],
                stdout=log, stderr=log, env=env, start_new_session=True,
            )
            procs.append(p)
        for p in procs:
            port = listening_port(p, timeout=300)
            roots.append(f"http://127.0.0.1:{port}")
        for p, root in zip(procs, roots):
            wait_http(f"{root}/health", p, timeout=300)
        cfg = d / "config.yaml"
        cfg.write_text(textwrap.dedent(f"""
            models:
              pair:
                type: vllm
                base_urls: ["{roots[0]}/v1", "{roots[1]}/v1"]
                model: tiny
                timeouts: {{ connect: 1s, first_token: 60s, total: 120s }}
            health: {{ probe_interval: 200ms, probe_timeout: 10s, eject_after: 2, eject_base: 1h, eject_max: 1h, vllm_max_waiting: 1000 }}
        """))
        gw, addr = start_autohedge(BIN, ["serve", "--config", str(cfg), "--listen", "127.0.0.1:0",
                                         "--data-dir", str(d / "data")], log)
        vllms = list(procs)
        procs.append(gw)
        client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=120)
        yield {"client": client, "vllms": vllms, "roots": roots, "addr": addr,
               "db": d / "data" / "autohedge.db"}
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM) if p in procs[:2] else p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    p.kill()
        log.close()
        if os.environ.get("AUTOHEDGE_KEEP_VLLM_LOG"):
            print((d / "log.txt").read_text()[-20000:])
        tmp.cleanup()


def _addresses_served(db, ids, timeout=20):
    """The address of each request's serving attempt (the audit writer may lag a moment)."""
    deadline = time.time() + timeout
    while True:
        with sqlite3.connect(db) as c:
            rows = dict(c.execute(
                "SELECT r.request_id, a.address FROM requests r JOIN attempts a ON a.request_row = r.id "
                f"WHERE a.class = 'ok' AND r.request_id IN ({','.join('?' * len(ids))})", ids).fetchall())
        if len(rows) == len(ids) or time.time() > deadline:
            return [rows.get(i) for i in ids]
        time.sleep(0.2)


def _status(addr):
    return json.loads(_get(f"http://{addr}/status", timeout=30)[1])


def test_a_conversation_stays_on_one_server_and_hits_its_prefix_cache(pair):
    client, roots = pair["client"], pair["roots"]
    before = [_prefix_hits(r) for r in roots]
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "AutoHedge routes each request across many backends."}]
    ids = []
    for turn in range(5):
        raw = client.chat.completions.with_raw_response.create(
            model="pair", messages=messages, max_tokens=4, extra_body=GEN)
        assert raw.http_response.status_code == 200
        ids.append(raw.headers["x-request-id"])
        answer = raw.parse().choices[0].message.content or ""
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"Hello from the tiny model, turn {turn}!"}]
    served = _addresses_served(pair["db"], ids)
    assert None not in served, served
    assert len(set(served)) == 1, f"the conversation moved: {served}"
    home = [f"{r}/v1" for r in roots].index(served[0])
    after = [_prefix_hits(r) for r in roots]
    assert after[home] > before[home], f"its server's prefix cache hit nothing: {before} -> {after}"
    assert after[1 - home] == before[1 - home], f"the other server was used: {before} -> {after}"


def test_a_killed_server_is_ejected_alone_and_the_other_serves(pair):
    client, roots, addr = pair["client"], pair["roots"], pair["addr"]
    victim = pair["vllms"][0]
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=30)
    ids = []
    for i in range(8):
        raw = client.chat.completions.with_raw_response.create(
            model="pair", messages=[{"role": "user", "content": f"hello world {i}"}], max_tokens=2, extra_body=GEN)
        assert raw.http_response.status_code == 200
        ids.append(raw.headers["x-request-id"])
    served = _addresses_served(pair["db"], ids)
    assert set(served) == {f"{roots[1]}/v1"}, served
    deadline = time.time() + 60
    while True:
        st = _status(addr)["endpoints"]["pair"]
        states = {a["url"]: a["state"] for a in st["addresses"]}
        if states.get(f"{roots[0]}/v1") == "ejected" or time.time() > deadline:
            break
        time.sleep(0.3)
    assert states == {f"{roots[0]}/v1": "ejected", f"{roots[1]}/v1": "active"}, st
    assert st["state"] != "unhealthy", st
