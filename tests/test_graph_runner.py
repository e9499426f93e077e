"""The CUDA-graph runner's static buffers and padding, on the CPU in eager-replay mode (the
same buffers and padding as on CUDA, the model run eagerly instead of a captured graph):
greedy tokens equal the plain path for ragged batches that pad, and padded rows write K/V
into the padding page only. The capture itself runs on CUDA only (scripts/gpu_check.sh)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from loom.kernels.cuda_graph import capture_batch_sizes
from loom.runtime.forward_batch import ForwardMode
from loom.runtime.graph_runner import GraphRunner, create_graph_runner, graph_sizes
from loom.runtime.server_args import ServerArgs
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

PROMPTS = [[5, 9, 13], [7, 8, 9, 10, 11, 12, 13], [20, 21], [3, 30, 31, 32, 33], [40] * 11]
MAX_NEW = [3, 9, 5, 12, 7]  # finishing one by one: decode batches of 5, 4, 3, 2, 1


# the reference is the eager model forward, so the compiled CPU forward stays out of both runs
EAGER = {"cpu_forward": "eager"} if "cpu_forward" in ServerArgs.__dataclass_fields__ else {}


def serve(path: str, page_size: int, graphs: bool, backend: str):
    sched = make_scheduler(
        path, page_size=page_size, max_total_tokens=256, attention_backend=backend, **EAGER
    )
    runner = sched.runner
    assert runner.graph_runner is None  # the CPU never captures
    steps, decodes = [], []
    if graphs:
        gr = GraphRunner(runner, capture_batch_sizes(8), capture=False)
        runner.graph_runner = gr
        plain_run = gr.run

        def checked_run(batch):
            """The padded step, checked: only the real rows' out slots and the padding page
            change in the KV pool."""
            pool = runner.token_to_kv_pool
            # a sentinel in the out slots: torch.empty may hand back memory that already holds
            # these very values (an earlier test wrote the same prompt's KV there)
            for buf in pool.k_buffers + pool.v_buffers:
                buf[batch.out_cache_loc] = float("nan")
            before = [b.clone() for b in pool.k_buffers + pool.v_buffers]
            logits = plain_run(batch)
            touched = torch.zeros(before[0].shape[0], dtype=torch.bool)
            touched[batch.out_cache_loc] = True
            touched[:page_size] = True  # the padding page
            for old, new in zip(before, pool.k_buffers + pool.v_buffers):
                # compared as bits: never-written pool slots hold whatever torch.empty left,
                # NaN patterns included, and NaN != NaN
                old, new = old.view(torch.int32), new.view(torch.int32)
                assert torch.equal(old[~touched], new[~touched])
                assert not torch.equal(old[batch.out_cache_loc], new[batch.out_cache_loc])
            bs = next(s for s in gr.sizes if s >= batch.batch_size)
            if bs > batch.batch_size:  # padded rows ran: they wrote into slot 0
                assert pool.k_buffers[0][0].abs().sum() > 0
            assert logits.shape[0] == batch.logits_indices.numel()  # B, or 0: KV only
            steps.append((batch.batch_size, bs))
            return logits

        can_run = gr.can_run

        def counted_can_run(batch):
            decodes.append(batch.mode.is_decode)
            return can_run(batch)

        gr.run, gr.can_run = checked_run, counted_can_run
    for i, (ids, new) in enumerate(zip(PROMPTS, MAX_NEW)):
        submit(sched, f"r{i}", ids, greedy(new))
    res = run_all(sched)
    assert len(steps) == sum(decodes)  # every decode step took the padded static buffers
    return [res[f"r{i}"].ids for i in range(len(PROMPTS))], steps


@pytest.mark.parametrize("page_size, backend", [(1, "torch"), (4, "torch"), (4, "cpu_paged")])
def test_padded_static_buffers_give_the_plain_greedy_tokens(tiny_model_dir, page_size, backend):
    path = tiny_model_dir("llama")
    plain, _ = serve(path, page_size, False, backend)
    padded, steps = serve(path, page_size, True, backend)
    assert padded == plain
    assert [len(ids) for ids in padded] == MAX_NEW
    # ragged batches that pad went through the static buffers: 5 -> 8, 3 -> 4 (after 4 -> 4,
    # so row 3 held a finished request's inputs and was reset to padding)
    assert {(5, 8), (4, 4), (3, 4), (2, 2), (1, 1)} <= set(steps)
    assert steps.index((4, 4)) < steps.index((3, 4))


def test_flags_validate_and_mean_no_graphs_on_the_cpu(tiny_model_dir):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(
        parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "12"])
    )
    assert args.disable_cuda_graph and args.cuda_graph_max_bs == 12
    for bad in (0, -4):
        with pytest.raises(ValueError, match="^cuda_graph_max_bs: must be >= 1"):
            ServerArgs(cuda_graph_max_bs=bad)
    assert "never on the CPU" in parser.format_help().replace("\n", " ").replace("  ", " ")
    sched = make_scheduler(tiny_model_dir("llama"), cuda_graph_max_bs=12, max_running_requests=64)
    runner = sched.runner
    assert runner.graph_runner is None and create_graph_runner(runner) is None
    assert graph_sizes(runner) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="capture needs a CUDA device"):
        GraphRunner(runner, [1, 2], capture=True)
    runner.args = runner.args.replace(cuda_graph_max_bs=None)
    assert graph_sizes(runner)[-1] == 64  # the default 160, capped by max running requests


def test_steps_the_graphs_do_not_take(tiny_model_dir):
    """Extend steps, batches over the largest size, tree masks and drafters that read the
    forward's hidden states run eagerly."""
    runner = make_scheduler(tiny_model_dir("llama"), max_total_tokens=256).runner
    gr = GraphRunner(runner, [1, 2], capture=False)
    batch = gr._batch(2, [5, 7])
    assert gr.can_run(batch)
    assert not gr.can_run(dataclasses.replace(batch, mode=ForwardMode.EXTEND))
    assert not gr.can_run(GraphRunner(runner, [1, 2, 4], capture=False)._batch(3, [5, 6, 7]))
    assert not gr.can_run(dataclasses.replace(batch, custom_masks=[None, None]))
    assert not gr.can_run(dataclasses.replace(batch, capture=()))  # a drafter's features
    assert gr.can_run(batch)
