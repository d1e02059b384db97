"""The drain, as a fleet's clients meet it: two gateways behind the official OpenAI SDK (its
default retries, its own HTTP client) spreading requests over both, each gateway restarted in
turn under load. SIGTERM makes a gateway answer `/health` 503 `draining` and close every
connection after its answer for `server.drain_delay`, then stop accepting and finish what it
holds; the SDK's retries land on the other gateway. Not one request may fail."""

import itertools
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request

import openai

try:  # The SDK's HTTP library (httpx2 in SDKs from 3.x, httpx before).
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))


def _health(port):
    """(status, body) of `/health`, or (None, error) when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError as e:
        return None, str(e)


class Spread(httpx.HTTPTransport):
    """Sends each request to the next gateway in turn, a retry to another gateway than the one
    whose connection just failed (as a balancer redispatches), and counts per port what came
    back: answers by status, and connections that failed. Without the redispatch, all three of
    a request's attempts could land on the gateway being restarted (the SDK's retries come
    within about 1.5 s; a restart on a loaded machine can take longer), which says nothing of
    how the gateways drain."""

    def __init__(self, ports):
        super().__init__()
        self._next = itertools.cycle(ports)
        self._lock = threading.Lock()
        self._failed = threading.local()
        self.answers = {p: {} for p in ports}
        self.errors = {p: 0 for p in ports}

    def handle_request(self, request):
        avoid = getattr(self._failed, "port", None)
        with self._lock:
            port = next(self._next)
            if port == avoid:
                port = next(self._next)
        request.url = request.url.copy_with(port=port)
        try:
            resp = super().handle_request(request)
        except httpx.TransportError:
            self._failed.port = port
            with self._lock:
                self.errors[port] += 1
            raise
        self._failed.port = None
        with self._lock:
            self.answers[port][resp.status_code] = self.answers[port].get(resp.status_code, 0) + 1
        return resp


def test_two_gateways_restarted_in_turn_under_the_sdk_fail_no_request():
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    procs = []
    try:
        script = d / "up.yaml"
        script.write_text('name: up\nreply: "Hello"\n')
        up = subprocess.Popen(
            [BIN, "mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "openai", "--script", str(script)],
            stdout=subprocess.PIPE, stderr=log, text=True,
        )
        procs.append(up)
        line = up.stdout.readline()
        assert "listening on http://" in line, line
        up_addr = line.strip().rsplit("http://", 1)[1]
        cfg = d / "config.yaml"
        cfg.write_text(textwrap.dedent(f"""
            server: {{ drain_delay: 1s, shutdown_grace: 10s }}
            models:
              a: {{ type: openai, base_url: "http://{up_addr}/v1" }}
            health: {{ probe_interval: 1h }}
        """))
        # Port 0 at first, the port read back from the gateway's line; a restart takes the
        # same port again (its clients know no other).
        ports = [0, 0]

        def serve(i):
            p = subprocess.Popen(
                [BIN, "serve", "--config", str(cfg), "--listen", f"127.0.0.1:{ports[i]}",
                 "--data-dir", str(d / f"data-{i}")],
                stdout=subprocess.PIPE, stderr=log, text=True,
            )
            line = p.stdout.readline()
            assert "listening on http://" in line, line
            ports[i] = int(line.strip().rsplit(":", 1)[1].rstrip("/"))
            deadline = time.time() + 30
            while _health(ports[i])[0] != 200:
                assert time.time() < deadline, f"gateway {i} never healthy"
                time.sleep(0.05)
            return p

        gws = [serve(0), serve(1)]
        procs += gws
        spread = Spread(ports)
        # The SDK's defaults (2 retries, its backoff) with the spreading transport under it.
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{ports[0]}/v1",
            api_key="client-key-unused",
            http_client=openai.DefaultHttpxClient(transport=spread),
        )
        assert client.max_retries == 2

        stop = threading.Event()
        ok, failed = [0], []
        lock = threading.Lock()

        def load():
            while not stop.is_set():
                try:
                    r = client.chat.completions.create(
                        model="a", messages=[{"role": "user", "content": "hi"}]
                    )
                    assert r.choices[0].message.content == "Hello"
                    with lock:
                        ok[0] += 1
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    with lock:
                        failed.append(repr(e))

        workers = [threading.Thread(target=load) for _ in range(6)]
        for w in workers:
            w.start()
        time.sleep(1)
        drained = []
        for i in range(2):
            before = dict(spread.answers[ports[i]])
            gws[i].send_signal(signal.SIGTERM)
            # At once: /health says draining while requests are still served there.
            deadline = time.time() + 5
            while True:
                status, body = _health(ports[i])
                if status == 503 and "draining" in body:
                    break
                assert time.time() < deadline, f"gateway {i}: /health {status} {body}"
                time.sleep(0.02)
            assert gws[i].wait(timeout=20) == 0, f"gateway {i} exited uncleanly"
            # Every 200 from port i since the SIGTERM (`before` was taken just before it) was
            # served while it drained: counted once it has exited, not in a window of time.
            with spread._lock:
                served_draining = spread.answers[ports[i]].get(200, 0) - before.get(200, 0)
            drained.append(served_draining)
            gws[i] = serve(i)
            procs.append(gws[i])
            time.sleep(1)
        stop.set()
        for w in workers:
            w.join(timeout=60)

        after = {p: dict(a) for p, a in spread.answers.items()}
        print(f"sdk drain: {ok[0]} requests served, answers by gateway {after}, "
              f"connections refused or cut {spread.errors}, served while draining {drained}")
        assert ok[0] > 100, ok[0]
        assert all(n > 0 for n in drained), f"each gateway served while it drained: {drained}"
        assert sum(spread.errors.values()) > 0, "the restarts were met by the clients (and retried)"
        assert failed == [], f"{len(failed)} of {ok[0] + len(failed)} requests failed: {failed[:5]}"
        assert all(set(a) == {200} for a in after.values()), after
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        tmp.cleanup()
