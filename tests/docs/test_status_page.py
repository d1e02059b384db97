"""The live status page (`/docs`) in a real browser: Debian's headless Chromium, driven over the
DevTools protocol, loads the page from a running gateway; the test watches the DOM show an
endpoint turning unhealthy and back as its upstream's probes fail and recover — with no page
reload — and saves screenshots (target/test-artifacts/docs-*.png)."""

import base64
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
import websocket  # websocket-client

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from serverutil import start_autohedge, wait_http  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))
ARTIFACTS = ROOT / "target" / "test-artifacts"


def chromium_binary():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium on PATH: tests/run-all.sh installs Debian's chromium package")


class Page:
    """One browser tab over the DevTools protocol."""

    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expr, expect, timeout=30):
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            last = self.eval(expr)
            if last == expect:
                return
            time.sleep(0.2)
        raise AssertionError(f"{expr} stayed {last!r}, expected {expect!r}")

    def screenshot(self, name):
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path = ARTIFACTS / name
        path.write_bytes(base64.b64decode(data))
        return path


@pytest.fixture
def stack(tmp_path):
    yield from _stack(tmp_path, "")


@pytest.fixture
def replay_stack(tmp_path):
    yield from _stack(tmp_path, "audit: { capture_bodies: failed }\n")


def _stack(tmp_path, extra):
    procs = []
    log = open(tmp_path / "servers.log", "w")
    try:
        primary, primary_addr = start_autohedge(BIN, ["mock-upstream", "--listen", "127.0.0.1:0"], log)
        procs.append(primary)
        backup, backup_addr = start_autohedge(BIN, ["mock-upstream", "--listen", "127.0.0.1:0"], log)
        procs.append(backup)
        cfg = tmp_path / "config.yaml"
        cfg.write_text(
            "models:\n"
            f"  primary: {{ type: openai, base_url: 'http://{primary_addr}/v1', model: m }}\n"
            f"  backup: {{ type: openai, base_url: 'http://{backup_addr}/v1', model: m }}\n"
            "routing_policy: { fallback_chain: [primary, backup], slow_start: 0 }\n"
            "routes:\n  chat: [primary, backup]\n"
            "health: { probe_interval: 200ms, flip_after: 1 }\n" + extra
        )
        gw, gw_addr = start_autohedge(
            BIN, ["serve", "--listen", "127.0.0.1:0", "--config", str(cfg), "--data-dir", str(tmp_path / "data")], log)
        procs.append(gw)
        wait_http(f"http://{gw_addr}/health", gw)
        yield {"gateway": gw_addr, "primary": primary_addr, "tmp": tmp_path}
    finally:
        for p in procs:
            p.kill()
            p.wait()
        log.close()


@pytest.fixture
def browser(tmp_path):
    profile = tempfile.mkdtemp(dir=tmp_path)
    proc = subprocess.Popen(
        [chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-extensions", "--disable-background-networking", "--window-size=1280,1000",
         "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "chromium.log", "w"))
    try:
        port_file = pathlib.Path(profile) / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("chromium did not start: " + (tmp_path / "chromium.log").read_text()[-2000:])
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        yield port
    finally:
        proc.kill()
        proc.wait()


def open_tab(port, url):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/json/new?{url}", method="PUT")
    with urllib.request.urlopen(req, timeout=10) as r:
        target = json.load(r)
    return Page(target["webSocketDebuggerUrl"])


def set_script(addr, script):
    req = urllib.request.Request(f"http://{addr}/__mock/script", data=script.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status == 200


STATE = "(document.querySelector('tr[data-endpoint=\"primary\"] .state') || {}).textContent"


def test_the_live_page_shows_an_endpoint_turning_unhealthy_and_back(stack, browser):
    gw = stack["gateway"]
    page = open_tab(browser, f"http://{gw}/docs")
    page.call("Page.enable")
    page.wait_for(STATE, "healthy")
    # A mark on the window: still there at the end proves the page was never reloaded.
    page.eval("window.__sameDocument = 'yes'")
    # Traffic, so the page has figures and a failover to show.
    for _ in range(3):
        body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"http://{gw}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
    page.wait_for("document.querySelector('tr[data-endpoint=\"primary\"] td:nth-child(8)').textContent", "3")
    page.screenshot("docs-healthy.png")

    # The primary's probe (GET /v1/models) starts failing: the page turns it unhealthy, and
    # the chat chain shows it skipped.
    set_script(stack["primary"], "rules:\n  - when: {path: /v1/models}\n    status: 503\n    error: backend down\n")
    page.wait_for(STATE, "unhealthy")
    assert "skipped_unhealthy" in page.eval("document.querySelector('[data-chain=\"chat\"]').textContent")
    refreshes_before = int(page.eval("document.getElementById('updated').dataset.refreshes"))
    unhealthy_png = page.screenshot("docs-unhealthy.png")
    assert unhealthy_png.stat().st_size > 10_000

    # It recovers: the page turns it healthy again.
    set_script(stack["primary"], "")
    page.wait_for(STATE, "healthy")
    page.screenshot("docs-recovered.png")
    assert page.eval("window.__sameDocument") == "yes"
    assert int(page.eval("document.getElementById('updated').dataset.refreshes")) > refreshes_before

    # The copy-paste examples use this gateway's own address and a model it serves.
    curl = page.eval("document.getElementById('curl').textContent")
    python = page.eval("document.getElementById('python').textContent")
    assert f"http://{gw}/v1/chat/completions" in curl and '"model": "chat"' in curl
    assert f'base_url="http://{gw}/v1"' in python and 'model="chat"' in python
    # No external asset: every resource the page loaded came from the gateway itself.
    urls = page.eval("performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(f"http://{gw}/") for u in urls), urls


def chat(gw, model="chat", stream=False):
    body = json.dumps({"model": model, "stream": stream,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://{gw}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def dots(page, chart, series):
    return page.eval(
        f"document.querySelectorAll('figure[data-chart=\"{chart}\"] circle[data-series=\"{series}\"]').length")


def test_the_charts_draw_the_last_minutes_failovers_and_errors(stack, browser):
    gw = stack["gateway"]
    page = open_tab(browser, f"http://{gw}/docs")
    page.call("Page.enable")
    page.wait_for(STATE, "healthy")
    page.eval("window.__sameDocument = 'yes'")
    # Served at the primary first, then the primary answers 500: each request fails over to the
    # backup; then a model nobody serves: errors.
    for _ in range(4):
        assert chat(gw) == 200
    set_script(stack["primary"], "rules:\n  - when: {path: /v1/chat/completions}\n    status: 500\n    error: engine crashed\n")
    for _ in range(5):
        assert chat(gw) == 200
    # Streams, for the time to first token.
    for _ in range(2):
        assert chat(gw, stream=True) == 200
    for _ in range(3):
        assert chat(gw, model="nobody-serves-this") == 404
    # Without a reload the charts gain their points: requests, errors, failovers, and both
    # endpoints' latency and time to first token.
    page.wait_for("document.querySelectorAll('figure[data-chart=\"moves\"] circle[data-series=\"failovers\"]').length > 0", True)
    assert dots(page, "traffic", "requests") >= 1
    assert dots(page, "traffic", "errors") >= 1
    assert dots(page, "latency", "backup p50") >= 1
    assert dots(page, "latency", "primary p95") >= 1
    assert dots(page, "ttft", "backup p50") >= 1
    # The values drawn are the gateway's own: the failover chart's last point is what
    # /status.timeline counted.
    with urllib.request.urlopen(f"http://{gw}/status", timeout=10) as r:
        timeline = json.load(r)["timeline"]
    # Five failovers, and as many more as the streams made before the primary was ejected.
    failovers = sum(b["failovers"] for b in timeline["buckets"])
    assert 5 <= failovers <= 7, timeline
    assert sum(b["errors"].get("model_not_found", 0) for b in timeline["buckets"]) == 3, timeline
    titles = page.eval(
        "[...document.querySelectorAll('figure[data-chart=\"moves\"] circle[data-series=\"failovers\"] title')].map(t => t.textContent)")
    assert sum(int(t.split(": ")[1].split(" ")[0]) for t in titles) == failovers, titles
    assert page.eval("window.__sameDocument") == "yes"
    page.screenshot("docs-charts.png")
    urls = page.eval("performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(f"http://{gw}/") for u in urls), urls


def test_a_failover_is_replayed_from_the_page_to_the_endpoint_chosen(replay_stack, browser):
    gw = replay_stack["gateway"]
    # The primary answers 500: the request fails over to the backup, and its body is kept.
    set_script(replay_stack["primary"], "rules:\n  - when: {path: /v1/chat/completions}\n    status: 500\n    error: engine crashed\n")
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "replay me"}]}).encode()
    req = urllib.request.Request(f"http://{gw}/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json", "x-request-id": "docs-replay-1"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        assert r.headers["x-autohedge-endpoint"] == "backup"
    page = open_tab(browser, f"http://{gw}/docs")
    page.call("Page.enable")
    button = "document.querySelector('button[data-replay=\"docs-replay-1\"]')"
    page.wait_for(f"!!{button}", True)
    # The primary is back; the operator sends the request to it.
    set_script(replay_stack["primary"], "")
    page.eval("(() => { const s = document.querySelector('select[data-replay-to=\"docs-replay-1\"]');"
              " s.value = 'primary'; s.dispatchEvent(new Event('change')); })()")
    page.eval(f"{button}.click()")
    result = "(document.querySelector('[data-replay-result=\"docs-replay-1\"]') || {}).textContent || ''"
    page.wait_for(f"({result}).startsWith('→ 200 from primary')", True)
    text = page.eval(result)
    new_id = text.split("(")[1].rstrip(")")
    page.screenshot("docs-replay.png")
    # The trail has the replay's row: the primary served it, and it names what it replayed.
    import sqlite3
    db = replay_stack["tmp"] / "data" / "autohedge.db"
    deadline = time.time() + 10
    row = None
    while time.time() < deadline and row is None:
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT endpoint, status, replay_of FROM requests WHERE request_id = ?", (new_id,)).fetchone()
        time.sleep(0.2)
    assert row == ("primary", 200, "docs-replay-1"), row
