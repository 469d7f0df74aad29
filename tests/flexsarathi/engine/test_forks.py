"""`SamplingParams(n=...)`: the n completions of a prompt share its prefill (the first sequence
computes it, the others fork from it with its KV). References: each completion run alone with
the seed it is given (sample_seed(seed, k)), and, without a model, a simulated sampler whose
tokens are a fixed function of (sequence, position) with every KV slot's content tracked."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsarathi import LLM, SamplingParams
from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.sampling import sample_seed
from flexsarathi.engine.scheduler import Scheduler, SchedulerConfig
from flexsarathi.engine.sequence import Sequence
from policy_search import Policy
from tests.simulated_model import expected_tokens, sampled_token

BLOCK = 4
PROMPTS = [[5, 6, 7], [9, 1, 2, 3, 4, 8, 11, 12], [3, 30, 60, 90, 120, 7, 70]]  # < 1 block, 2 full, 1 + partial


def alone(folder, prompt, params: SamplingParams, compress_kv: bool) -> list[list[int]]:
    """Each of the n completions run as its own request with its own seed."""
    llm = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=1, prefill_budget=64, compress_kv=compress_kv),
              kv_block_size=BLOCK)
    outs = []
    for k in range(params.n):
        single = dataclasses.replace(params, n=1, seed=sample_seed(params.seed, k))
        outs.append(llm.generate([prompt], single, use_tqdm=False)[0].token_ids)
    llm.close()
    return outs


SAMPLING = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=1.0),
    "top_p_top_k": dict(temperature=0.8, top_p=0.9, top_k=20),
}
PLACEMENTS = {
    "device": dict(),
    "cpu_disk": dict(kv_gpu=0.0, kv_cpu=0.5, kv_disk=0.5),  # tables cross from the cpu tier to disk
}


@pytest.mark.parametrize("sampling,placement,compress_kv,scheduler", [
    ("temperature", "device", False, "decode-maximal"),
    ("greedy", "device", False, "block"),
    ("top_p_top_k", "device", True, "decode-maximal"),
    ("temperature", "cpu_disk", False, "decode-maximal"),
    ("temperature", "cpu_disk", True, "block"),
    ("top_p_top_k", "cpu_disk", True, "decode-maximal"),
])
def test_n_completions_equal_seeded_single_runs_and_the_prompt_is_computed_once(
        tiny_checkpoint, tmp_path, sampling, placement, compress_kv, scheduler):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    params = SamplingParams(max_tokens=10, seed=21, n=3, ignore_eos=True, **SAMPLING[sampling])
    policy = Policy(gpu_batch_size=8, prefill_budget=6, compress_kv=compress_kv, scheduler=scheduler,
                    kv_admission="reserve" if scheduler == "block" else "on-demand", **PLACEMENTS[placement])
    with LLM(folder, dtype="float32", policy=policy, kv_block_size=BLOCK, offload_dir=str(tmp_path)) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        stats = llm.last_stats
    for prompt, out in zip(PROMPTS, outs):
        assert [c.token_ids for c in out.outputs] == alone(folder, prompt, params, compress_kv)
    assert stats["preemptions"] == 0
    assert stats["prefill_tokens_computed"] == sum(map(len, PROMPTS))  # not n times
    assert stats["prompt_tokens"] == sum(map(len, PROMPTS))  # counted once per request


@pytest.mark.parametrize("compress_kv", [False, True])
def test_a_tiny_cache_preempts_forks_and_parents_and_outputs_stay_exact(tiny_checkpoint, compress_kv):
    """KV for 48 tokens, 3 prompts x 4 completions of up to 7 + 20 tokens: forks and parents are
    preempted and recompute their own tokens; each completion still equals its single run."""
    folder, _ = tiny_checkpoint("opt")
    prompts = [PROMPTS[0], PROMPTS[2], [4] * 6]
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=4, n=4, ignore_eos=True)
    tight = Policy(gpu_batch_size=8, prefill_budget=8, compress_kv=compress_kv, kv_cache_tokens=48,
                   kv_gpu=0.5, kv_cpu=0.5)
    with LLM(folder, dtype="float32", policy=tight, kv_block_size=BLOCK) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.last_stats["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert [c.token_ids for c in out.outputs] == alone(folder, prompt, params, compress_kv)


def test_a_parent_that_stops_at_its_first_token_leaves_its_siblings_their_tokens(tiny_checkpoint):
    folder, _ = tiny_checkpoint("opt")
    prompt = PROMPTS[2]
    probe = SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=3, ignore_eos=True)
    first = alone(folder, prompt, probe, False)[0][0]  # the parent's first token
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=9, n=3, ignore_eos=True, stop_token_ids=[first])
    expected = alone(folder, prompt, params, False)
    assert expected[0] == [first] and any(len(e) > 1 for e in expected[1:])
    with LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=4, prefill_budget=4), kv_block_size=BLOCK) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == expected
    assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("caching", [False, True])
def test_more_completions_than_running_slots_split_into_groups(tiny_checkpoint, caching):
    """n = 5 with 2 running slots: groups of 2, 2 and 1, each prefilling the prompt once; with
    prefix caching the later groups take the first's complete blocks but the last one's."""
    folder, _ = tiny_checkpoint("opt")
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=2, n=5, ignore_eos=True)
    with LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=8), kv_block_size=BLOCK,
             enable_prefix_caching=caching) as llm:
        out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
        n = len(PROMPTS[1])
        cached = (n - 1) // BLOCK * BLOCK if caching else 0  # a pass computes the last token: not cached
        assert llm.last_stats["prefill_tokens_computed"] == n + 2 * (n - cached)
    assert [c.token_ids for c in out.outputs] == alone(folder, PROMPTS[1], params, False)


# ---- without a model: every schedule, checked slot by slot --------------------------------------


def make_groups(groups, shared: int = 0) -> list[list[Sequence]]:
    """groups: (prompt_len, max_tokens, [stop_at per completion]); prompts differ between groups
    but in their first `shared` tokens, which all have alike."""
    made, next_id = [], 0
    for g, (n, m, stops) in enumerate(groups):
        prompt = [i % 89 + 1 for i in range(min(shared, n))] + [(g * 13 + i) % 97 + 1 for i in range(shared, n)]
        group = []
        for stop_at in stops:
            stop = frozenset({sampled_token(next_id, n + stop_at)}) if stop_at < m else frozenset()
            group.append(Sequence(next_id, list(prompt), SamplingParams(max_tokens=m), max_len=n + m,
                                  stop_ids=stop, generator=torch.Generator()))
            next_id += 1
        made.append(group)
    return made


def check_refcounts(blocks: BlockManager, scheduler: Scheduler) -> None:
    """Each block's count is the number of tables holding it (running sequences and forks
    waiting in them); free blocks are held by none."""
    holders = scheduler.running + [f for s in scheduler.running for f in s.forks]
    counts = [0] * blocks.num_blocks
    for seq in holders:
        for b in seq.block_table:
            counts[b] += 1
    assert counts == blocks.refs
    free = [b for tier in blocks.free.values() for b in tier]
    assert len(set(free)) == len(free) and all(counts[b] == 0 for b in free)
    assert sum(c > 0 for c in counts) + len(free) == blocks.num_blocks


def run_groups(groups, *, budget, max_running, kv_blocks, admission, mode, tiers, prefix_caching=False):
    """The engine's loop with a simulated model: each pass writes its items' tokens into their KV
    slots after checking that every earlier position of the item's table holds its own token
    (blocks found in the prefix cache included); a fork copies its parent's partial block, as the
    engine does. Returns the scheduler."""
    split = {t: kv_blocks // len(tiers) + (i < kv_blocks % len(tiers)) for i, t in enumerate(tiers)}
    blocks = BlockManager(BLOCK, split, num_residual=max_running, prefix_caching=prefix_caching)
    scheduler = Scheduler(SchedulerConfig(max_running=max_running, num_micro_batches=1, prefill_budget=budget,
                                          mode=mode, kv_admission=admission), blocks)
    for group in groups:
        scheduler.add_group(group)
    content: dict[tuple[int, int], int] = {}  # (block, offset) -> token id held there

    def slot(seq, p):
        return seq.block_table[p // BLOCK], p % BLOCK

    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        items = plan.items
        assert items, "a pass with nothing to do"
        assert len(scheduler.running) + sum(len(s.forks) for s in scheduler.running) <= max_running
        check_refcounts(blocks, scheduler)
        for it in items:
            seq = it.seq
            assert [content.get(slot(seq, p)) for p in range(it.start)] == seq.token_ids(0, it.start)
            for p in range(it.start, it.end):
                # Shared blocks are written only by a parent prefilling the prompt for its forks.
                shared = blocks.refs[slot(seq, p)[0]] > 1
                assert not shared or (seq.forks and p < seq.num_prompt_tokens), "a shared block is overwritten"
                content[slot(seq, p)] = seq.token_ids(p, p + 1)[0]
        sampling = []
        for seq in [it.seq for it in items if it.samples]:
            for fork in seq.forks:  # the prompt's last, partial block, copied as the engine does
                for p in range(seq.num_prompt_tokens // BLOCK * BLOCK, seq.num_prompt_tokens):
                    content[slot(fork, p)] = content[slot(seq, p)]
            sampling += [seq, *seq.forks]
        scheduler.postprocess(plan, sampling, [sampled_token(s.seq_id, s.num_tokens) for s in sampling])
    assert blocks.num_free == blocks.num_blocks and set(blocks.refs) <= {0}  # nothing leaked
    return scheduler


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 13), st.integers(1, 12), st.lists(st.integers(0, 14), min_size=1,
                                                                                max_size=5)),
                min_size=1, max_size=4),
       st.integers(1, 12), st.integers(1, 6), st.integers(0, 10),
       st.sampled_from([("on-demand", "decode-maximal"), ("reserve", "decode-maximal"), ("reserve", "block")]),
       st.sampled_from([("cpu",), ("gpu", "cpu"), ("gpu", "cpu", "disk")]))
def test_forks_get_exactly_their_tokens_and_leak_no_block(groups, budget, max_running, spare, mode, tiers):
    seqs = make_groups(groups)
    expected = [[expected_tokens(s) for s in g] for g in make_groups(groups)]
    kv_blocks = max(math.ceil(s.max_len / BLOCK) for g in seqs for s in g) + spare
    run_groups(seqs, budget=budget, max_running=max_running, kv_blocks=kv_blocks, admission=mode[0],
               mode=mode[1], tiers=tiers)
    assert [[s.output_token_ids for s in g] for g in seqs] == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 17), st.integers(1, 12), st.lists(st.integers(0, 14), min_size=1,
                                                                                max_size=3)),
                min_size=1, max_size=5),
       st.integers(0, 16), st.integers(1, 12), st.integers(1, 6), st.integers(0, 4),
       st.sampled_from([("on-demand", "decode-maximal"), ("reserve", "decode-maximal"), ("reserve", "block")]),
       st.sampled_from([("gpu", "cpu"), ("gpu", "cpu", "disk")]))
def test_with_prefix_caching_every_pass_reads_its_own_tokens(groups, shared, budget, max_running, spare, mode,
                                                             tiers):
    """Prompts sharing their start, forks, preemptions and tight tiers: every block an admission
    finds holds the tokens of its positions (run_groups checks each item's context slot by slot),
    tables keep their tier order, nothing leaks, and the outputs are those of the cache-less run."""
    seqs = make_groups(groups, shared)
    expected = [[expected_tokens(s) for s in g] for g in make_groups(groups, shared)]
    kv_blocks = max(math.ceil(s.max_len / BLOCK) for g in seqs for s in g) + spare
    scheduler = run_groups(seqs, budget=budget, max_running=max_running, kv_blocks=kv_blocks, admission=mode[0],
                           mode=mode[1], tiers=tiers, prefix_caching=True)
    assert [[s.output_token_ids for s in g] for g in seqs] == expected
    assert scheduler.num_prefill_tokens + scheduler.num_cached_tokens >= sum(len(g[0].prompt_token_ids)
                                                                             for g in seqs)


def test_prefix_caching_finds_the_shared_start_of_later_prompts():
    """One request at a time, prompts sharing 9 tokens: each after the first finds 2 blocks."""
    seqs = make_groups([(12, 3, [20]), (11, 3, [20]), (13, 3, [20])], shared=9)
    scheduler = run_groups(seqs, budget=16, max_running=1, kv_blocks=12, admission="on-demand",
                           mode="decode-maximal", tiers=("gpu", "cpu"), prefix_caching=True)
    assert [g[0].num_cached_tokens for g in seqs] == [0, 8, 8]
    assert scheduler.num_prefill_tokens == 12 + 11 + 13 - 16


def test_without_preemption_each_prompt_is_prefilled_once():
    seqs = make_groups([(9, 6, [20, 20, 20]), (5, 4, [20, 20])])
    scheduler = run_groups(seqs, budget=4, max_running=5, kv_blocks=40, admission="on-demand",
                           mode="decode-maximal", tiers=("cpu",))
    assert scheduler.num_preemptions == 0 and scheduler.num_prefill_tokens == 9 + 5


def test_a_parent_preempted_before_its_forks_join_takes_them_back_to_the_queue(monkeypatch):
    """A found case: a 2-tier cache of 9 blocks, where a parent still prefilling is preempted;
    its forks' blocks are given back and the group is readmitted, prefilling once more."""
    groups = [(3, 6, [13, 1, 1, 8, 2]), (5, 4, [5, 11, 11]), (5, 5, [14, 7, 14, 2, 12]), (8, 9, [0, 10])]
    seqs = make_groups(groups)
    expected = [[expected_tokens(s) for s in g] for g in make_groups(groups)]
    preempted_with_forks = []
    original = Scheduler._preempt

    def preempt(self, victim):
        preempted_with_forks.append(bool(victim.forks))
        original(self, victim)

    monkeypatch.setattr(Scheduler, "_preempt", preempt)  # observes only: the real method runs
    run_groups(seqs, budget=3, max_running=6, kv_blocks=9, admission="on-demand", mode="decode-maximal",
               tiers=("gpu", "cpu"))
    assert any(preempted_with_forks)
    assert [[s.output_token_ids for s in g] for g in seqs] == expected
