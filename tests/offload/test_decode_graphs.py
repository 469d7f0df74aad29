"""CUDA-graph readiness of resident decode passes, checked on the CPU (offload/decode_graphs.py): the
static-buffer runner over batch and context buckets gives the eager engine's tokens; two steady
steps of a bucket issue the same operators on the same shapes, dtypes and long-lived buffers, and
nothing in the pass waits for the device. On a GPU the same passes are captured and replayed
(tests/offload/test_cuda.py::test_decode_graphs_on_cuda_give_the_eager_tokens)."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from flexsarathi.machine.launch_counter import LaunchCounter
from offload.decode_graphs import bucket_of
from policy_search import Policy
from offload.memory import TierBudget

# Lengths whose decodes cross context buckets (16 -> 32 -> 64 keys) and batches that pad (3 -> 4, 5 -> 8).
PROMPT_LENS = (3, 13, 7, 20, 5)
PARAMS = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def _prompts(vocab: int, lens=PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]


def _generate(folder, graphs: bool, prompts, **policy):
    policy = Policy(**{"gpu_batch_size": 4, "overlap": False, **policy})
    with LLM(folder, dtype="float32", device="cpu", policy=policy, cuda_graphs=graphs) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        return tokens, llm.engine.stats["graph_passes"]


def test_bucket_of_pads_to_powers_of_two():
    assert bucket_of(1, 1) == (1, 16)
    assert bucket_of(3, 17) == (4, 32)
    assert bucket_of(4, 32) == (4, 32)
    assert bucket_of(5, 33) == (8, 64)


@pytest.mark.parametrize("kind", ["opt", "llama_gqa_untied", "qwen2", "gemma3"])  # gemma3: windows per layer
@pytest.mark.parametrize("scheduler", ["block", "decode-maximal"])
def test_static_buffer_passes_give_the_eager_tokens(tiny_checkpoint, kind, scheduler):
    folder, _ = tiny_checkpoint(kind)
    prompts = _prompts(128)
    eager, none = _generate(folder, False, prompts, scheduler=scheduler)
    static, replayed = _generate(folder, True, prompts, scheduler=scheduler, prefill_budget=8)
    assert none == 0 and replayed > 0
    assert static == eager


def test_a_bigger_batch_replaces_the_pool_and_the_graphs_follow(tiny_checkpoint):
    """The second generate needs a larger KV pool: the graphs of the first address the old one and
    are dropped; the tokens stay the eager engine's."""
    folder, _ = tiny_checkpoint("opt")
    small, large = _prompts(128, (4, 6)), _prompts(128, (9, 3, 12, 5, 7))
    policy = Policy(gpu_batch_size=8, overlap=False, scheduler="block")
    runs = {}
    for graphs in (False, True):
        with LLM(folder, dtype="float32", device="cpu", policy=policy, cuda_graphs=graphs) as llm:
            runs[graphs] = [[o.token_ids for o in llm.generate(p, PARAMS, use_tqdm=False)] for p in (small, large)]
            if graphs:
                assert llm.engine.memory.in_use_by_what("gpu").get("decode graphs", 0) > 0
    assert runs[True] == runs[False]


def test_a_bucket_over_the_budget_runs_eagerly(tiny_checkpoint):
    """A bucket's graph keeps its working set: reserved at its first pass, and only where the largest
    eager pass of the running requests still fits beside it. A budget one byte short of all the
    buckets refuses some: they run eagerly, with the same tokens."""
    folder, _ = tiny_checkpoint("opt")
    prompts = _prompts(128)
    eager, _ = _generate(folder, False, prompts, scheduler="decode-maximal")
    policy = Policy(gpu_batch_size=4, overlap=False, scheduler="decode-maximal", prefill_budget=8)
    with LLM(folder, dtype="float32", device="cpu", policy=policy, cuda_graphs=True) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        all_graphs = llm.engine.stats["graph_passes"]
        memory = llm.engine.memory
        graph_bytes = memory.in_use_by_what("gpu")["decode graphs"]
        needed = memory.in_use("gpu") + llm.engine.worst_pass_bytes  # everything, graphs included
    assert tokens == eager and all_graphs > 0
    with LLM(folder, dtype="float32", device="cpu", policy=policy, cuda_graphs=True) as llm:
        llm.engine.memory.budget = TierBudget(gpu=needed - 1)
        tokens = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        refused = llm.engine.graph_passes._refused
        assert refused and llm.engine.memory.in_use_by_what("gpu").get("decode graphs", 0) < graph_bytes
        assert llm.engine.stats["graph_passes"] < all_graphs
    assert tokens == eager


def _pass_trace(llm, steps: int):
    """Per decode pass of the static runner: its launches as (operator, shapes, dtypes, the storage
    of each input that outlives the pass or None), and the syncs it made."""
    graphs = llm.engine.graph_passes.graphs
    run = graphs.executor.run
    traces = []

    def traced(micro_batches):
        if not all(g.is_decode for mb in micro_batches for g in mb.groups):
            return run(micro_batches)  # the prompt pass: eager
        counter = LaunchCounter()
        with counter:
            logits = run(micro_batches)
        traces.append((counter, logits))
        return logits

    graphs.executor.run = traced
    try:
        llm.generate(_prompts(llm.engine.config.vocab_size, (5, 5)),
                     SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True), use_tqdm=False)
    finally:
        graphs.executor.run = run
    return traces


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def test_two_steady_decode_steps_issue_the_same_kernels_on_the_same_buffers(tiny_checkpoint):
    """What a CUDA graph needs: each steady step of a bucket launches the same operators on the same
    shapes and dtypes, reading and writing the same long-lived buffers (weights, KV pool, the
    bucket's input buffer) at the same places in the sequence."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    policy = Policy(gpu_batch_size=2, overlap=False, scheduler="block")
    with LLM(folder, dtype="float16", device="cpu", policy=policy, cuda_graphs=True) as llm:
        traces = []
        for _ in range(2):  # the second generate reuses the first's bucket: its buffers stay
            traces += _pass_trace(llm, 4)
        engine = llm.engine
        buckets = list(engine.graph_passes.graphs._buckets.values())
        long_lived = _storages([engine.kv_pools["gpu"].kv, buckets[0].inputs, *engine.weights.global_weights().values()])
        for layer in range(engine.config.num_layers):
            long_lived |= _storages(engine.weights.get(layer).values())
            engine.weights.release(layer)
        pool_and_inputs = _storages([engine.kv_pools["gpu"].kv, buckets[0].inputs])
    assert len(buckets) == 1 and engine.stats["graph_passes"] == len(traces) == 6  # 3 decodes each, one bucket
    steps = [[(name, shapes, dtypes, tuple(p if p in long_lived else None for p in ptrs))
              for name, shapes, dtypes, ptrs in counter.ops] for counter, _ in traces]
    assert all(step == steps[0] for step in steps[1:]), "a steady decode step changed what it launches"
    touched = {p for _, _, _, ptrs in steps[0] for p in ptrs if p is not None}
    assert pool_and_inputs <= touched  # what the check is about
    assert all(not counter.syncs for counter, _ in traces), [c.syncs for c, _ in traces]


def test_the_static_pass_makes_no_sync_even_on_a_fresh_bucket(tiny_checkpoint):
    """No .item(), nonzero or pinned allocation anywhere in the pass a graph would capture (the
    first pass of a bucket included: it is the one captured)."""
    folder, _ = tiny_checkpoint("opt")
    with LLM(folder, dtype="float32", device="cpu", policy=Policy(gpu_batch_size=2, overlap=False),
             cuda_graphs=True) as llm:
        traces = _pass_trace(llm, 3)
    assert traces and all(not counter.syncs for counter, _ in traces)
