"""End-to-end: the official OpenAI Python SDK pointed at the real gateway binary, with
mock-upstream processes (the same binary) as backends on 127.0.0.1."""

import contextlib
import os
import pathlib
import signal
import subprocess
import tempfile
import textwrap

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))


def _start(args, log):
    proc = subprocess.Popen([BIN, *args], stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    if "listening on http://" not in line:
        proc.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return proc, line.strip().rsplit("http://", 1)[1]


def _serve(d, cfg_text, log, env=None):
    """Starts the gateway on port 0 with `cfg_text`; returns (process, OpenAI client)."""
    cfg = d / "config.yaml"
    cfg.write_text(textwrap.dedent(cfg_text))
    gw = subprocess.Popen(
        [BIN, "serve", "--config", str(cfg), "--listen", "127.0.0.1:0", "--data-dir", str(d / "data")],
        stdout=subprocess.PIPE, stderr=log, text=True, env=env,
    )
    line = gw.stdout.readline()
    assert "listening on http://" in line, line
    addr = line.strip().rsplit("http://", 1)[1]
    return gw, openai.OpenAI(base_url=f"http://{addr}/v1", api_key="client-key-unused", max_retries=0, timeout=10)


def _stop(procs, log, tmp):
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    log.close()
    tmp.cleanup()


@pytest.fixture(scope="module")
def gateway():
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    procs = []
    try:
        fail_script = d / "fail.yaml"
        fail_script.write_text("rules: [{status: 503}]\n")
        ok_script = d / "ok.yaml"
        ok_script.write_text('name: backup\nreply: "Hello from the backup!"\n')
        fail, fail_addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "openai", "--script", str(fail_script)], log)
        ok, ok_addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "vllm", "--script", str(ok_script)], log)
        procs += [fail, ok]
        env = dict(os.environ, AH_SDK_KEY="sk-sdk-test-key")
        gw, client = _serve(d, f"""
            models:
              primary: {{ type: openai, base_url: "http://{fail_addr}/v1", api_key: env:AH_SDK_KEY }}
              backup: {{ type: vllm, base_url: "http://{ok_addr}/v1", model: qwen }}
              broken: {{ type: openai, base_url: "http://{fail_addr}/v1" }}
            routing_policy: {{ fallback_chain: [primary, backup] }}
            routes:
              chat: [primary, backup]
              doomed: [broken]
        """, log, env)
        procs.append(gw)
        yield client
    finally:
        _stop(procs, log, tmp)


def test_plain_call_fails_over(gateway):
    raw = gateway.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-autohedge-endpoint"] == "backup"
    assert raw.headers["x-autohedge-attempts"] == "2"
    r = raw.parse()
    assert r.choices[0].message.content == "Hello from the backup!"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0


def test_stream(gateway):
    stream = gateway.chat.completions.create(
        model="chat",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert text == "Hello from the backup!"
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == 4


def test_embeddings(gateway):
    r = gateway.embeddings.create(model="chat", input=["one", "two"])
    assert len(r.data) == 2
    assert len(r.data[0].embedding) == 8
    assert r.data[0].embedding != r.data[1].embedding
    f = gateway.embeddings.create(model="chat", input="one", encoding_format="float")
    assert f.data[0].embedding == pytest.approx(r.data[0].embedding, rel=1e-6)


def test_completions(gateway):
    r = gateway.completions.create(model="chat", prompt="Say hi")
    assert r.choices[0].text == "Hello from the backup!"


def test_unknown_model_is_not_found(gateway):
    with pytest.raises(openai.NotFoundError) as e:
        gateway.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"


def test_bad_request(gateway):
    with pytest.raises(openai.BadRequestError) as e:
        gateway.chat.completions.create(model="chat", messages=[])
    assert e.value.status_code == 400


def test_all_failed_is_503(gateway):
    with pytest.raises(openai.InternalServerError) as e:
        gateway.chat.completions.create(model="doomed", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 503
    body = e.value.body
    assert body["code"] == "all_upstreams_failed"
    assert body["attempts"][0]["endpoint"] == "broken"
    assert body["attempts"][0]["status"] == 503


def test_stream_all_failed_raises(gateway):
    # Nothing was streamed, so the failure is a plain 503 the SDK raises before the first chunk.
    with pytest.raises(openai.InternalServerError) as e:
        for _ in gateway.chat.completions.create(
            model="doomed", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            pass
    assert e.value.status_code == 503
    assert e.value.body["code"] == "all_upstreams_failed"
    assert e.value.body["attempts"][0]["endpoint"] == "broken"
    assert e.value.response.headers["content-type"].startswith("application/json")


@pytest.fixture(scope="module")
def twins():
    """The same gateway in front of an Ollama endpoint and an OpenAI endpoint, each in a plain and
    a tool-calling variant, so the SDK can compare what it gets from each."""
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    procs = []
    try:
        plain = d / "plain.yaml"
        plain.write_text('reply: "Same words from either backend"\n')
        tools = d / "tools.yaml"
        tools.write_text("rules: [{tool_call: get_weather}]\n")
        addrs = {}
        for name, flavor, script in [
            ("ollama", "ollama", plain), ("openai", "openai", plain),
            ("ollama_tools", "ollama", tools), ("openai_tools", "openai", tools),
        ]:
            p, addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", flavor, "--script", str(script)], log)
            procs.append(p)
            addrs[name] = addr
        gw, client = _serve(d, f"""
            models:
              ollama: {{ type: ollama, host: "http://{addrs['ollama']}", model: "qwen2.5:7b" }}
              openai: {{ type: openai, base_url: "http://{addrs['openai']}/v1" }}
              ollama_tools: {{ type: ollama, host: "http://{addrs['ollama_tools']}", model: "qwen2.5:7b" }}
              openai_tools: {{ type: openai, base_url: "http://{addrs['openai_tools']}/v1" }}
            routes:
              only_ollama: [ollama]
              only_openai: [openai]
              tools_ollama: [ollama_tools]
              tools_openai: [openai_tools]
        """, log)
        procs.append(gw)
        yield client
    finally:
        _stop(procs, log, tmp)


def _stream_shape(client, model, **kw):
    """What a client's stream parser sees: per chunk, which delta fields are set."""
    shape, text, finish, tool_calls = [], "", None, {}
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            d = c.delta
            shape.append(tuple(k for k in ("role", "content", "tool_calls") if getattr(d, k)))
            text += d.content or ""
            finish = c.finish_reason or finish
            for tc in d.tool_calls or []:
                entry = tool_calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function.name:
                    entry["name"] = tc.function.name
                entry["arguments"] += tc.function.arguments or ""
    return shape, text, finish, tool_calls


def test_ollama_and_openai_streams_have_the_same_shape(twins):
    msgs = [{"role": "user", "content": "hi"}]
    a = _stream_shape(twins, "only_ollama", messages=msgs)
    b = _stream_shape(twins, "only_openai", messages=msgs)
    assert a[1] == b[1] == "Same words from either backend"
    assert a[2] == b[2] == "stop"
    assert a[0][0] == ("role",) and b[0][0] == ("role",)
    # The whole chunk sequence, in order and count, not just the set of shapes.
    assert a[0] == b[0], (a[0], b[0])


def test_ollama_and_openai_tool_calls_have_the_same_shape(twins):
    import json

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    results = []
    for model in ("tools_ollama", "tools_openai"):
        r = twins.chat.completions.create(model=model, messages=msgs, tools=tools)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id
        results.append((call.function.name, json.loads(call.function.arguments)))
        _, _, finish, streamed = _stream_shape(twins, model, messages=msgs, tools=tools)
        assert finish == "tool_calls"
        assert streamed[0]["name"] == "get_weather"
        assert json.loads(streamed[0]["arguments"]) == {"city": "Paris"}
    assert results[0] == results[1] == ("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module")
def hedged():
    """A route whose first endpoint answers after 30 s and whose second at once, hedged after
    150 ms with a 100% budget; and a route that continues broken streams on a vLLM mock."""
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    procs = []
    try:
        slow_script = d / "slow.yaml"
        slow_script.write_text('name: slow\nreply: "Hello from the slow one"\nrules: [{delay: 30s}]\n')
        fast_script = d / "fast.yaml"
        fast_script.write_text('name: fast\nreply: "one two three four five"\n')
        breaker_script = d / "breaker.yaml"
        breaker_script.write_text('reply: "one two three four five"\nrules: [{when: {stream: true}, reset_after: 2}]\n')
        slow, slow_addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "openai", "--script", str(slow_script)], log)
        fast, fast_addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "vllm", "--script", str(fast_script)], log)
        breaker, breaker_addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "openai", "--script", str(breaker_script)], log)
        procs += [slow, fast, breaker]
        gw, client = _serve(d, f"""
            models:
              slow: {{ type: openai, base_url: "http://{slow_addr}/v1" }}
              fast: {{ type: vllm, base_url: "http://{fast_addr}/v1" }}
              breaker: {{ type: openai, base_url: "http://{breaker_addr}/v1" }}
            routes:
              chat:
                chain: [slow, fast]
                hedge: {{ after: 150ms, max_extra: 100% }}
              cont:
                chain: [breaker, fast]
                continue_streams: true
        """, log)
        procs.append(gw)
        yield client
    finally:
        _stop(procs, log, tmp)


@pytest.mark.parametrize("stream", [False, True])
def test_a_hedge_serves_the_sdk_before_the_slow_endpoint_answers(hedged, stream):
    # The slow endpoint answers after 30 s: only a hedge can have "fast" serve this (a gateway
    # that waited would be served by "slow"), so no clock is needed to tell.
    raw = hedged.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], stream=stream)
    assert raw.headers["x-autohedge-endpoint"] == "fast"
    assert raw.headers["x-autohedge-hedged"] == "true"
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content
    assert text == "one two three four five"


def test_the_sdk_reads_a_continued_stream_as_one(hedged):
    chunks = list(hedged.chat.completions.create(
        model="cont", messages=[{"role": "user", "content": "count"}], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "one two three four five"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert len({c.id for c in chunks}) == 1


@contextlib.contextmanager
def _one_upstream(reply, cfg, env=None):
    """One OpenAI mock upstream answering `reply`, and a gateway whose config is `cfg` with
    `{up}` the mock's address. Yields (client, the mock's address)."""
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    procs = []
    try:
        ok_script = d / "ok.yaml"
        ok_script.write_text(f'name: up\nreply: "{reply}"\n')
        up, up_addr = _start(["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "openai", "--script", str(ok_script)], log)
        procs.append(up)
        gw, client = _serve(d, cfg.replace("{up}", up_addr), log, env)
        procs.append(gw)
        yield client, up_addr
    finally:
        _stop(procs, log, tmp)


@pytest.fixture(scope="module")
def keyed():
    """A gateway with client keys: one limited to the `chat` route at 2 requests a minute.
    Yields a function making an SDK client with a given api_key."""
    with _one_upstream("Hello, key holder", """
            models:
              up: { type: openai, base_url: "http://{up}/v1" }
            routes:
              chat: [up]
            auth:
              keys:
                - { name: sdk-user, key: env:SDK_CLIENT_KEY, models: [chat], rpm: 2 }
        """, dict(os.environ, SDK_CLIENT_KEY="sk-sdk-client-key-1234")) as (client, _):
        yield lambda key: openai.OpenAI(base_url=str(client.base_url), api_key=key, max_retries=0, timeout=10)


def test_client_keys_through_the_sdk(keyed):
    msg = [{"role": "user", "content": "hi"}]
    ok = keyed("sk-sdk-client-key-1234")
    r = ok.chat.completions.create(model="chat", messages=msg)
    assert r.choices[0].message.content == "Hello, key holder"
    with pytest.raises(openai.AuthenticationError) as e:
        keyed("sk-wrong").chat.completions.create(model="chat", messages=msg)
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as e:
        ok.chat.completions.create(model="up", messages=msg)
    assert e.value.code == "model_not_allowed"
    # The refused call counted as every call of a key does: the key's two a minute are spent.
    with pytest.raises(openai.RateLimitError) as e:
        ok.chat.completions.create(model="chat", messages=msg)
    assert e.value.code == "rate_limit_exceeded"
    assert e.value.response.headers["x-ratelimit-limit-requests"] == "2"


@pytest.fixture(scope="module")
def kept():
    """A route with `last_resort:` over one mock upstream; yields (client, the mock's address)."""
    with _one_upstream("Paris is the capital of France.", """
            models:
              up: { type: openai, base_url: "http://{up}/v1" }
            routes:
              chat: { chain: [up], last_resort: { ttl: 1h } }
            health: { probe_interval: 1h }
        """) as pair:
        yield pair


def test_the_sdk_reads_a_last_resort_answer_and_stream(kept):
    import urllib.request

    client, up_addr = kept
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="chat", messages=msgs, temperature=0)
    text = first.choices[0].message.content
    assert text
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="chat", messages=msgs, temperature=0, stream=True)
        if c.choices
    )
    assert streamed
    # The upstream goes down: every attempt fails.
    req = urllib.request.Request(f"http://{up_addr}/__mock/script", data=b"rules: [{status: 503}]", method="POST")
    urllib.request.urlopen(req, timeout=5).read()
    raw = client.chat.completions.with_raw_response.create(model="chat", messages=msgs, temperature=0)
    assert raw.headers["x-autohedge-served-from"] == "last_resort"
    assert int(raw.headers["age"]) >= 0
    assert raw.parse().choices[0].message.content == text
    again = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="chat", messages=msgs, temperature=0, stream=True)
        if c.choices
    )
    assert again == streamed
    # Another question: nothing kept, the 503.
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Other?"}], temperature=0)
    assert e.value.status_code == 503
