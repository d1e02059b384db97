"""The gateway in front of a server others wrote: llama.cpp's, through llama-cpp-python, serving a
tiny random-weight GGUF model made by make_tiny_gguf.py. Plain and streamed chat, usage, a prompt
over the model's 256-token context going to a larger endpoint, and failover when the server is
stopped."""

import os
import pathlib
import signal
import subprocess
import sys
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

pytest.importorskip("llama_cpp", reason="llama-cpp-python[server] is installed by tests/run-all.sh")


@pytest.fixture(scope="module")
def stack():
    tmp = tempfile.TemporaryDirectory()
    d = pathlib.Path(tmp.name)
    log = open(d / "log.txt", "w")
    model = d / "tiny.gguf"
    subprocess.run([sys.executable, str(HERE / "make_tiny_gguf.py"), str(model)], check=True)
    # Port 0: the server binds a free port itself; we read it back (no bind-release race).
    llama = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", "256",
         "--host", "127.0.0.1", "--port", "0"],
        stdout=log, stderr=log,
    )
    procs = [llama]
    try:
        port = listening_port(llama, timeout=60)
        wait_http(f"http://127.0.0.1:{port}/v1/models", llama)
        big_script = d / "big.yaml"
        big_script.write_text('name: big\nreply: "Served by the large-context endpoint"\n')
        big, big_addr = start_autohedge(BIN, ["mock-upstream", "--listen", "127.0.0.1:0", "--flavor", "openai", "--script", str(big_script)], log)
        procs.append(big)
        cfg = d / "config.yaml"
        cfg.write_text(textwrap.dedent(f"""
            models:
              # No context_window configured: the gateway learns it from the server's own error.
              llamacpp:
                type: openai
                base_url: "http://127.0.0.1:{port}/v1"
                model: tiny
                timeouts: {{ connect: 1s, first_token: 20s, total: 60s }}
              llamacpp_stream:
                type: openai
                base_url: "http://127.0.0.1:{port}/v1"
                model: tiny
                timeouts: {{ connect: 1s, first_token: 20s, total: 60s }}
              big: {{ type: openai, base_url: "http://{big_addr}/v1", context_window: 128000 }}
            routing_policy: {{ fallback_chain: [llamacpp, big] }}
            routes:
              chat: [llamacpp, big]
              chat_stream: [llamacpp_stream, big]
        """))
        gw, addr = start_autohedge(BIN, ["serve", "--config", str(cfg), "--listen", "127.0.0.1:0", "--data-dir", str(d / "data")], log)
        procs.append(gw)
        client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, llama, addr
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()
        tmp.cleanup()


MSG = [{"role": "user", "content": "hello world"}]


def test_plain_chat_with_usage(stack):
    client, _, _ = stack
    raw = client.chat.completions.with_raw_response.create(model="chat", messages=MSG, max_tokens=6, temperature=0)
    assert raw.headers["x-autohedge-endpoint"] == "llamacpp"
    r = raw.parse()
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert r.usage.completion_tokens > 0  # llama-cpp-python counts a few past max_tokens


def test_streamed_chat(stack):
    client, _, _ = stack
    chunks = list(client.chat.completions.create(model="chat", messages=MSG, max_tokens=6, stream=True, temperature=0))
    assert chunks, "a stream came back"
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes and finishes[-1] in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_goes_to_a_larger_endpoint(stack, stream):
    import json
    client, _, addr = stack
    model = "chat_stream" if stream else "chat"
    endpoint = "llamacpp_stream" if stream else "llamacpp"
    long = [{"role": "user", "content": "hello world " * 200}]
    # First: llama.cpp refuses with its own context error; the gateway fails over to `big`.
    raw = client.chat.completions.with_raw_response.create(model=model, messages=long, max_tokens=8, stream=stream)
    assert raw.headers["x-autohedge-endpoint"] == "big"
    assert raw.headers["x-autohedge-attempts"] == "2"
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content
    assert text == "Served by the large-context endpoint"
    if stream:
        # llama-cpp-python answers a streamed overflow with 200 and an empty event stream (its
        # generator raises before the first chunk): no text to learn from, but no content either,
        # so the gateway fails over before committing.
        return
    # The refusal stated the limit: learned, and used before calling next time.
    status = json.load(urllib.request.urlopen(f"http://{addr}/status"))
    assert status["endpoints"][endpoint]["learned_context_window"] == 256
    raw = client.chat.completions.with_raw_response.create(model=model, messages=long, max_tokens=8, stream=stream)
    assert raw.headers["x-autohedge-endpoint"] == "big"
    assert raw.headers["x-autohedge-attempts"] == "1"


def test_responses_reach_llamacpp_by_translation(stack):
    """`/v1/responses` against a server that speaks only chat: its 404 for `/responses` sends the
    request on translated, the gateway's probe of the route marks it chat-only, and every later
    one goes to it translated; the four cases of
    the Responses API as the SDK drives them."""
    import json
    client, _, addr = stack
    raw = client.responses.with_raw_response.create(model="llamacpp", instructions="Be brief.",
                                                    input="hello world", max_output_tokens=6, temperature=0)
    assert raw.headers["x-autohedge-endpoint"] == "llamacpp"
    r = raw.parse()
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and isinstance(r.output_text, str)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    # Marked by the gateway's own probe of the route (a client's 404 alone marks nothing),
    # made in the background.
    for _ in range(200):
        mode = json.load(urllib.request.urlopen(f"http://{addr}/status"))["endpoints"]["llamacpp"]["responses"]
        if mode["mode"] == "translated":
            break
        time.sleep(0.05)
    assert mode["mode"] == "translated" and mode["reason"] == "chat_only", mode
    # Streamed: the Responses event sequence, made by the gateway from llama.cpp's chat chunks.
    # (Cut at max_output_tokens it ends `response.incomplete`, as OpenAI's does; the SDK's
    # `get_final_response` wants `response.completed`, so the last event is read instead.)
    with client.responses.stream(model="llamacpp", input="hello world", max_output_tokens=6, temperature=0) as s:
        events = list(s)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output[0].content[0].text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # A function call's second half: the call and its output, replayed as chat tool messages.
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    r = client.responses.create(model="llamacpp", tools=tools, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 0
    # Two turns: the second is the whole conversation, replayed from what the gateway kept.
    first = client.responses.create(model="llamacpp", input="My name is Ada.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model="llamacpp", input="Who am I?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens, "the first turn was sent again"


def test_failover_when_the_server_is_stopped(stack):
    client, llama, _ = stack
    llama.send_signal(signal.SIGTERM)
    llama.wait(timeout=15)
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(model="chat", messages=MSG, max_tokens=6, stream=stream)
        assert raw.headers["x-autohedge-endpoint"] == "big"
