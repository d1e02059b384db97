"""The gateway's OpenTelemetry traces in a real receiver: Arize Phoenix (`phoenix serve`, OTLP over
HTTP at /v1/traces, its REST API for the spans it holds), the official OpenAI SDK as the client,
mock-upstream processes (the same binary) as backends on 127.0.0.1.

A failover, a hedged request and a broken stream that is continued each appear as one trace of
the right shape; a client's `traceparent` is continued; each upstream sees its own call's span;
with the receiver stopped under load every request is still answered at once."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from serverutil import start_autohedge, wait_http  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))
PHOENIX = os.environ.get("AUTOHEDGE_PHOENIX", str(ROOT / ".cache" / "phoenix-venv" / "bin" / "phoenix"))

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def free_port():
    # Phoenix takes its ports from the environment: one the kernel just gave out, closed again
    # (the one place the suite cannot bind port 0 itself).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Env:
    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)
        self.log = open(self.dir / "log.txt", "w")
        self.procs = []

    def mock(self, name, script, flavor="openai"):
        path = self.dir / f"{name}.yaml"
        path.write_text(script)
        proc, addr = start_autohedge(
            BIN, ["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", flavor, "--script", str(path)], self.log)
        self.procs.append(proc)
        return addr

    def close(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.log.close()
        self.tmp.cleanup()


@pytest.fixture(scope="module")
def env():
    e = Env()
    try:
        port, grpc = free_port(), free_port()
        phoenix_env = dict(os.environ, PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=str(port),
                           PHOENIX_GRPC_PORT=str(grpc), PHOENIX_WORKING_DIR=str(e.dir / "phoenix"))
        phoenix = subprocess.Popen([PHOENIX, "serve"], stdout=e.log, stderr=e.log, env=phoenix_env)
        e.procs.append(phoenix)
        e.phoenix = phoenix
        e.phoenix_url = f"http://127.0.0.1:{port}"
        wait_http(f"{e.phoenix_url}/healthz", phoenix, timeout=120)
        fail = e.mock("fail", "name: fail\nrules: [{status: 503, error: overloaded}]\n")
        ok = e.mock("ok", 'name: ok\nreply: "Hello from ok"\n', flavor="vllm")
        slow = e.mock("slow", "name: slow\nrules: [{delay: 1500ms}]\n")
        broken = e.mock("broken", 'name: broken\nreply: "one two three four five six"\nrules: [{reset_after: 2}]\n')
        e.ups = {"fail": fail, "ok": ok, "slow": slow, "broken": broken}
        cfg = e.dir / "config.yaml"
        cfg.write_text(textwrap.dedent(f"""
            models:
              fail: {{ type: openai, base_url: "http://{fail}/v1", model: model-fail }}
              ok: {{ type: vllm, base_url: "http://{ok}/v1", model: model-ok }}
              slow: {{ type: openai, base_url: "http://{slow}/v1", model: model-slow }}
              broken: {{ type: openai, base_url: "http://{broken}/v1", model: model-broken }}
            routes:
              failover: [fail, ok]
              hedged:
                chain: [slow, ok]
                hedge: {{ after: 150ms, max_extra: 100% }}
              continued:
                chain: [broken, ok]
                continue_streams: true
            health: {{ probe_interval: 1h }}
            telemetry:
              otlp: {{ endpoint: "{e.phoenix_url}/v1/traces", service_name: autohedge-phoenix-test }}
        """))
        gw, addr = start_autohedge(
            BIN, ["serve", "--config", str(cfg), "--listen", "127.0.0.1:0", "--data-dir", str(e.dir / "data")], e.log)
        e.procs.append(gw)
        e.gw = f"http://{addr}"
        e.client = openai.OpenAI(base_url=f"{e.gw}/v1", api_key="unused", max_retries=0, timeout=20)
        yield e
    finally:
        e.close()


def spans_of(env, trace_id, n, timeout=20):
    """The spans Phoenix holds of `trace_id`, once it holds `n` of them."""
    deadline = time.time() + timeout
    found = []
    while time.time() < deadline:
        data = get_json(f"{env.phoenix_url}/v1/projects/default/spans?limit=1000")["data"]
        found = [s for s in data if s["context"]["trace_id"] == trace_id]
        if len(found) >= n:
            return found
        time.sleep(0.3)
    raise AssertionError(f"{len(found)} spans of {trace_id} in Phoenix, wanted {n}: {found}")


def server_span_of(env, request_id, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        data = get_json(f"{env.phoenix_url}/v1/projects/default/spans?limit=1000")["data"]
        for s in data:
            if s["parent_id"] is None and s["attributes"].get("autohedge.request_id") == request_id:
                return s
        time.sleep(0.3)
    raise AssertionError(f"no server span of {request_id} in Phoenix")


def calls_under(spans, server):
    return [s for s in spans if s["parent_id"] == server["context"]["span_id"]]


def test_a_failover_continues_the_clients_trace(env):
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    raw = env.client.chat.completions.with_raw_response.create(
        model="failover", messages=[{"role": "user", "content": "hello"}], max_tokens=16,
        extra_headers={"traceparent": parent})
    assert raw.headers["x-autohedge-endpoint"] == "ok"
    assert raw.parse().choices[0].message.content == "Hello from ok"
    spans = spans_of(env, CLIENT_TRACE, 3)
    server = next(s for s in spans if s["parent_id"] == CLIENT_SPAN)
    assert server["name"] == "POST /v1/chat/completions"
    assert server["attributes"]["gen_ai.request.model"] == "failover"
    assert server["attributes"]["gen_ai.response.model"] == "model-ok"
    assert server["attributes"]["gen_ai.request.max_tokens"] == 16
    assert server["attributes"]["autohedge.request_id"] == raw.headers["x-request-id"]
    calls = sorted(calls_under(spans, server), key=lambda s: s["attributes"]["autohedge.attempt"])
    assert [c["name"] for c in calls] == ["chat model-fail", "chat model-ok"], calls
    assert calls[0]["status_code"] == "ERROR" and calls[0]["status_message"] == "server_error"
    assert calls[0]["attributes"]["http.response.status_code"] == 503
    assert calls[1]["status_code"] != "ERROR"
    assert calls[1]["attributes"]["gen_ai.usage.output_tokens"] > 0
    # Each upstream saw its own call's span as its parent.
    for name, call in (("fail", calls[0]), ("ok", calls[1])):
        seen = get_json(f"http://{env.ups[name]}/__mock/stats")["traceparents"]
        assert f"00-{CLIENT_TRACE}-{call['context']['span_id']}-01" in seen, (name, seen)


def test_a_hedged_request_is_one_trace_with_both_copies(env):
    raw = env.client.chat.completions.with_raw_response.create(
        model="hedged", messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-autohedge-endpoint"] == "ok"
    server = server_span_of(env, raw.headers["x-request-id"])
    assert server["attributes"]["autohedge.hedged"] is True
    spans = spans_of(env, server["context"]["trace_id"], 3)
    calls = calls_under(spans, server)
    by_endpoint = {c["attributes"]["autohedge.endpoint"]: c for c in calls}
    assert set(by_endpoint) == {"slow", "ok"}, calls
    assert by_endpoint["ok"]["attributes"]["autohedge.hedged"] is True
    assert by_endpoint["slow"]["attributes"]["autohedge.outcome"] == "hedge_cancelled"
    assert by_endpoint["slow"]["status_code"] != "ERROR"


def test_a_broken_stream_and_its_continuation_are_one_trace(env):
    raw = env.client.chat.completions.with_raw_response.create(
        model="continued", stream=True, messages=[{"role": "user", "content": "hi"}])
    request_id = raw.headers["x-request-id"]
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text, "the stream carried content"
    server = server_span_of(env, request_id)
    assert server["attributes"]["autohedge.continuation"] is True
    spans = spans_of(env, server["context"]["trace_id"], 3)
    calls = calls_under(spans, server)
    first = next(c for c in calls if c["attributes"]["autohedge.endpoint"] == "broken")
    second = next(c for c in calls if c["attributes"]["autohedge.endpoint"] == "ok")
    assert first["status_code"] == "ERROR", first
    assert second["attributes"]["autohedge.continuation"] is True
    assert second["start_time"] >= first["start_time"]


def test_a_stopped_receiver_changes_no_answer(env):
    def burst(n):
        t = time.time()
        for _ in range(n):
            r = env.client.chat.completions.with_raw_response.create(
                model="failover", messages=[{"role": "user", "content": "load"}])
            assert r.http_response.status_code == 200
        return time.time() - t

    burst(10)
    up = burst(100) / 100
    env.phoenix.send_signal(signal.SIGKILL)
    env.phoenix.wait(timeout=10)
    # With nobody receiving the spans: every request served, at the pace it had (a request that
    # waited on an export even once would add seconds; noise is well under 4x).
    down = burst(200) / 200
    assert down < 4 * up + 0.025, (up, down)
    deadline = time.time() + 15
    while True:
        otlp = get_json(f"{env.gw}/status")["telemetry"]["otlp"]
        if otlp["failed_exports"] >= 1 and otlp["spans_dropped"] > 0:
            break
        assert time.time() < deadline, otlp
        time.sleep(0.3)
