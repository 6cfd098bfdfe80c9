"""The OpenAI-compatible server, live on loopback (`infinigen serve` in a subprocess), driven with the real
openai client and with raw HTTP for bad input, disconnects, the API key, the queue bound and SIGTERM."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import save_tiny

openai = pytest.importorskip("openai")
MODEL = "tiny"


class Server:
    def __init__(self, model_dir, log, *extra):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "infinigen_kv.cli", "serve", "--model", model_dir, "--served-model-name", MODEL,
             "--port", str(self.port), "--max-tokens-limit", "900", "--max-body-bytes", "65536", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            assert self.proc.poll() is None, open(log).read()
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not listening yet, or (Ray's proxy) busy
                time.sleep(0.3)
        raise TimeoutError(open(log).read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def metric(self, name, headers=None) -> float:
        text = requests.get(self.url + "/metrics", headers=headers, timeout=5).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("serve-model"), eos_never_greedy=True)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = Server(model_dir, tmp_path_factory.mktemp("log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


class StubEngine:
    """Just what create_app, /metrics, /v1/models and a completion's first steps touch: encoding a prompt raises
    `error`."""

    method, queue_depth, admitting, context, running, waiting, pool_bytes, max_pool_bytes = "full", 0, True, 1024, 0, 0, 0, 1
    last = {"decode_tokens_per_s": 0.0, "fetched_fraction": 0.0}

    def __init__(self, error: Exception):
        from infinigen_kv.serve.metrics import Metrics

        self.error, self.metrics = error, Metrics(self)

    def encode(self, text):
        raise self.error


def chat(client, **kw):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "The pass key is 12345. Remember it."}],
                max_tokens=8, temperature=0)
    return client.chat.completions.create(**{**args, **kw})


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and abs(models[0].created - time.time()) < 3600  # when it started


def test_chat_plain_and_streaming_agree(client):
    r = chat(client)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    assert isinstance(text, str) and text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_completions_plain_and_streaming(client):
    r = client.completions.create(model=MODEL, prompt="All that glitters", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=MODEL, prompt="All that glitters", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence(client):
    text = chat(client, max_tokens=30).choices[0].message.content
    stop = text.strip()[4:7]
    assert len(stop) == 3
    want = text[: text.find(stop)]
    r = chat(client, max_tokens=30, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=30, stop=stop, stream=True))
    assert streamed == want


def test_seeded_sampling_reproducible(client):
    a, b = (chat(client, temperature=1.0, seed=7, max_tokens=12).choices[0].message.content for _ in range(2))
    assert a == b


def test_concurrent_requests_are_all_served(client):
    out, errors = {}, []

    def ask(i):
        try:
            r = client.completions.create(model=MODEL, prompt="The quick brown fox " * (i + 1), max_tokens=4 + i,
                                          temperature=0)
            out[i] = r.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and out == {i: 4 + i for i in range(6)}


BAD = [
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),  # wrong type
    ({"model": MODEL}, 400, "messages"),  # missing
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n"),  # over --max-batch
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 1200}]}, 400, "messages"),  # > context
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    # a seed a generator cannot take (was a 500 for the whole batch), booleans that are not
    # booleans, and fields we cannot honour (were silently ignored)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 400, "seed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": -2**70}, 400, "seed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400, "tool_choice"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_object"}}, 400, "response_format"),
    # text that is no Unicode, and top_logprobs without logprobs
    ({"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["\udfff"]}, 400, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    # every field acts or is refused, naming it
    *[({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}, 400, field) for field, value in [
        ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
        ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 200}), ("logit_bias", {"99999": 1}), ("ignore_eos", "yes"),
        ("best_of", 2), ("suffix", "x"), ("echo", True), ("functions", [{"name": "f"}]), ("guided_json", {}),
        ("no_such_field", 1)]],
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    # JSON types strictly: a string is not a number, 5.0 is not an integer
    *[({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], field: value}, 400, field) for field, value in [
        ("max_tokens", "5"), ("max_tokens", 5.0), ("temperature", "0"), ("n", "2"), ("seed", "7")]],
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_is_a_4xx_error_json(server, body, status, param):
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_validation_errors_say_what_was_wrong(server):
    url = server.url + "/v1/chat/completions"
    hi = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}

    def message(url=url, **kw):
        r = requests.post(url, **kw)
        assert r.status_code == 400 and r.json()["error"]["code"], r.text
        return r.json()["error"]["message"]

    assert message(json={"model": MODEL, "messages": [{"role": "user", "content": 5}]}) == (
        "Invalid type for 'messages[0].content': expected a string or a list of content parts, but got an integer "
        "instead.")
    assert message(json={**hi, "max_tokens": "5"}) == (
        "Invalid type for 'max_tokens': expected an integer, but got a string instead.")
    assert message(json={**hi, "temperature": "0"}) == (
        "Invalid type for 'temperature': expected a number, but got a string instead.")
    assert message(json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": 7}]}).startswith(
        "messages[1].role: ")
    # bounds in a JSON user's words (not pydantic's), every error with a code
    assert message(json={"model": MODEL, "messages": []}) == "'messages' must have at least 1 item, got 0"
    assert message(json={**hi, "n": 0}) == "'n' must be >= 1, got 0"
    assert message(json={"model": MODEL, "prompt": [{"a": 1}]}, url=server.url + "/v1/completions") == (
        "Invalid type for 'prompt': expected a string or a list of token ids, but got a list holding an object "
        "instead.")
    r = requests.post(url, json={**hi, "max_tokens": 10**9})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    form = {"Content-Type": "application/x-www-form-urlencoded"}  # curl -d without -H
    assert message(data=json.dumps(hi), headers=form) == "send a JSON body with Content-Type: application/json"
    assert message(json=[hi]) == "the body must be a JSON object"


def test_malformed_json_oversized_body_and_unknown_route(server):
    url = server.url + "/v1/completions"
    r = requests.post(url, data=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = requests.post(url, json={"model": MODEL, "prompt": "x" * 70000})
    assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
    r = requests.post(url, data=(b"x" * 10000 for _ in range(10)))  # chunked, no Content-Length
    assert r.status_code == 413
    r = requests.post(url, json={"model": MODEL, "prompt": "word " * 1200})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "1024" in r.json()["error"]["message"]
    r = requests.post(url, json={"model": MODEL, "prompt": [5, 99999]})
    assert r.status_code == 400
    r = requests.post(url, json={"model": MODEL, "prompt": "a\ud800b"})  # a lone surrogate: not text
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = requests.post(url, json={"model": MODEL, "prompt": "hi", "logprobs": 6})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert requests.get(server.url + "/nope").json()["error"]["type"] == "not_found_error"
    assert requests.get(server.url + "/health").json()["status"] == "ok"


def test_disconnect_mid_stream_frees_the_place(server, client):
    before = server.metric("infinigen_cancelled_requests_total")
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 900, "temperature": 0, "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith(b"data: {") for line in got)
    deadline = time.time() + 20
    while time.time() < deadline and (server.metric("infinigen_queue_depth") > 0 or
                                      server.metric("infinigen_cancelled_requests_total") <= before):
        time.sleep(0.1)
    assert server.metric("infinigen_cancelled_requests_total") == before + 1
    assert server.metric("infinigen_queue_depth") == 0
    # its rows left the batch: no request runs and no KV cache is held
    assert server.metric("infinigen_running_requests") == 0 and server.metric("infinigen_pool_bytes") == 0
    assert chat(client, max_tokens=3).usage.completion_tokens == 3


def test_a_request_joins_the_running_batch(server, client):
    """Continuous batching: a short request sent while a long one streams is answered while the
    long one is still generating (statically batched, it waited for the long one's end)."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 900, "temperature": 0, "stream": True}
    with requests.post(server.url + "/v1/completions", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
        assert chat(client, max_tokens=3).usage.completion_tokens == 3
        deadline = time.time() + 60  # the gauge follows at the end of the worker's step
        while server.metric("infinigen_running_requests") != 1 and time.time() < deadline:
            time.sleep(0.01)
        assert server.metric("infinigen_running_requests") == 1  # the long one goes on
        rest = [x for x in lines if x]
    assert rest[-1] == b"data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert server.metric("infinigen_time_to_first_token_seconds_count") >= 2
    assert server.metric("infinigen_inter_token_latency_seconds_count") >= 899


def test_disconnect_of_a_plain_request_frees_the_place(server):
    """A non-streaming client that leaves is cancelled at once (it ran to max_tokens)."""
    before = server.metric("infinigen_cancelled_requests_total")
    steps = server.metric("infinigen_decode_steps_total")
    body = json.dumps({"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 900, "temperature": 0})
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.time() + 20
        while server.metric("infinigen_queue_depth") == 0 and time.time() < deadline:  # wait until it runs
            time.sleep(0.01)
    t0 = time.time()
    while server.metric("infinigen_queue_depth") > 0 and time.time() < t0 + 60:
        time.sleep(0.01)
    assert server.metric("infinigen_cancelled_requests_total") == before + 1
    ran = server.metric("infinigen_decode_steps_total") - steps
    assert ran < 450, ran  # stopped when the client left, not at its 900 tokens (counted in steps: any machine speed)


def test_logprobs_chat_and_completions(client, server):
    """Logprobs / top_logprobs (were silently ignored)."""
    r = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob  # greedy
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    assert chat(client, max_tokens=2).choices[0].logprobs is None  # not asked: none

    stream = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7, temperature=0,
                                       logprobs=2, stream=True, stream_options={"include_usage": True})
    tokens, usage, text = [], None, ""
    for c in stream:
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            text += ch.text
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                assert all(len(t) == 2 for t in ch.logprobs.top_logprobs)
    assert len(tokens) == usage.completion_tokens == 7
    plain = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7, temperature=0,
                                      logprobs=0)
    assert plain.choices[0].logprobs.tokens == tokens and plain.choices[0].text == text
    assert plain.choices[0].logprobs.text_offset == [sum(map(len, tokens[:i])) for i in range(7)]


def test_an_unexpected_error_is_a_counted_500():
    """An exception no handler takes answers a 500 error JSON and /metrics counts it (the
    500 was answered outside the counting middleware, with an ASGI traceback in the log)."""
    from fastapi.testclient import TestClient

    from infinigen_kv.serve.app import create_app

    with TestClient(create_app(StubEngine(TypeError("stand-in bug")), MODEL), raise_server_exceptions=False) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "stand-in bug" not in r.text  # no internals to the client
        counted = [l for l in http.get("/metrics").text.splitlines()
                   if l.startswith("infinigen_requests_total") and 'status="500"' in l]
        assert counted and float(counted[0].split()[-1]) == 1.0


def test_the_server_answers_to_its_id_and_the_path_it_was_given(tmp_path):
    """The served id (a .gguf's stem by default) is what /v1/models lists and responses carry; a request may also name
    the model by the path the server was started with; any other name is a 404."""
    from fastapi.testclient import TestClient

    from infinigen_kv.serve.app import create_app

    path = str(tmp_path / "qwen2.5-coder-0.5b-instruct-q8_0.gguf")  # encoding a prompt is past the model check
    app = create_app(StubEngine(LookupError("past the model check")), "qwen2.5-coder-0.5b-instruct-q8_0",
                     aliases=(path,))
    with TestClient(app, raise_server_exceptions=False) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["qwen2.5-coder-0.5b-instruct-q8_0"]
        for name in ("qwen2.5-coder-0.5b-instruct-q8_0", path):
            assert http.post("/v1/completions", json={"model": name, "prompt": "hi"}).status_code == 500  # (the stub)
        r = http.post("/v1/completions", json={"model": "qwen2.5", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert "'qwen2.5-coder-0.5b-instruct-q8_0'" in r.json()["error"]["message"]


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4)  # (whatever ran before)
    text = requests.get(server.url + "/metrics").text
    for name in ("infinigen_requests_total", "infinigen_prompt_tokens_total", "infinigen_completion_tokens_total",
                 "infinigen_decode_tokens_per_second", "infinigen_fetched_fraction", "infinigen_queue_depth",
                 "infinigen_pool_bytes", 'infinigen_replica_info{method="infinigen",replica="'):
        assert name in text
    assert server.metric("infinigen_completion_tokens_total") > 0
    assert 0 < server.metric("infinigen_fetched_fraction") <= 1
    # where the worker's time went: prompt tokens and decode steps served so far
    assert server.metric("infinigen_prefill_tokens_total") >= server.metric("infinigen_prompt_tokens_total") > 0
    assert server.metric("infinigen_prefill_seconds_total") > 0 and server.metric("infinigen_decode_seconds_total") > 0
    steps = server.metric("infinigen_decode_steps_total")
    assert 0 < steps <= server.metric("infinigen_decode_rows_total")


def test_api_key_queue_bound_and_graceful_sigterm(tmp_path):
    # a context of 8k so that the running stream outlasts the checks on any machine (the tiny model decodes
    # ~1,000 tokens a second); the grace period outlasts them too, and a second SIGTERM ends the stream
    model = save_tiny(tmp_path / "model", eos_never_greedy=True)
    config_file = tmp_path / "model" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "max_position_embeddings": 8192}))
    s = Server(model, tmp_path / "server.log", "--method", "full", "--api-key", "s3cret", "--queue-size", "1",
               "--max-batch", "1", "--grace-period", "60", "--max-tokens-limit", "8000")
    try:
        url, key = s.url + "/v1/completions", {"Authorization": "Bearer s3cret"}
        body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0}
        r = requests.post(url, json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert requests.post(url, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(**body).usage.completion_tokens == 5

        # One request runs, one waits (queue size 1): a third is turned away with 503.
        long = {**body, "max_tokens": 8000, "stream": True}
        running = requests.post(url, json=long, headers=key, stream=True, timeout=60)
        lines = running.iter_lines()
        assert next(lines).startswith(b"data: ")
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(r=requests.post(url, json=body, headers=key, timeout=120)))
        t.start()
        deadline = time.time() + 20
        while s.metric("infinigen_queue_depth", key) < 2 and time.time() < deadline:
            time.sleep(0.05)
        r = requests.post(url, json=body, headers=key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"

        # SIGTERM while a stream runs: new requests and /health get 503 at once while it goes on; a second
        # SIGTERM ends it with an error event and [DONE] and the waiting request with a 503; exit 0.
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = requests.post(url, json=body, headers=key)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["Retry-After"] == "5"  # a client knows when to try again
        assert requests.get(s.url + "/health").json()["status"] == "draining"
        assert s.proc.poll() is None and s.metric("infinigen_queue_depth", key) == 2  # both go on
        s.proc.send_signal(signal.SIGTERM)
        rest = [x for x in lines if x]
        assert rest[-1] == b"data: [DONE]"
        last = json.loads(rest[-2][6:])
        assert last["error"]["code"] == "shutting_down", last
        assert all(json.loads(x[6:]) for x in rest if x.startswith(b"data: {"))
        t.join(120)
        assert waiting["r"].status_code == 503 and waiting["r"].json()["error"]["code"] == "shutting_down"
        assert waiting["r"].headers["Retry-After"] == "5"
        assert s.proc.wait(60) == 0
        assert "Traceback" not in open(tmp_path / "server.log").read()
    finally:
        s.stop()


def test_the_grace_period_ends_what_is_left():
    """The draining server's clock: SIGTERM stops admitting; until the grace period is over the engine goes on;
    then what is left is aborted and, once the engine is idle, the server exits."""
    import asyncio

    import uvicorn

    from infinigen_kv import serve

    class Engine:
        def __init__(self):
            self.stopping, self.running, self.queue_depth, self.calls = False, True, 1, []

        @property
        def idle(self):
            return not self.running

        def drain(self):
            self.calls.append("drain")

        def abort(self):
            self.calls.append("abort")
            self.stopping = True

    def signalled(engine, signals):
        server = serve._draining_server(engine, grace_s=30.0)(uvicorn.Config(lambda *a: None))
        for _ in range(signals):
            server.handle_exit(signal.SIGTERM, None)
        return server

    engine = Engine()
    server = signalled(engine, 1)
    assert not asyncio.run(server.on_tick(1)) and engine.calls == ["drain"]
    server.deadline -= 30.0  # the grace period is over
    assert not asyncio.run(server.on_tick(1)) and engine.calls == ["drain", "abort"]  # the batch ends next step
    engine.running = False
    assert asyncio.run(server.on_tick(1))  # idle: exit

    engine = Engine()  # a second signal ends everything at once
    assert not asyncio.run(signalled(engine, 2).on_tick(1)) and engine.calls == ["drain", "abort"]


def test_admission_by_pool_bytes(model_dir, tmp_path):
    """Memory-aware admission: with the full cache's 512 bytes per token of the tiny model (bf16 rows) and a
    150 kB limit, a request of 270 tokens runs, a second one of 60 waits until it is done (both together would
    need ~170 kB), and one of 420 tokens is a 400 naming the limit."""
    s = Server(model_dir, tmp_path / "server.log", "--method", "full", "--max-pool-bytes", "150000")
    try:
        prompt = "The quick brown fox"
        url, body = s.url + "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0}
        r = requests.post(url, json={**body, "max_tokens": 400})
        assert r.status_code == 400 and r.json()["error"]["code"] == "pool_limit_exceeded", r.text
        assert "--max-pool-bytes" in r.json()["error"]["message"]
        assert s.metric("infinigen_pool_limit_bytes") == 150000
        second, seen, pools = {}, [], []
        with requests.post(url, json={**body, "max_tokens": 250, "stream": True}, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith(b"data: ")
            t = threading.Thread(target=lambda: second.update(r=requests.post(url, json={**body, "max_tokens": 40})))
            t.start()
            deadline = time.time() + 30
            while time.time() < deadline and not second:
                seen.append((s.metric("infinigen_running_requests"), s.metric("infinigen_waiting_requests")))
                pools.append(s.metric("infinigen_pool_bytes"))
            first = [x for x in lines if x]
        t.join(60)
        assert json.loads(first[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert second["r"].status_code == 200 and second["r"].json()["usage"]["completion_tokens"] == 40
        assert (1, 1) in seen  # one running, one waiting
        assert 0 < max(pools) <= 150000
    finally:
        s.stop()


def test_text_stream_holds_back_what_may_start_a_stop_sequence():
    from infinigen_kv.serve.output import TextStream

    class Chars:  # token id = code point
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    s = TextStream(Chars(), ["END"])
    out = [s.push(ord(c)) for c in "abENxEND"]
    assert [d for d, _ in out] == ["a", "b", "", "", "ENx", "", "", ""]
    assert [hit for _, hit in out] == [False] * 7 + [True] and s.text == "abENx"
    s = TextStream(Chars(), ["END"])
    assert [s.push(ord(c))[0] for c in "xE"] == ["x", ""] and s.flush() == "E"  # length end: held text released


def test_per_row_seeds_do_not_depend_on_the_batch():
    import torch

    import infinigen_kv as ig
    from conftest import tiny_model

    model = tiny_model("llama-gqa")
    ids = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(0))

    def run(batch, seeds):
        return ig.generate(model, batch, cache=ig.make_cache("full", model), max_new_tokens=12, temperature=1.0,
                           seed=seeds, stop_at_eos=False).tokens

    both = run(ids.repeat(2, 1), [5, 6])
    assert torch.equal(both[0], run(ids, [5])[0]) and torch.equal(both[1], run(ids, [6])[0])
    assert not torch.equal(both[0], both[1])


async def collect(job):
    """A job's events until its last ("done" or "error")."""
    out = []
    while not out or out[-1][0] not in ("done", "error"):
        out.append(await asyncio.wait_for(job.events.get(), 60))
    return out


def test_a_failing_request_fails_only_itself(model_dir, monkeypatch):
    """A request whose prefill raises (here: a stand-in fault on prompts starting with id 99) fails alone; the
    request running with it completes (one bad request must not fail its batch-mates)."""
    import infinigen_kv as ig
    from infinigen_kv.serve import engine as engine_mod

    real = engine_mod.Prefill.step

    def faulty(self):
        if int(self.ids[0, 0]) == 99:
            raise OverflowError("stand-in fault")
        return real(self)

    monkeypatch.setattr(engine_mod.Prefill, "step", faulty)
    model, tok = ig.load_model(model_dir)
    eng = engine_mod.Engine(model, tok, method="full", max_batch=4)

    async def main():
        ids = tok("hello")["input_ids"]
        jobs = [engine_mod.Job(ids, max_tokens=8, temperature=1.0, seed=1), engine_mod.Job([99, *ids], max_tokens=4)]
        with eng.cv:  # both wait until the worker can take them
            for j in jobs:
                eng.submit(j)
        return await asyncio.gather(*(collect(j) for j in jobs))

    try:
        good, bad = asyncio.run(main())
    finally:
        eng.close()
    assert good[-1] == ("done", "length", None, 0) and bad[-1][0] == "error" and "stand-in fault" in bad[-1][1]


# --- the sampling fields, plain and streaming, alone and in a batch --------------------------------

PROMPT = [5, 17, 33, 60, 91, 120, 140, 7, 9, 200]  # token ids: the same prompt whatever the tokenizer


def complete(client, stream=False, **kw):
    """(text per choice, finish_reason per choice, usage or None) of a completion, plain or streamed."""
    extra = {k: kw.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "ignore_eos") if k in kw}
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra or None)
    r = client.completions.create(**{**args, **kw}, stream=stream)
    if not stream:
        return [c.text for c in r.choices], [c.finish_reason for c in r.choices], r.usage
    texts, finish = {}, {}
    for c in r:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    return [texts[i] for i in sorted(texts)], [finish[i] for i in sorted(finish)], None


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


SAMPLING = {  # field values -> a check of (result, the plain greedy result, tokenizer)
    "logit_bias": ({"logit_bias": {"77": 100}}, lambda r, base, tok: r[0][0] == tok.decode([77] * 12)),
    "presence_penalty": ({"presence_penalty": 2.0}, lambda r, base, tok: r[0] != base[0]),
    "frequency_penalty": ({"frequency_penalty": 2.0}, lambda r, base, tok: r[0] != base[0]),
    "repetition_penalty": ({"repetition_penalty": 5.0}, lambda r, base, tok: r[0] != base[0]),
    "top_k": ({"top_k": 1, "temperature": 1.5, "seed": 3}, lambda r, base, tok: r[0] == base[0]),
    "min_p": ({"min_p": 1.0, "temperature": 1.5, "seed": 3}, lambda r, base, tok: r[0] == base[0]),
    "ignore_eos": ({"ignore_eos": True, "logit_bias": {"2": 100}},
                   lambda r, base, tok: r[1] == ["length"] and r[0] == [""]),
    "n": ({"n": 3, "temperature": 1.0, "seed": 5},
          lambda r, base, tok: len(r[0]) == 3 and len(set(r[0])) > 1 and r[1] == ["length"] * 3),
    "echo": ({"echo": True}, lambda r, base, tok: r[0][0] == tok.decode(PROMPT) + base[0][0]),
}


@pytest.mark.parametrize("field", list(SAMPLING))
def test_sampling_fields_act_plain_and_streaming(client, tok, field):
    knobs, check = SAMPLING[field]
    base = complete(client)
    plain = complete(client, **knobs)
    assert check(plain, base, tok), (field, plain, base)
    if field != "echo":  # (a stream echoes the prompt in its first chunk: the same text)
        assert complete(client, stream=True, **knobs)[:2] == plain[:2], field
    else:
        assert complete(client, stream=True, **knobs)[0] == plain[0]


def test_eos_ends_a_choice_unless_ignore_eos(client):
    text, finish, usage = complete(client, logit_bias={"2": 100})  # </s> (id 2) at every step
    assert finish == ["stop"] and usage.completion_tokens == 0
    text, finish, usage = complete(client, logit_bias={"2": 100}, ignore_eos=True)
    assert finish == ["length"] and usage.completion_tokens == 12


def test_sampling_fields_in_a_batch_as_alone(client):
    """Every knob at once on a seeded sampled row: the same choices alone and beside other requests."""
    knobs = dict(temperature=0.9, top_p=0.95, seed=11, top_k=40, min_p=0.02, presence_penalty=0.5,
                 frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={"9": -5}, n=2)
    alone = complete(client, **knobs)
    out, errors = {}, []

    def other(i):
        try:
            complete(client, max_tokens=20 + i, temperature=1.0, seed=i, frequency_penalty=1.0)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def mine():
        out["r"] = complete(client, **knobs)

    threads = [threading.Thread(target=other, args=(i,)) for i in range(2)] + [threading.Thread(target=mine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and out["r"][:2] == alone[:2]


def test_echo_logprobs_score_the_prompt(client, tok):
    """max_tokens 0 with echo and logprobs: the prompt tokens' logprobs, as evaluation clients ask."""
    from infinigen_kv.model.backend import native_bf16

    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tok.decode(PROMPT) and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(PROMPT) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # the logprob of token 1 given token 0 is the first step's logprob of token 1 after a prompt of one token
    # (forced by logit_bias, which logprobs do not see: they are the model's own); within bfloat16's rounding: a
    # prompt's products run in bfloat16 where the CPU multiplies it natively, a one-token prompt's in float32
    forced = client.completions.create(model=MODEL, prompt=PROMPT[:1], max_tokens=1, logprobs=0, temperature=0,
                                       logit_bias={str(PROMPT[1]): 100})
    tol = 2e-3 if native_bf16() else 1e-4
    assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(lp.token_logprobs[1], abs=tol)
    with_tokens = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1,
                                            temperature=0)
    lp2 = with_tokens.choices[0].logprobs
    assert len(lp2.tokens) == len(PROMPT) + 3 and lp2.token_logprobs[: len(PROMPT)] == lp.token_logprobs


def test_completions_refuse_what_they_cannot_do(server):
    url = server.url + "/v1/completions"
    for body, param in [({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of"), ({"max_tokens": 0}, "max_tokens"),
                        ({"n": 2, "best_of": 2}, None)]:
        r = requests.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}, timeout=60)
        if param is None:
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("method", ["quest", "snapkv", "shadowkv"])
def test_selection_methods_are_served_in_one_batch(model_dir, method):
    """The engine serves today's selection methods at a binding budget: concurrent requests, each to its length
    (EOS ignored: a method that drops entries may make a random model's EOS its greedy token)."""
    import infinigen_kv as ig
    from infinigen_kv.serve import engine as engine_mod

    model, tok = ig.load_model(model_dir)
    eng = engine_mod.Engine(model, tok, method=method, options={"budget": 0.3, "min_budget": 0}, max_batch=4)

    async def main():
        jobs = [engine_mod.Job([5 + (i * 7 + j) % 200 for j in range(90 + 20 * i)], max_tokens=6, ignore_eos=True)
                for i in range(3)]
        for j in jobs:
            eng.submit(j)
        return jobs, await asyncio.gather(*(collect(j) for j in jobs))

    try:
        jobs, results = asyncio.run(main())
    finally:
        eng.close()
    assert [r[-1][:2] for r in results] == [("done", "length")] * 3
    assert [j.completion_tokens for j in jobs] == [6, 6, 6]


def test_the_readme_client_example_runs(server, capsys):
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.findall(r"```python\n(.*?)```", text[text.index("## Server"):], re.S)[0]
    code = code.replace("http://127.0.0.1:8000", server.url).replace('"SmolLM2-135M-Instruct"', repr(MODEL))
    exec(code.replace("max_tokens=64", "max_tokens=8"), {})
    assert capsys.readouterr().out.strip()
