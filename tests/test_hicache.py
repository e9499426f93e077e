"""The hierarchical KV cache (radix/hicache.py): tiers, content-addressed pages, CAG pins.

Every runtime test compares greedy outputs against the hierarchy turned off: a tier may only
change how much is prefilled, never what is generated. Redis tests start a real redis-server
on a free loopback port (skipped only when the binary is absent: `apt-get install redis-server`).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from loom.radix.pages import decode_page, encode_page, page_keys, root_hash
from loom.radix.storage import FileStorage, RedisStorage
from loom.runtime.io_struct import PinReq
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit
from tests.test_radix_runtime import _ids

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server not installed")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, tmp: Path):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                REDIS,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp),
                "--maxmemory",
                "512mb",
                "--maxmemory-policy",
                "allkeys-lru",
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()


# ------------------------------------------------------------------------------ pages
def test_page_keys_chain_over_model_format_and_every_token_before():
    shape = (2, 2, 4, 1, 8)
    root = root_hash("model-a", torch.float32, shape, 4, None)
    toks = _ids(16, 1)
    keys = page_keys(root, toks, 4)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert page_keys(root, toks + [5, 6], 4) == keys  # a partial page has no key
    assert page_keys(root, toks, 4, start=2) == keys[2:]
    changed = [toks[0] + 1] + toks[1:]  # one token before: every later page changes
    assert not set(page_keys(root, changed, 4)) & set(keys)
    for other in (
        root_hash("model-b", torch.float32, shape, 4, None),
        root_hash("model-a", torch.bfloat16, shape, 4, None),
        root_hash("model-a", torch.float32, (2, 3, 4, 1, 8), 4, None),
        root_hash("model-a", torch.float32, shape, 4, "lora-1"),
    ):
        assert not set(page_keys(other, toks, 4)) & set(keys)


def test_page_roundtrip_and_every_bad_page_is_rejected():
    kv = torch.randn(2, 3, 4, 2, 8)
    key, other = b"k" * 16, b"o" * 16
    data = encode_page(key, kv)
    assert torch.equal(decode_page(key, data, tuple(kv.shape), torch.float32), kv)
    assert decode_page(key, None, tuple(kv.shape), torch.float32) is None
    assert decode_page(key, data[:-1], tuple(kv.shape), torch.float32) is None  # truncated
    assert decode_page(key, data[:40], tuple(kv.shape), torch.float32) is None
    flipped = bytearray(data)
    flipped[-5] ^= 0x10  # one payload bit
    assert decode_page(key, bytes(flipped), tuple(kv.shape), torch.float32) is None
    assert decode_page(other, data, tuple(kv.shape), torch.float32) is None  # another key's
    assert decode_page(key, data, (2, 3, 4, 2, 4), torch.float32) is None
    assert decode_page(key, data, tuple(kv.shape), torch.bfloat16) is None


def _exercise(store):
    assert store.get("kv:00ab") is None and not store.exists("kv:00ab")
    store.put("kv:00ab", b"\x00\x01payload")
    assert store.get("kv:00ab") == b"\x00\x01payload" and store.exists("kv:00ab")
    store.put("pin:m:doc", b"{}")
    store.put("pin:m:faq", b"{}")
    store.put("pin:n:doc", b"{}")
    assert store.keys("pin:m:") == ["pin:m:doc", "pin:m:faq"]
    store.delete("kv:00ab")
    assert store.get("kv:00ab") is None


def test_file_storage(tmp_path):
    _exercise(FileStorage(str(tmp_path)))


@needs_redis
def test_redis_storage(redis_server):
    _exercise(RedisStorage(redis_server.url))


# ------------------------------------------------------------------------------ runtime
TENANTS = 6


def _workload() -> list[list[int]]:
    """Six tenants' 150-token prefixes, three rounds: ~5x a 400-token pool."""
    tenants = [_ids(150, t) for t in range(TENANTS)]
    return [tenants[i % TENANTS] + _ids(10, 100 + i) for i in range(3 * TENANTS)]


def _run(sched, prompts, prefix="r"):
    """One request at a time (so the pool's LRU decides what survives)."""
    out = {}
    for i, p in enumerate(prompts):
        submit(sched, f"{prefix}{i}", p, greedy(8))
        out.update(run_all(sched))
    return [out[f"{prefix}{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(model):
    """Greedy outputs with the hierarchy off (radix cache on), the small pool."""
    off = make_scheduler(model, max_total_tokens=400)
    res = _run(off, _workload())
    assert off.get_state()["cached_tokens"] == 0  # the pool is too small to keep any tenant
    return [r.ids for r in res]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_l2_hits_keep_greedy_outputs(model, reference, policy):
    on = make_scheduler(
        model,
        max_total_tokens=400,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_ratio=3.0,  # 37 pages: the 30 of the first round stay (2.0 thrashes the LRU)
    )
    res = _run(on, _workload())
    assert [r.ids for r in res] == reference
    state = on.get_state()
    # every later round finds its tenant's 128 whole pages (4 x 32 tokens) in L2
    assert [r.cached_tokens for r in res[TENANTS:]] == [128] * (2 * TENANTS)
    assert state["hicache_l2_hit_tokens"] == 128 * 2 * TENANTS
    assert state["hicache_l2_read_bytes"] > 0 and state["hicache_loads"] == 2 * TENANTS
    assert state["hicache_l2_tokens"] <= state["hicache_l2_capacity_tokens"] == 1200


def test_page_size_4(model):
    args = dict(max_total_tokens=400, page_size=4)
    ref = [r.ids for r in _run(make_scheduler(model, **args), _workload())]
    on = make_scheduler(model, enable_hierarchical_cache=True, hicache_ratio=3.0, **args)
    res = _run(on, _workload())
    assert [r.ids for r in res] == ref
    assert on.get_state()["hicache_l2_hit_tokens"] > 0


def _file_sched(model, d, **kw):
    kw.setdefault("max_total_tokens", 400)
    return make_scheduler(
        model,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(d),
        **kw,
    )


def test_file_tier_survives_a_restart_and_a_corrupt_page_is_recomputed(model, reference, tmp_path):
    first = _file_sched(model, tmp_path)
    assert [r.ids for r in _run(first, _workload())] == reference
    first.tree_cache.flush_writes()
    assert first.get_state()["hicache_l3_write_bytes"] > 0
    # a restart: a new scheduler finds every tenant's pages in the files (L1 and L2 empty)
    second = _file_sched(model, tmp_path)
    res = _run(second, _workload())
    assert [r.ids for r in res] == reference
    assert [r.cached_tokens for r in res[:TENANTS]] == [128] * TENANTS
    assert second.get_state()["hicache_l3_hit_tokens"] >= 128 * TENANTS
    # corrupt tenant 0's third page and truncate tenant 1's second: both are detected and
    # recomputed from there, the outputs unchanged
    third = _file_sched(model, tmp_path)
    cache = third.tree_cache
    wl = _workload()
    bad = page_keys(cache._root(None), wl[0], cache.block)[2]
    short = page_keys(cache._root(None), wl[1], cache.block)[1]
    path = tmp_path / "kv" / bad.hex()[:2] / bad.hex()
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    spath = tmp_path / "kv" / short.hex()[:2] / short.hex()
    spath.write_bytes(spath.read_bytes()[:-7])
    res = _run(third, wl[:2])
    assert [r.ids for r in res] == reference[:2]
    assert [r.cached_tokens for r in res] == [64, 32]
    assert third.get_state()["hicache_corrupt_pages"] == 2
    third.tree_cache.flush_writes()  # the recompute wrote both pages again, whole
    for key, p in ((bad, path), (short, spath)):
        assert decode_page(key, p.read_bytes(), cache.page_shape, cache.dtype) is not None


@needs_redis
def test_two_replicas_share_the_redis_tier(model, redis_server):
    kw = dict(
        max_total_tokens=400,
        enable_hierarchical_cache=True,
        hicache_storage_backend="redis",
        hicache_storage_url=redis_server.url,
    )
    a, b = make_scheduler(model, **kw), make_scheduler(model, **kw)
    doc = _ids(200, 7)
    (ra,) = _run(a, [doc + _ids(5, 1)], "a")
    a.tree_cache.flush_writes()
    assert ra.cached_tokens == 0
    (rb,) = _run(b, [doc + _ids(5, 2)], "b")
    assert rb.cached_tokens == 192  # six whole pages prefilled on the other replica
    assert b.get_state()["hicache_l3_hit_tokens"] == 192
    off = make_scheduler(model, max_total_tokens=400)
    assert rb.ids == _run(off, [doc + _ids(5, 2)], "o")[0].ids


@needs_redis
def test_killing_redis_mid_run_degrades_to_recompute(model, reference, redis_server):
    sched = make_scheduler(
        model,
        max_total_tokens=400,
        enable_hierarchical_cache=True,
        hicache_ratio=0.5,  # L2 holds one tenant: the rest must come from Redis
        hicache_storage_backend="redis",
        hicache_storage_url=redis_server.url,
    )
    wl = _workload()
    res = _run(sched, wl[: TENANTS + 2])
    sched.tree_cache.flush_writes()
    assert sched.get_state()["hicache_l3_hit_tokens"] > 0
    redis_server.kill()
    res += _run(sched, wl[TENANTS + 2 :], "k")
    assert all(r.finish_reason["type"] == "length" for r in res)
    assert [r.ids for r in res] == reference
    assert sched.get_state()["hicache_storage_errors"] > 0


def test_pins_are_never_evicted_and_come_back_after_a_restart(model, tmp_path):
    sched = _file_sched(model, tmp_path, hicache_ratio=0.25)
    doc = _ids(160, 9)
    _run(sched, [doc], "p")
    reply = sched.handle_message(PinReq(1, "pin", "doc", doc, "the doc"))
    assert reply.ok and reply.state["tokens"] == 160
    _run(sched, _workload())  # ~5x the pool through it: the pin stays in L1
    (hit,) = _run(sched, [doc + _ids(4, 3)], "q")
    assert hit.cached_tokens == 160
    assert sched.get_state()["hicache_pinned_tokens"] == 160
    listed = sched.handle_message(PinReq(2, "list")).state["pinned"]
    assert listed == [{"name": "doc", "tokens": 160, "text": "the doc", "resident": True}]
    sched.tree_cache.flush_writes()
    # a restart re-locks it from the file tier
    again = _file_sched(model, tmp_path)
    assert again.tree_cache.pins["doc"][1] == 160
    assert again.get_state()["hicache_pinned_tokens"] == 160
    (hit,) = _run(again, [doc + _ids(4, 3)], "q")
    assert hit.cached_tokens == 160
    assert again.handle_message(PinReq(3, "unpin", "doc")).ok
    assert again.handle_message(PinReq(4, "list")).state["pinned"] == []
    assert not again.handle_message(PinReq(5, "unpin", "doc")).ok
    # a prefix that is not cached cannot be pinned
    assert not again.handle_message(PinReq(6, "pin", "x", _ids(50, 11))).ok


# ------------------------------------------------------------------------------ servers
DOC = " ".join(f"Fact {i}: the {w} of item {i} is {i * 7 % 13}." for i, w in
               enumerate(["color", "size", "weight", "price", "age"] * 4)) + "\n"  # fmt: skip


def test_pin_prefix_over_http(model, tmp_path):
    import requests

    from loom.runtime.server.runtime_client import Runtime

    with Runtime(model, max_total_tokens=1024, enable_metrics=True,
                 enable_hierarchical_cache=True, hicache_storage_backend="file",
                 hicache_storage_dir=str(tmp_path)) as rt:  # fmt: skip
        url = rt.url
        r = requests.post(url + "/pin_prefix", json={"name": "doc", "text": DOC})
        assert r.status_code == 200, r.text
        pinned = r.json()["tokens"]
        assert pinned == r.json()["prompt_tokens"] > 100
        listed = requests.get(url + "/list_pinned").json()["pinned"]
        assert listed == [{"name": "doc", "tokens": pinned, "text": DOC, "resident": True}]
        r = requests.post(
            url + "/v1/completions",
            json={"model": model, "prompt": DOC + "Question: what is", "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert pinned - 2 <= cached <= pinned
        for body, field in (
            ({"name": "a b", "text": "x"}, "name"),
            ({"name": "ok"}, "text"),
            ({"name": "ok", "text": "x", "input_ids": [1]}, "text"),
            ({"name": "ok", "input_ids": [10**9]}, "input_ids"),
        ):
            r = requests.post(url + "/pin_prefix", json=body)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text
        # the language: a program starts from the pinned prefix
        import loom as sgl

        @sgl.function
        def ask(s, q):
            s += sgl.pinned("doc")
            s += "Question: " + q
            s += sgl.gen("a", max_tokens=4, temperature=0)

        backend = sgl.RuntimeEndpoint(url)
        state = ask.run(q="what is the size of item 1?", backend=backend)
        assert state.text().startswith(DOC)
        meta = state.get_meta_info("a")  # the pin, and more: the completion above shares more
        assert pinned <= meta["cached_tokens"] < meta["prompt_tokens"]
        with pytest.raises(Exception, match="no prefix pinned as 'nope'"):
            sgl.function(lambda s: s.__iadd__(sgl.pinned("nope"))).run(backend=backend).sync()
        metrics = requests.get(url + "/metrics").text
        assert "loom:hicache_hit_tokens{model_name=" in metrics
        info = requests.get(url + "/server_info").json()
        assert info["hicache_pinned_tokens"] == pinned and info["hicache_l3_write_bytes"] > 0
        assert requests.post(url + "/unpin_prefix", json={"name": "doc"}).status_code == 200
        r = requests.post(url + "/unpin_prefix", json={"name": "doc"})
        assert r.status_code == 400 and "name" in r.json()["error"]["message"]
        assert requests.get(url + "/list_pinned").json()["pinned"] == []


@needs_redis
def test_dp_replicas_share_the_redis_tier(model, redis_server):
    import redis
    import requests

    from loom.runtime.server.runtime_client import Runtime

    client = redis.Redis.from_url(redis_server.url)
    doc = _ids(200, 7)
    with Runtime(model, max_total_tokens=1024, dp_size=2, load_balance_method="round_robin",
                 enable_hierarchical_cache=True, hicache_storage_backend="redis",
                 hicache_storage_url=redis_server.url) as rt:  # fmt: skip
        sp = {"max_new_tokens": 4, "temperature": 0}
        first = requests.post(
            rt.url + "/generate", json={"input_ids": doc + [5], "sampling_params": sp}
        )
        assert first.status_code == 200 and first.json()["meta_info"]["cached_tokens"] == 0
        deadline = time.monotonic() + 20  # the writer thread stores the six pages
        while len(list(client.scan_iter(match="loom:kv:*"))) < 6:
            assert time.monotonic() < deadline, "pages never reached redis"
            time.sleep(0.1)
        second = requests.post(
            rt.url + "/generate", json={"input_ids": doc + [6], "sampling_params": sp}
        )
        assert second.json()["meta_info"]["cached_tokens"] == 192
        states = requests.get(rt.url + "/server_info").json()["internal_states"]
        assert sorted(s["hicache_l3_hit_tokens"] for s in states) == [0, 192]
        r = requests.post(rt.url + "/pin_prefix", json={"name": "doc", "input_ids": doc})
        assert r.status_code == 200 and len(r.json()["workers"]) == 2, r.text
        listed = requests.get(rt.url + "/list_pinned").json()["pinned"]
        assert [p["name"] for p in listed] == ["doc"]


def test_bundled_model_greedy_outputs_identical():
    """The bundled (trained) model: L2 and L3 hits change nothing in greedy outputs."""
    heads = [_ids(200, 40 + t) for t in range(3)]
    prompts = [heads[i % 3] + _ids(8, 60 + i) for i in range(9)]
    off = [r.ids for r in _run(make_scheduler(None, max_total_tokens=256), prompts)]
    on = make_scheduler(None, max_total_tokens=256, enable_hierarchical_cache=True,
                        hicache_ratio=4.0)  # fmt: skip
    res = _run(on, prompts)
    assert [r.ids for r in res] == off
    assert [r.cached_tokens for r in res[3:]] == [192] * 6


def test_flags_parse_and_bad_combinations_are_refused_by_name():
    import argparse

    from loom.runtime.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-size", "2",
            "--hicache-write-policy", "write_back", "--hicache-storage-backend", "redis",
            "--hicache-storage-url", "redis://127.0.0.2:6390/1"]  # fmt: skip
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    assert (args.hicache_ratio, args.hicache_size, args.hicache_write_policy) == (
        3.0,
        2,
        "write_back",
    )
    assert args.hicache_storage_url == "redis://127.0.0.2:6390/1"
    for kw, field in (
        (dict(hicache_storage_backend="file"), "hicache_storage_backend: needs"),
        (dict(enable_hierarchical_cache=True, hicache_storage_backend="s3"), "hicache_storage_backend: must"),
        (dict(enable_hierarchical_cache=True, hicache_write_policy="later"), "hicache_write_policy"),
        (dict(enable_hierarchical_cache=True, hicache_storage_dir="/x"), "hicache_storage_dir"),
        (dict(enable_hierarchical_cache=True, hicache_ratio=0), "hicache_ratio"),
        (dict(enable_hierarchical_cache=True, disable_radix_cache=True), "enable_hierarchical_cache"),
        (dict(enable_hierarchical_cache=True, tp_size=2), "enable_hierarchical_cache: .*not supported yet"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{field}"):
            ServerArgs(**kw)


def test_pins_need_the_hierarchy(model):
    sched = make_scheduler(model, max_total_tokens=400)
    reply = sched.handle_message(PinReq(1, "pin", "doc", _ids(40, 1)))
    assert not reply.ok and "enable-hierarchical-cache" in reply.message


def test_smollm2_greedy_outputs_identical_with_l2_and_l3_hits(real_gguf, tmp_path):
    """SmolLM2-135M (a real model, GGUF): two tenants' 64-token prefixes through a pool that
    keeps one and an L2 that keeps one: the third request finds its prefix in the file L3,
    the fourth in L2; greedy outputs equal the hierarchy off. Four short requests a side
    (a real model's prefill is the cost here)."""
    from loom.runtime.tokenizer import load_tokenizer

    path = real_gguf("smollm2")
    tok = load_tokenizer(path)
    heads = [tok.encode(f"{t}: notes. " + " ".join(f"Point {i}: {t} matters." for i in range(9)))
             [:64] for t in ("The lighthouse", "Baking bread")]  # fmt: skip
    assert all(len(h) == 64 for h in heads) and heads[0][0] != heads[1][0]  # nothing shared
    prompts = [heads[t] + tok.encode(f" Question {i}:") for i, t in enumerate([0, 1, 0, 1])]
    off = [r.ids for r in _run(make_scheduler(path, max_total_tokens=128), prompts)]
    on = _file_sched(path, tmp_path, max_total_tokens=128, hicache_ratio=0.5)
    res = _run(on, prompts)
    assert [r.ids for r in res] == off
    assert [r.cached_tokens for r in res] == [0, 0, 64, 64]
    state = on.get_state()
    assert (state["hicache_l3_hit_tokens"], state["hicache_l2_hit_tokens"]) == (64, 64)


# ------------------------------------------------------------------------------ compact L2
def test_compact_l2_codecs_bound_their_error_and_key_their_format():
    from loom.radix.pages import PageCodec

    kv = torch.randn(2, 3, 32, 2, 8) * torch.tensor([0.1, 5.0]).view(1, 1, 1, 2, 1)
    exact = PageCodec("exact", torch.float32, kv.shape)
    bf16 = PageCodec("bf16", torch.float32, kv.shape)
    int8 = PageCodec("int8", torch.float32, kv.shape)
    assert torch.equal(exact.unpack(exact.pack(kv)), kv)
    got = bf16.unpack(bf16.pack(kv))
    assert got.dtype == torch.float32 and not torch.equal(got, kv)
    assert ((got - kv).abs() <= kv.abs() * 2**-8).all()  # bf16: 8 significant bits
    got = int8.unpack(int8.pack(kv))
    scale = kv.abs().amax(dim=(2, 4), keepdim=True) / 127  # one per (K/V, layer, head)
    assert ((got - kv).abs() <= scale / 2 + 1e-6).all()
    assert exact.page_bytes == 2 * bf16.page_bytes
    assert 3.9 < exact.page_bytes / int8.page_bytes < 4  # int8 plus 12 float32 scales
    # the stored form is in the key; bf16 of a bf16 pool is the exact form, same keys
    assert (exact.tag, bf16.tag, int8.tag) == ("", "->bf16", "->int8")
    assert PageCodec("bf16", torch.bfloat16, kv.shape).name == "exact"
    with pytest.raises(ValueError, match="^hicache_l2_dtype"):
        PageCodec("fp4", torch.float32, kv.shape)
    data = encode_page(b"k" * 16, int8.pack(kv))  # L3 holds the compact form, checked
    back = decode_page(b"k" * 16, data, int8.stored_shape, int8.stored_dtype)
    assert torch.equal(int8.unpack(back), got)
    assert decode_page(b"k" * 16, data, exact.stored_shape, exact.stored_dtype) is None


@pytest.mark.parametrize("l2_dtype,ratio", [("bf16", 2.0), ("int8", 3.9)])
def test_compact_l2_holds_more_tokens_and_serves_hits(model, tmp_path, l2_dtype, ratio):
    """The same GB of L2 holds `ratio` x the tokens; L2 hits, then L3 hits after a restart,
    come from compact pages. Outputs are not asserted equal to the hierarchy off: the form is
    lossy by design, and benchmarks/bench_hicache_l2.py measures the drift."""
    from loom.radix.pages import _HEADER, PageCodec

    first = _file_sched(model, tmp_path, hicache_l2_dtype=l2_dtype, hicache_size=1)  # 1 GB
    cache, state = first.tree_cache, first.get_state()
    exact_bytes = PageCodec("exact", cache.dtype, cache.page_shape).page_bytes
    exact_cap = 10**9 // exact_bytes * cache.block
    assert state["hicache_l2_dtype"] == l2_dtype
    assert state["hicache_l2_capacity_tokens"] >= ratio * exact_cap
    res = _run(first, _workload())
    assert [r.cached_tokens for r in res[TENANTS:]] == [128] * (2 * TENANTS)
    assert first.get_state()["hicache_l2_hit_tokens"] == 128 * 2 * TENANTS
    first.tree_cache.flush_writes()
    codec = first.tree_cache.codec
    files = list((tmp_path / "kv").glob("*/*"))
    # each tenant's 4 prefix pages, and each request's 5th (prefix end + its own tail)
    assert len(files) == 4 * TENANTS + len(res)
    assert {f.stat().st_size for f in files} == {_HEADER.size + codec.page_bytes}
    second = _file_sched(model, tmp_path, hicache_l2_dtype=l2_dtype)
    res = _run(second, _workload()[:TENANTS])
    assert [r.cached_tokens for r in res] == [128] * TENANTS
    assert second.get_state()["hicache_l3_hit_tokens"] == 128 * TENANTS
    exact = _file_sched(model, tmp_path)  # an exact L2 over the same files: no compact page
    (miss,) = _run(exact, _workload()[:1])
    assert miss.cached_tokens == 0


# ------------------------------------------------------------------------------ loads, file cap
def test_l3_loads_overlap_other_requests(model, tmp_path):
    """A request whose prefix is in L3 waits in the queue while its pages are read (the read
    held here until released) and a running request keeps decoding; then it is admitted with
    the whole prefix. --hicache-sync-loads reads on the scheduler thread (no prefetch)."""
    import threading

    doc = _ids(200, 7)
    off = _run(make_scheduler(model, max_total_tokens=400), [doc + [5], _ids(20, 8)], "o")
    writer = _file_sched(model, tmp_path)
    _run(writer, [doc + [4]], "w")
    writer.tree_cache.flush_writes()
    sched = _file_sched(model, tmp_path)
    storage = sched.tree_cache.storage
    gate, real_get = threading.Event(), storage.get
    storage.get = lambda key: (gate.wait(120), real_get(key))[1]
    submit(sched, "other", _ids(20, 8), greedy(8))
    submit(sched, "doc", doc + [5], greedy(8))
    outs = []
    for _ in range(200):  # "other" runs to its end meanwhile (prefill + 7 decode steps)
        outs += sched.step()
        if not len(sched.decode) and len(sched.prefill.waiting) == 1:
            break
    waiting = {r.rid: r for r in sched.prefill.waiting}
    assert list(waiting) == ["doc"] and sched.kv.loading(waiting["doc"])
    assert {o.rid for o in outs} == {"other"}
    gate.set()
    res = run_all(sched)
    assert res["doc"].cached_tokens == 192 and res["doc"].ids == off[0].ids
    state = sched.get_state()
    assert state["hicache_prefetches"] == 1 and state["hicache_l3_hit_tokens"] == 192
    sync = _file_sched(model, tmp_path, hicache_sync_loads=True)
    (hit,) = _run(sync, [doc + [5]], "s")
    assert hit.cached_tokens == 192 and hit.ids == off[0].ids
    state = sync.get_state()
    assert state["hicache_prefetches"] == 0 and state["hicache_overlap_loads"] is False


def test_file_tier_size_cap_evicts_least_recently_used_pages(tmp_path):
    page = b"x" * 1000
    store = FileStorage(str(tmp_path), max_bytes=3500)
    for k in ("kv:aa01", "kv:aa02", "kv:aa03"):
        store.put(k, page)
    store.put("pin:m:doc", b"{}" * 2000)  # records are not pages: never counted or deleted
    assert store.get("kv:aa01") == page  # a read makes it the most recent
    store.put("kv:aa04", page)  # 4000 > 3500: the oldest, aa02, goes
    assert store.get("kv:aa02") is None and store.evicted == 1
    assert all(store.exists(k) for k in ("kv:aa01", "kv:aa03", "kv:aa04", "pin:m:doc"))
    assert store.stored_bytes == 3000
    time.sleep(0.02)  # distinct mtimes
    store.get("kv:aa03")
    # a restart with a smaller cap keeps the most recently used pages (file times)
    again = FileStorage(str(tmp_path), max_bytes=2000)
    kept = [k for k in ("kv:aa01", "kv:aa03", "kv:aa04") if again.exists(k)]
    assert kept == ["kv:aa03", "kv:aa04"]
    assert again.stored_bytes == 2000


def test_file_tier_cap_in_the_runtime(model, tmp_path):
    """--hicache-storage-size: the scheduler's file tier stays under its cap and outputs hold."""
    import argparse

    from loom.runtime.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--hicache-storage-size", "0.0002", "--hicache-l2-dtype", "int8",
                              "--hicache-sync-loads"])  # fmt: skip
    assert (args.hicache_storage_size, args.hicache_l2_dtype, args.hicache_sync_loads) == (
        0.0002, "int8", True)  # fmt: skip
    with pytest.raises(ValueError, match="^hicache_storage_size"):
        ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="redis",
                   hicache_storage_size=1)  # fmt: skip
    with pytest.raises(ValueError, match="^hicache_l2_dtype"):
        ServerArgs(enable_hierarchical_cache=True, hicache_l2_dtype="fp8")
    sched = _file_sched(model, tmp_path, hicache_storage_size=0.0002)  # 200 kB: ~12 pages
    wl = _workload()
    res = _run(sched, wl[:TENANTS])
    sched.tree_cache.flush_writes()
    total = sum(f.stat().st_size for f in (tmp_path / "kv").glob("*/*"))
    state = sched.get_state()
    assert 0 < total <= 200_000 and state["hicache_storage_bytes"] == total
    assert state["hicache_storage_evicted_pages"] > 0
    off = make_scheduler(model, max_total_tokens=400)
    assert [r.ids for r in res] == [r.ids for r in _run(off, wl[:TENANTS])]
