"""The mock upstream speaks OpenAI's Responses API (`POST /v1/responses`) as the official SDK
reads it: a Response object, the named and numbered event stream, a function call, and the
in-band failure a stream can carry right after `response.created`. The `ollama` flavor does not
speak it (404), as Ollama does not. The gateway's own `/v1/responses` is built on this mock."""

import json
import os
import pathlib
import subprocess
import tempfile

import openai
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("AUTOHEDGE_BIN", str(ROOT / "target" / "debug" / "autohedge"))


@pytest.fixture
def mock():
    """Starts a mock upstream with `flavor` and `script`; returns an OpenAI client on it."""
    procs = []
    tmp = tempfile.TemporaryDirectory()

    def start(flavor="openai", script="name: mock\n"):
        path = pathlib.Path(tmp.name) / f"script-{len(procs)}.yaml"
        path.write_text(script)
        p = subprocess.Popen(
            [BIN, "mock-upstream", "--listen", "127.0.0.1:0", "--flavor", flavor, "--script", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        procs.append(p)
        line = p.stdout.readline()
        assert "listening on http://" in line, line
        addr = line.strip().rsplit("http://", 1)[1]
        return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused", max_retries=0, timeout=10)

    yield start
    for p in procs:
        p.kill()
        p.wait()
    tmp.cleanup()


def test_a_plain_response(mock):
    client = mock(script='name: mock\nreply: "Hello there"\n')
    r = client.responses.create(model="m", instructions="Be brief.", input="Say hello")
    assert r.id.startswith("resp_")
    assert r.status == "completed"
    assert r.output_text == "Hello there"
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.instructions == "Be brief."
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == 2
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_the_event_stream_in_order(mock):
    client = mock(script='name: mock\nreply: "Hello there friend"\n')
    events = list(client.responses.create(model="m", input=[{"role": "user", "content": "hi"}], stream=True))
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there friend"
    done = events[-1].response
    assert done.output_text == "Hello there friend"
    assert done.usage.output_tokens == 3
    assert events[0].response.id == done.id


def test_a_function_call(mock):
    client = mock(script="name: mock\nrules: [{tool_call: get_weather}]\n")
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    r = client.responses.create(model="m", input="Weather in Paris?", tools=tools)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model="m", input="Weather in Paris?", tools=tools, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    assert events[-1].type == "response.completed"


def test_a_failure_right_after_created(mock):
    client = mock(script='name: mock\nrules: [{stream_error_after: 0, error: "quota exceeded"}]\n')
    events = list(client.responses.create(model="m", input="hi", stream=True))
    assert [e.type for e in events] == ["response.created", "response.failed"]
    assert events[1].response.status == "failed"
    assert events[1].response.error.message == "quota exceeded"


def test_ollama_does_not_speak_it(mock):
    client = mock(flavor="ollama")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="hi")
