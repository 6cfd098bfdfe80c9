"""The prefix cache through the server, with the openai client: a request that shares a prompt start with an earlier
one reports the restored tokens in usage.prompt_tokens_details.cached_tokens (plain and streamed) and answers as it
would without them; a second server on the same --prefix-cache-dir (a restart, or a replica beside it) serves from
the blocks the first wrote; /metrics counts hits; a method that cannot reuse says so in usage."""

import pytest
import requests
from conftest import TEXT
from test_serve import MODEL, Server

openai = pytest.importorskip("openai")

BLOCK = "16"
DOC = TEXT[: len(TEXT) // 3]  # ~230 tokens of the tiny tokenizer


def ask(client, question, **kw):
    return client.completions.create(model=MODEL, prompt=DOC + question, max_tokens=10, temperature=0, **kw)


def connect(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import save_tiny

    return save_tiny(tmp_path_factory.mktemp("prefix-model"), eos_never_greedy=True)


def test_reuse_through_the_server_shared_disk_and_metrics(model_dir, tmp_path):
    disk = tmp_path / "prefix"
    a = Server(model_dir, tmp_path / "a.log", "--prefill-chunk", BLOCK, "--prefix-cache-dir", str(disk))
    b = None
    try:
        ca = connect(a)
        first = ask(ca, " Question one?")
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = ask(ca, " What is the pass key?")
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= second.usage.prompt_tokens - 2 * int(BLOCK) and cached % int(BLOCK) == 0
        # the same request computed whole (prompt logprobs are never restored): the same answer
        whole = ask(ca, " What is the pass key?", echo=True, logprobs=1)
        assert whole.usage.prompt_tokens_details.cached_tokens == 0
        assert whole.choices[0].text == DOC + " What is the pass key?" + second.choices[0].text
        stream = ca.completions.create(model=MODEL, prompt=DOC + " What is the pass key?", max_tokens=10,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == second.choices[0].text
        repeat = chunks[-1].usage.prompt_tokens_details.cached_tokens  # the second's own blocks too
        assert repeat >= cached and repeat >= second.usage.prompt_tokens - int(BLOCK)
        assert a.metric("infinigen_prefix_cache_hit_tokens") == cached + repeat
        assert a.metric("infinigen_prefix_cache_memory_bytes") > 0
        assert a.metric("infinigen_prefix_cache_disk_bytes") > 0

        b = Server(model_dir, tmp_path / "b.log", "--prefill-chunk", BLOCK, "--prefix-cache-dir", str(disk))
        cb = connect(b)  # a second server on the same directory (a restart, or a replica beside the first)
        again = ask(cb, " What is the pass key?")
        assert again.usage.prompt_tokens_details.cached_tokens == repeat
        assert again.choices[0].text == second.choices[0].text
        assert b.metric("infinigen_prefix_cache_disk_hits") == repeat // int(BLOCK)
        third = ask(cb, " And the fox?")  # written by b, read by a
        assert third.usage.prompt_tokens_details.cached_tokens > 0
        assert ask(ca, " And the fox?").choices[0].text == third.choices[0].text
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_damaged_entry_is_a_miss_logged_as_the_server_logs(model_dir, tmp_path):
    """A restart over a damaged file: the request is answered as before, one WARNING line in the server's format
    says so, and the disk-bytes metric equals what is on disk after the entry is replaced."""
    disk = tmp_path / "prefix"
    a = Server(model_dir, tmp_path / "a.log", "--prefill-chunk", BLOCK, "--prefix-cache-dir", str(disk))
    try:
        first = ask(connect(a), " Question one?")
    finally:
        a.stop()
    files = sorted(disk.rglob("*.safetensors"))
    files[len(files) // 2].write_bytes(files[len(files) // 2].read_bytes()[:-7] + b"damaged")
    b = Server(model_dir, tmp_path / "b.log", "--prefill-chunk", BLOCK, "--prefix-cache-dir", str(disk))
    try:
        again = ask(connect(b), " Question one?")
        assert again.choices[0].text == first.choices[0].text
        on_disk = sum(p.stat().st_size for p in disk.rglob("*") if p.is_file())
        assert b.metric("infinigen_prefix_cache_disk_bytes") == on_disk
    finally:
        b.stop()
    lines = [line for line in open(tmp_path / "b.log") if "unusable" in line]
    assert len(lines) == 1 and lines[0].startswith("WARNING:"), lines


def test_a_method_that_cannot_reuse_says_so(model_dir, tmp_path):
    s = Server(model_dir, tmp_path / "h2o.log", "--method", "h2o", "--prefill-chunk", BLOCK)
    try:
        c = connect(s)
        for _ in range(2):
            r = ask(c, " Question?")
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        assert "h2o" in r.usage.model_extra["prefix_cache"]
        assert "infinigen_prefix_cache_hit_tokens" not in requests.get(s.url + "/metrics", timeout=5).text
    finally:
        s.stop()


def test_the_store_shares_the_pool_budget_and_gives_memory_back(model_dir):
    """The store's memory limit is what the running requests leave of --max-pool-bytes (up to its own cap): admitting
    a request evicts least recently used blocks; --prefix-cache-bytes 0 turns it off and usage says so."""
    import torch

    import infinigen_kv as ig
    from infinigen_kv.serve.engine import Engine

    model, tok = ig.load_model(model_dir)
    eng = Engine(model, tok, method="full", max_pool_bytes=1 << 20, prefix_cache_bytes=1 << 19)
    try:
        store = eng.prefix
        assert eng.prefix_note is None and store.memory.limit == 1 << 19  # its own cap under the pool's
        for i in range(8):  # 8 blocks of 64 KiB: the cap holds all of them
            store.put(f"k{i}", lambda: {"x": torch.zeros(16 << 10)})
        assert store.memory.bytes == 8 * (64 << 10)
        eng._fit_prefix(committed=(1 << 20) - (3 * (64 << 10)))  # a batch leaves room for three blocks
        assert len(store.memory) == 3 and store.memory.bytes <= store.memory.limit
        assert list(store.memory.blocks) == ["k5", "k6", "k7"]  # the least recently used went
        assert store.report()["memory_evictions"] == 5
        eng._fit_prefix()  # nothing runs: back to its own cap
        assert store.memory.limit == 1 << 19
    finally:
        eng.close()
    off = Engine(model, tok, method="full", prefix_cache_bytes=0)
    try:
        assert off.prefix is None and "off" in off.prefix_note
    finally:
        off.close()
