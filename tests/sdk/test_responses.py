"""`/v1/responses` through the gateway, driven by the official OpenAI Python SDK's
`responses.create` and `responses.stream`: passed through to an endpoint that speaks the
Responses API (the mock's `openai` flavor), translated to chat for one that does not (the
`ollama` flavor), failover before the first output delta, `response.failed` after it, and
conversations (`previous_response_id`) pinned to their endpoint, replayed from the gateway's
history when it dies, refused with `previous_response_unavailable` when none was kept."""

import json
import os
import pathlib
import signal
import subprocess
import tempfile
import textwrap
import time
import urllib.request

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


class Stack:
    """Mock upstreams and one gateway in front of them, all on 127.0.0.1 port 0."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = pathlib.Path(self.tmp.name)
        self.log = open(self.dir / "log.txt", "w")
        self.procs = []
        self.mocks = {}
        self.gw = None

    def mock(self, name, flavor, script):
        path = self.dir / f"{name}.yaml"
        path.write_text(textwrap.dedent(script))
        p = subprocess.Popen([BIN, "mock-upstream", "--listen", "127.0.0.1:0", "--flavor", flavor, "--script", str(path)],
                             stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = p.stdout.readline()
        assert "listening on http://" in line, line
        self.procs.append(p)
        self.mocks[name] = (p, line.strip().rsplit("http://", 1)[1])
        return self.mocks[name][1]

    def stats(self, name):
        with urllib.request.urlopen(f"http://{self.mocks[name][1]}/__mock/stats", timeout=5) as r:
            return json.load(r)

    def kill(self, name):
        p = self.mocks[name][0]
        p.kill()
        p.wait()

    def serve(self, config, key="unused", env=None):
        cfg = self.dir / "config.yaml"
        cfg.write_text(textwrap.dedent(config))
        self.gw = subprocess.Popen([BIN, "serve", "--config", str(cfg), "--listen", "127.0.0.1:0", "--data-dir", str(self.dir / "data")],
                                   stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self.gw.stdout.readline()
        assert "listening on http://" in line, line
        self.procs.append(self.gw)
        self.addr = line.strip().rsplit("http://", 1)[1]
        return self.client(key)

    def client(self, key="unused"):
        return openai.OpenAI(base_url=f"http://{self.addr}/v1", api_key=key, max_retries=0, timeout=20)

    def status(self):
        with urllib.request.urlopen(f"http://{self.addr}/status", timeout=5) as r:
            return json.load(r)

    def close(self):
        # Killed: a gateway drains for `server.drain_delay` on SIGTERM, which these tests do not
        # need to wait out (tests/front_door.rs covers the drain).
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.log.close()
        self.tmp.cleanup()


@pytest.fixture
def stack():
    s = Stack()
    yield s
    s.close()


def audit_rows(stack, n):
    """The gateway's audit rows (written off the request path: polled for, 30 s at most; the
    wait ends as soon as they are there)."""
    import sqlite3
    deadline = time.monotonic() + 30
    while True:
        con = sqlite3.connect(f"file:{stack.dir / 'data' / 'autohedge.db'}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        rows = [dict(r) for r in con.execute("SELECT * FROM requests ORDER BY id")]
        con.close()
        if len(rows) >= n or time.monotonic() > deadline:
            return rows


# The same four cases against an endpoint that speaks the Responses API and one that does not.
FLAVORS = [("openai", "native"), ("ollama", "translated")]


def one_endpoint(stack, flavor, script):
    addr = stack.mock("up", flavor, script)
    base = f"http://{addr}/v1" if flavor == "openai" else f"http://{addr}"
    return stack.serve(f"""
        models:
          up: {{ type: {flavor}, base_url: "{base}", model: served-model }}
    """)


@pytest.mark.parametrize("flavor,mode", FLAVORS)
def test_plain_text(stack, flavor, mode):
    client = one_endpoint(stack, flavor, 'name: up\nreply: "Hello there"\n')
    raw = client.responses.with_raw_response.create(model="up", instructions="Be brief.", input="Say hello")
    r = raw.parse()
    assert r.output_text == "Hello there"
    assert r.status == "completed"
    assert r.id.startswith("resp_") and len(r.id) == 53, r.id
    assert r.model in ("up", "served-model")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert raw.headers["x-autohedge-endpoint"] == "up"
    sent = stack.stats("up")["last_body"]
    if mode == "native":
        assert sent["model"] == "served-model" and sent["input"] == "Say hello" and sent["instructions"] == "Be brief."
    else:
        # Ollama's chat API: instructions became a system message.
        assert sent["messages"][0] == {"role": "system", "content": "Be brief."}, sent
        assert sent["messages"][-1]["content"] == "Say hello"
    status = stack.status()["endpoints"]["up"]["responses"]
    assert status["mode"] == mode, status


@pytest.mark.parametrize("flavor,mode", FLAVORS)
def test_stream_events(stack, flavor, mode):
    client = one_endpoint(stack, flavor, 'name: up\nreply: "Hello there friend"\n')
    with client.responses.stream(model="up", input=[{"role": "user", "content": "hi"}]) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types.count("response.created") == 1
    for t in ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"]:
        assert t in types, (t, types)
    assert types[-1] == "response.completed", types
    assert types.index("response.output_text.delta") < types.index("response.output_text.done")
    seqs = [e.sequence_number for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there friend"
    assert final.output_text == "Hello there friend"
    assert events[0].response.id == final.id and final.id.startswith("resp_")
    assert final.usage is not None and final.usage.output_tokens > 0


@pytest.mark.parametrize("flavor,mode", FLAVORS)
def test_function_call_round_trip(stack, flavor, mode):
    client = one_endpoint(stack, flavor, """
        name: up
        reply: "It is sunny in Paris."
        rules: [{times: 1, tool_call: get_weather}]
    """)
    first = client.responses.create(model="up", input="Weather in Paris?", tools=TOOLS)
    call = next(o for o in first.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    second = client.responses.create(
        model="up", previous_response_id=first.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "sunny"})}])
    assert second.output_text == "It is sunny in Paris."
    sent = stack.stats("up")["last_body"]
    if mode == "native":
        # The upstream's own id for the first turn, not the gateway's.
        assert sent["previous_response_id"].startswith("resp_") and sent["previous_response_id"] != first.id
    else:
        roles = [m["role"] for m in sent["messages"]]
        assert roles == ["user", "assistant", "tool"], sent["messages"]
        assert sent["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("flavor,mode", FLAVORS)
def test_two_turn_conversation(stack, flavor, mode):
    client = one_endpoint(stack, flavor, 'name: up\nreply: "Noted."\n')
    first = client.responses.create(model="up", input="My name is Ada.", store=True)
    second = client.responses.create(model="up", input="What is my name?", previous_response_id=first.id)
    assert second.output_text == "Noted." and second.id != first.id
    assert second.previous_response_id == first.id, "the client's own id, echoed"
    sent = stack.stats("up")["last_body"]
    if mode == "translated":
        texts = [m["content"] for m in sent["messages"]]
        assert texts == ["My name is Ada.", "Noted.", "What is my name?"], sent
    # The audit trail links the turns: the second row names the first, whose row names its
    # endpoint.
    rows = audit_rows(stack, 2)
    assert [r["response_id"] for r in rows] == [first.id, second.id]
    assert rows[1]["previous_response_id"] == first.id and rows[0]["endpoint"] == "up"
    assert all(r["operation"] == "responses" and r["status"] == 200 for r in rows)
    # Read back, by the gateway's id.
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == "Noted."
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    # An id the gateway never gave.
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="up", input="x", previous_response_id="resp_" + "0" * 48)
    assert e.value.body["code"] == "previous_response_not_found"


# Before the first output delta, each of these fails over invisibly: an in-band
# `response.failed` right after `response.created` (the Bifrost case), a stall past
# `timeouts.first_token`, a closed connection, an HTTP error.
BEFORE_THE_FIRST_DELTA = {
    "response.failed": '{stream_error_after: 0, error: "You exceeded your current quota"}',
    "stall": "{stall_after: 0}",
    "close": "{reset_after: 0}",
    "http error": "{status: 503}",
}


@pytest.mark.parametrize("failure", list(BEFORE_THE_FIRST_DELTA))
def test_a_failure_before_the_first_delta_fails_over_and_the_client_sees_one_created(stack, failure):
    rule = BEFORE_THE_FIRST_DELTA[failure]
    a = stack.mock("a", "openai", f'name: a\nreply: "from a"\nrules: [{rule}]\n')
    b = stack.mock("b", "openai", 'name: b\nreply: "from b"\n')
    client = stack.serve(f"""
        models:
          a: {{ type: openai, base_url: "http://{a}/v1", timeouts: {{ first_token: 500ms }} }}
          b: {{ type: openai, base_url: "http://{b}/v1" }}
        routes:
          r: [a, b]
    """)
    with client.responses.stream(model="r", input="hi") as s:
        events = list(s)
        final = s.get_final_response()
    assert stack.stats("a")["requests"] == 1, "a was tried first and its stream began"
    types = [e.type for e in events]
    assert types.count("response.created") == 1, types
    assert "response.failed" not in types, types
    assert final.output_text == "from b"
    assert events[0].response.id == final.id


def test_a_close_after_deltas_ends_with_response_failed_and_the_sdk_raises(stack):
    a = stack.mock("a", "openai", 'name: a\nreply: "one two three four five"\nrules: [{reset_after: 2}]\n')
    b = stack.mock("b", "openai", 'name: b\nreply: "from b"\n')
    client = stack.serve(f"""
        models:
          a: {{ type: openai, base_url: "http://{a}/v1" }}
          b: {{ type: openai, base_url: "http://{b}/v1" }}
        routes:
          r: [a, b]
    """)
    with client.responses.stream(model="r", input="hi") as s:
        events = list(s)
        with pytest.raises(RuntimeError):
            s.get_final_response()
    types = [e.type for e in events]
    assert types.count("response.output_text.delta") == 2, types
    assert types[-1] == "response.failed", types
    failed = events[-1]
    assert failed.response.status == "failed"
    assert failed.response.error.code == "stream_broken", failed.response.error
    assert failed.response.id == events[0].response.id
    assert failed.sequence_number > events[-2].sequence_number
    assert stack.stats("b")["requests"] == 0, "after the first delta nothing fails over"
    row = audit_rows(stack, 1)[-1]
    assert (row["endpoint"], row["error_class"], row["status"]) == ("a", "stream_broken", 200), row


@pytest.mark.parametrize("keep", [True, False])
def test_a_conversation_whose_endpoint_died(stack, keep):
    a = stack.mock("a", "openai", 'name: a\nreply: "Hi Ada."\n')
    b = stack.mock("b", "openai", 'name: b\nreply: "You are Ada."\n')
    history = "responses: { history: keep, history_ttl: 1h, history_max_bytes: 64MiB }" if keep else ""
    client = stack.serve(f"""
        models:
          a: {{ type: openai, base_url: "http://{a}/v1" }}
          b: {{ type: openai, base_url: "http://{b}/v1" }}
        routes:
          r: [a, b]
        {history}
    """)
    first = client.responses.create(model="r", input="My name is Ada.")
    assert first.output_text == "Hi Ada."
    stack.kill("a")
    if keep:
        raw = client.responses.with_raw_response.create(model="r", input="Who am I?", previous_response_id=first.id)
        second = raw.parse()
        assert second.output_text == "You are Ada."
        assert raw.headers["x-autohedge-endpoint"] == "b"
        sent = stack.stats("b")["last_body"]
        assert "previous_response_id" not in sent, "b never saw the conversation: it gets all of it"
        texts = [json.dumps(i) for i in sent["input"]]
        assert len(sent["input"]) == 3, sent["input"]
        assert "My name is Ada." in texts[0] and "Hi Ada." in texts[1] and "Who am I?" in texts[2], texts
    else:
        with pytest.raises(openai.APIStatusError) as e:
            client.responses.create(model="r", input="Who am I?", previous_response_id=first.id)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "previous_response_unavailable"
        assert "`a`" in e.value.body["message"]
        classes = [t["class"] for t in e.value.body["attempts"]]
        assert "skipped_pinned" in classes, classes
        assert stack.stats("b")["requests"] == 0


def test_a_hedge_race_on_responses(stack):
    # `slow` answers in 30 s, past the client's 20 s timeout: an answer at all is the hedge's
    # (no clock is needed to tell).
    slow = stack.mock("slow", "openai", 'name: slow\nreply: "slow"\nrules: [{delay: 30s}]\n')
    fast = stack.mock("fast", "openai", 'name: fast\nreply: "fast"\n')
    client = stack.serve(f"""
        models:
          slow: {{ type: openai, base_url: "http://{slow}/v1" }}
          fast: {{ type: openai, base_url: "http://{fast}/v1" }}
        routes:
          r:
            chain: [slow, fast]
            hedge: {{ after: 100ms, max_extra: 100% }}
    """)
    raw = client.responses.with_raw_response.create(model="r", input="hi")
    assert raw.parse().output_text == "fast"
    assert raw.headers["x-autohedge-hedged"] == "true"
    assert raw.headers["x-autohedge-endpoint"] == "fast"
    assert stack.stats("slow")["requests"] == 1, "the slow one was called first"
    row = audit_rows(stack, 1)[-1]
    assert (row["hedges"], row["hedge_won"]) == (1, 1), row


def test_a_key_may_not_follow_a_conversation_to_an_endpoint_it_may_no_longer_use(stack):
    a = stack.mock("a", "openai", 'name: a\nreply: "on a"\n')
    b = stack.mock("b", "openai", 'name: b\nreply: "on b"\n')
    template = """
        models:
          a: {{ type: openai, base_url: "http://{a}/v1" }}
          b: {{ type: openai, base_url: "http://{b}/v1" }}
        routes:
          r: [a, b]
        responses: {{ history: keep }}
        auth:
          keys:
            - {{ name: team, key: env:AH_TEAM_KEY, models: [{models}] }}
    """
    env = dict(os.environ, AH_TEAM_KEY="sk-team-key-0001")
    client = stack.serve(template.format(a=a, b=b, models="r"), key="sk-team-key-0001", env=env)
    first = client.responses.create(model="r", input="hi")
    assert first.output_text == "on a"
    # The operator narrows the key to `b` alone.
    (stack.dir / "config.yaml").write_text(textwrap.dedent(template.format(a=a, b=b, models="b")))
    reloads = stack.status()["config"]["reloads"]
    stack.gw.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while stack.status()["config"]["reloads"] == reloads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stack.status()["config"]["reloads"] > reloads
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.responses.create(model="b", input="again", previous_response_id=first.id)
    assert e.value.body["code"] == "model_not_allowed"
    assert stack.stats("a")["requests"] == 1


@pytest.mark.parametrize("keep", [True, False])
def test_a_pinned_endpoint_that_lost_the_conversation(stack, keep):
    # Every second call: the 404 OpenAI (or a vLLM that keeps no responses) gives for a
    # previous response it no longer holds.
    a = stack.mock("a", "openai", """
        name: a
        reply: "Still Ada."
        rules: [{when: {every: 2}, status: 404, error: "Previous response with id 'resp_1' not found.", error_code: previous_response_not_found}]
    """)
    history = "responses: { history: keep }" if keep else ""
    client = stack.serve(f"""
        models:
          a: {{ type: openai, base_url: "http://{a}/v1" }}
        {history}
    """)
    first = client.responses.create(model="a", input="My name is Ada.")
    if keep:
        raw = client.responses.with_raw_response.create(model="a", input="Who am I?", previous_response_id=first.id)
        assert raw.parse().output_text == "Still Ada."
        assert raw.headers["x-autohedge-endpoint"] == "a"
        assert raw.headers["x-autohedge-attempts"] == "2", "the pinned call, then the replay on the same endpoint"
        sent = stack.stats("a")["last_body"]
        assert "previous_response_id" not in sent and len(sent["input"]) == 3, sent
        assert stack.status()["endpoints"]["a"]["state"] == "healthy", "a lost pin is not the endpoint's fault"
    else:
        with pytest.raises(openai.APIStatusError) as e:
            client.responses.create(model="a", input="Who am I?", previous_response_id=first.id)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "previous_response_unavailable"
        assert [t["class"] for t in e.value.body["attempts"]] == ["previous_response_lost"]


def test_one_keys_responses_are_not_anothers(stack):
    a = stack.mock("a", "openai", 'name: a\nreply: "mine"\n')
    env = dict(os.environ, AH_KEY_A="sk-team-a-0001", AH_KEY_B="sk-team-b-0002")
    mine = stack.serve(f"""
        models:
          a: {{ type: openai, base_url: "http://{a}/v1" }}
        responses: {{ history: keep }}
        auth:
          keys:
            - {{ name: team-a, key: env:AH_KEY_A }}
            - {{ name: team-b, key: env:AH_KEY_B }}
    """, key="sk-team-a-0001", env=env)
    theirs = stack.client("sk-team-b-0002")
    r = mine.responses.create(model="a", input="a secret")
    assert mine.responses.retrieve(r.id).output_text == "mine", "its owner reads it"
    with pytest.raises(openai.NotFoundError) as e:
        theirs.responses.create(model="a", input="continue theirs", previous_response_id=r.id)
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(r.id)
    assert mine.responses.retrieve(r.id).output_text == "mine", "another key's delete changed nothing"
    assert stack.stats("a")["requests"] == 1, "no refused request reached the upstream"


def test_the_key_pays_what_usage_says_and_the_context_guard_counts_the_input(stack):
    small = stack.mock("small", "openai", 'name: small\nreply: "small"\n')
    big = stack.mock("big", "openai", 'name: big\nreply: "one two three"\n')
    env = dict(os.environ, AH_KEY="sk-team-0001")
    client = stack.serve(f"""
        models:
          small: {{ type: openai, base_url: "http://{small}/v1", context_window: 200 }}
          big: {{ type: openai, base_url: "http://{big}/v1", context_window: 100000, cost: {{ input_per_mtok: 1000000, output_per_mtok: 2000000 }} }}
        routes:
          r: [small, big]
        auth:
          keys:
            - {{ name: team, key: env:AH_KEY, budget_usd: 1000000 }}
    """, key="sk-team-0001", env=env)
    # `instructions` and `input` items count: too long for `small`'s window, never sent to it.
    long = "word " * 400
    raw = client.responses.with_raw_response.create(
        model="r", instructions=long, input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    r = raw.parse()
    assert raw.headers["x-autohedge-endpoint"] == "big"
    assert stack.stats("small")["requests"] == 0
    row = audit_rows(stack, 1)[-1]
    assert (row["tokens_in"], row["tokens_out"]) == (r.usage.input_tokens, r.usage.output_tokens)
    assert row["tokens_estimated"] == 0
    expected = r.usage.input_tokens * 1.0 + r.usage.output_tokens * 2.0
    assert abs(row["cost_usd"] - expected) < 1e-6, (row["cost_usd"], expected)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        spent = stack.status()["auth"]["spend_this_month_usd"].get("team", 0)
        if spent:
            break
        time.sleep(0.05)
    assert abs(spent - expected) < 1e-6, (spent, expected)


def test_an_endpoint_that_404s_responses_is_marked_chat_only_and_served_by_translation(stack):
    # An OpenAI-type endpoint (the `responses` capability by default) on a server that has no
    # `/responses`: the Ollama flavor's OpenAI-compatible chat path, 404 for the rest.
    srv = stack.mock("srv", "ollama", 'name: srv\nreply: "Hello by chat"\n')
    client = stack.serve(f"""
        models:
          srv: {{ type: openai, base_url: "http://{srv}/v1", model: qwen }}
    """)
    assert stack.status()["endpoints"]["srv"]["responses"]["mode"] == "native"
    raw = client.responses.with_raw_response.create(model="srv", input="hi")
    assert raw.parse().output_text == "Hello by chat"
    assert raw.headers["x-autohedge-attempts"] == "2", "the 404, then the same endpoint by chat"
    # A client's 404 alone marks nothing: the gateway's own probe (a body with no client
    # content, which a server with the route refuses with 400) answers 404 too, in the
    # background, and that marks the endpoint.
    for _ in range(200):
        mode = stack.status()["endpoints"]["srv"]["responses"]
        if mode["mode"] == "translated":
            break
        time.sleep(0.05)
    assert mode["mode"] == "translated" and mode["reason"] == "chat_only", mode
    st = stack.stats("srv")
    assert st["by_path"].get("/v1/responses") == 2 and st["by_path"].get("/v1/chat/completions") == 1, st
    assert stack.status()["endpoints"]["srv"]["state"] == "healthy"
    # Learned: the next request goes by chat at once.
    raw = client.responses.with_raw_response.create(model="srv", input="hi")
    assert raw.headers["x-autohedge-attempts"] == "1"
    assert stack.stats("srv")["by_path"].get("/v1/responses") == 2


def test_what_chat_cannot_say_is_a_400_only_when_no_endpoint_can_serve_it(stack):
    chat = stack.mock("chat", "ollama", 'name: chat\nreply: "by chat"\n')
    native = stack.mock("native", "openai", 'name: native\nreply: "natively"\n')
    client = stack.serve(f"""
        models:
          chat: {{ type: ollama, base_url: "http://{chat}", model: qwen }}
          native: {{ type: openai, base_url: "http://{native}/v1" }}
        routes:
          only_chat: [chat]
          mixed: [chat, native]
    """)
    web = [{"type": "web_search"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="only_chat", input="news?", tools=web)
    assert e.value.body["code"] == "unsupported_parameter"
    assert "`tools[0]` of type `web_search`" in e.value.body["message"]
    assert stack.stats("chat")["requests"] == 0, "never sent"
    # A chain with an endpoint that speaks the Responses API serves it there: no 400, no 503.
    raw = client.responses.with_raw_response.create(model="mixed", input="news?", tools=web)
    assert raw.parse().output_text == "natively"
    assert raw.headers["x-autohedge-endpoint"] == "native"


def test_a_translated_stream_carries_function_call_argument_deltas(stack):
    client = one_endpoint(stack, "ollama", "name: up\nrules: [{tool_call: get_weather}]\n")
    with client.responses.stream(model="up", input="Weather in Paris?", tools=TOOLS) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types, types
    assert "response.function_call_arguments.done" in types, types
    call = next(o for o in final.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
