"""The router's approximate radix tree and routing policies, against brute-force references
(no servers: these are the decisions, tests/test_router.py drives real workers)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from loom.runtime.router.args import RouterArgs
from loom.runtime.router.policy import CacheAware, make_policy
from loom.runtime.router.proxy import routing_key
from loom.runtime.router.tree import ApproxTree, ids_key


def lcp(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference_match(routed: dict[str, set[str]], key: str) -> tuple[int, set[str]]:
    best = max((lcp(s, key) for ss in routed.values() for s in ss), default=0)
    if best == 0:
        return 0, set()
    return best, {t for t, ss in routed.items() if any(lcp(s, key) >= best for s in ss)}


@pytest.mark.parametrize("seed", range(4))
def test_tree_matches_brute_force(seed):
    rng = random.Random(seed)
    tree, routed = ApproxTree(), {}
    words = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 12))) for _ in range(60)]
    for step in range(400):
        op = rng.random()
        tenant = f"w{rng.randint(0, 3)}"
        if op < 0.5:
            s = rng.choice(words)
            tree.insert(s, tenant)
            routed.setdefault(tenant, set()).add(s)
        elif op < 0.97:
            key = rng.choice(words) + rng.choice(["", "a", "xyz"])
            matched, holders = tree.match(key)
            assert (matched, set(holders)) == reference_match(routed, key), (step, key)
        else:
            tree.remove_tenant(tenant)
            routed.pop(tenant, None)
        tree.check()


def test_tree_evicts_least_recently_used_first():
    tree = ApproxTree()
    tree.insert("system A: question 1", "w")
    tree.insert("system B: question 1", "w")
    tree.insert("system C: question 1", "w")
    tree.match("system A: question 1")  # A is now the most recently used
    total = tree.size["w"]
    dropped = tree.evict("w", total - 1)
    tree.check()
    assert dropped >= 1 and tree.size["w"] <= total - 1
    assert tree.match("system A: question 1")[0] == len("system A: question 1")
    assert tree.match("system B: question 1")[0] < len("system B: question 1")
    tree.evict("w", 0)
    tree.check()
    assert tree.size["w"] == 0 and tree.match("system A")[0] == 0 and not tree.root.children


@dataclass(eq=False)
class W:
    url: str
    in_flight: int = 0


def test_cache_aware_follows_prefixes_until_loads_drift():
    policy = CacheAware(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=2.0)
    a, b = W("a"), W("b")
    tenants = [f"tenant {i}: " + "x" * 40 + str(i) * 40 for i in range(6)]
    first = {t: policy.select([a, b], t + "q0").url for t in tenants}
    assert set(first.values()) == {"a", "b"}  # new prompts go to the smaller tree
    for q in range(1, 5):
        for t in tenants:
            assert policy.select([a, b], f"{t}q{q}").url == first[t]
    # loads drift past both thresholds: the least loaded worker wins despite the prefix
    a.in_flight, b.in_flight = 10, 1
    t_on_a = next(t for t in tenants if first[t] == "a")
    assert policy.select([a, b], t_on_a + "q9").url == "b"
    # within the absolute threshold the prefix still wins
    a.in_flight, b.in_flight = 4, 1
    assert policy.select([a, b], t_on_a + "q10").url == "a"
    assert policy.decisions["balance"] == 1
    policy.remove_worker("a")
    assert policy.select([b], t_on_a + "q11").url == "b"
    policy.tree.check()


def test_round_robin_and_shortest_queue():
    a, b, c = W("a", 3), W("b", 1), W("c", 2)
    rr = make_policy("round_robin")
    assert [rr.select([a, b, c], None).url for _ in range(4)] == ["a", "b", "c", "a"]
    assert make_policy("shortest_queue").select([a, b, c], "x").url == "b"
    with pytest.raises(ValueError, match="policy"):
        make_policy("random")


def test_routing_keys():
    assert routing_key("/generate", {"text": "hi"}) == "hi"
    assert routing_key("/generate", {"text": ["a", "b"]}) == "a"
    assert routing_key("/generate", {"input_ids": [[5, 6], [7]]}) == ids_key([5, 6])
    assert routing_key("/v1/completions", {"prompt": [1, 2, 3]}) == ids_key([1, 2, 3])
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
    assert routing_key("/v1/chat/completions", chat) == "system\nS\nuser\nQ\n"
    assert routing_key("/generate", ["not", "a", "dict"]) is None
    assert not ids_key([1]).startswith("\x01")  # ids never collide with text keys


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"policy": "random"}, "policy"),
        ({"worker_urls": ("localhost:1",)}, "worker_urls"),
        ({"worker_urls": ("http://a:1", "http://a:1/")}, "worker_urls"),
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"health_failure_threshold": 0}, "health_failure_threshold"),
    ],
)
def test_router_args_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RouterArgs(**kwargs)


def test_cli_pd_flags(capsys):
    from loom.runtime.router.launch import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--worker-urls", "http://a:1", "--pd-disaggregation"])
    assert "worker_urls: use --prefill and --decode with PD" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://a:1"])
    assert "prefill: needs --pd-disaggregation" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(
            ["--pd-disaggregation", "--prefill", "9000", "http://a:1", "--decode", "http://b:1"]
        )
    assert "prefill: bootstrap port 9000 does not follow a URL" in capsys.readouterr().err
    args = parse_args(
        ["--pd-disaggregation", "--prefill", "http://a:1", "9001", "http://c:1"]
        + ["--prefill", "http://d:1/", "--decode", "http://b:1", "http://e:1"]
    )
    assert args.prefill == (("http://a:1", 9001), ("http://c:1", None), ("http://d:1", None))
    assert args.decode == ("http://b:1", "http://e:1")
    assert args.all_worker_urls == (
        "http://a:1",
        "http://c:1",
        "http://d:1",
        "http://b:1",
        "http://e:1",
    )
    args = parse_args(["--worker-urls", "http://a:1/", "--policy", "round_robin"])
    assert args.worker_urls == ("http://a:1",) and args.policy == "round_robin"


def test_cache_aware_flags_reach_the_policy():
    """`loom router --cache-threshold/--balance-*-threshold/--max-tree-size` are read: the
    app's policy holds the values given on the command line."""
    from loom.runtime.router.app import create_app
    from loom.runtime.router.launch import parse_args

    argv = ["--worker-urls", "http://a:1", "--policy", "cache_aware", "--cache-threshold", "0.25"]
    argv += ["--balance-abs-threshold", "7", "--balance-rel-threshold", "1.5"]
    policy = create_app(parse_args(argv + ["--max-tree-size", "1000"])).state.pool.policy
    assert isinstance(policy, CacheAware)
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.25, 7)
    assert (policy.balance_rel_threshold, policy.max_tree_size) == (1.5, 1000)


def test_a_failed_request_removes_a_worker_only_if_health_fails_too():
    import asyncio

    from loom.runtime.router.policy import RoundRobin
    from loom.runtime.router.workers import WorkerPool

    class Client:
        def __init__(self, healthy: set[str]):
            self.healthy = healthy

        async def get(self, url, timeout):
            if url.split("/health")[0] not in self.healthy:
                raise ConnectionRefusedError("refused")

            class Res:
                status_code = 200

            return Res()

    pool = WorkerPool(RoundRobin(), ["http://a:1", "http://b:1"])
    client = Client({"http://a:1"})
    a, b = pool.workers["http://a:1"], pool.workers["http://b:1"]
    assert asyncio.run(pool.probe(client, a, 1.0, 1, cause="request failed: reset"))
    assert asyncio.run(pool.probe(client, b, 1.0, 3)) is False  # 1 of 3: stays
    assert list(pool.workers) == ["http://a:1", "http://b:1"]
    assert asyncio.run(pool.probe(client, b, 1.0, 3, cause="request failed: reset")) is False
    assert list(pool.workers) == ["http://a:1"]
    reason = pool.listing()["removed"][0]["removed_reason"]
    assert reason.startswith("request failed: reset; then /health failed: ConnectionRefusedError")


def test_cli_router_and_serve_help(capsys):
    from loom.cli import main

    for argv, flags in [
        (
            ["router", "--help"],
            [
                "--worker-urls",
                "--policy",
                "--balance-abs-threshold",
                "--pd-disaggregation",
                "--prefill",
            ],
        ),
        (["serve", "--help"], ["--dp-size", "--load-balance-method", "--disaggregation-mode"]),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert all(f in out for f in flags), (argv, out[:500])


def test_worker_metrics_merge_into_valid_prometheus_text():
    from prometheus_client.parser import text_string_to_metric_families

    from loom.runtime.router.metrics import merge_worker_metrics

    one = (
        '# HELP loom:requests_total n\n# TYPE loom:requests_total counter\nloom:requests_total{model="m"} 3.0\n'
        "# HELP loom:running n\n# TYPE loom:running gauge\nloom:running 1.0\n"
    )
    two = one.replace("3.0", "5.0")
    text = merge_worker_metrics([("http://a:1", one), ("http://b:1", two), ("http://c:1", "")])
    samples = {
        (s.name, s.labels.get("worker"), s.labels.get("model")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("loom:requests_total", "http://a:1", "m")] == 3.0
    assert samples[("loom:requests_total", "http://b:1", "m")] == 5.0
    assert samples[("loom:running", "http://b:1", None)] == 1.0
    assert text.count("# TYPE loom:running gauge") == 1
