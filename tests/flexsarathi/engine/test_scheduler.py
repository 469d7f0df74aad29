"""The scheduler's decisions, pass by pass, on real sequences and block bookkeeping (no model: a
pass samples a fixed token and hands it to Scheduler.postprocess, as the engine does; the
model's math under these schedules is tested in test_models.py)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsarathi.engine.block_manager import TIERS, BlockManager
from flexsarathi.engine.sampling import SamplingParams
from flexsarathi.engine.scheduler import Scheduler, SchedulerConfig
from flexsarathi.engine.sequence import Sequence
from tests.simulated_model import expected_tokens, sampled_token

BLOCK = 4
TOKEN = 7  # what every simulated pass samples (never a stop token: stop_ids is empty)


def make_seqs(prompt_lens, max_tokens) -> list[Sequence]:
    return [Sequence(i, [1] * n, SamplingParams(max_tokens=m, ignore_eos=True), max_len=n + m,
                     stop_ids=frozenset(), generator=torch.Generator())
            for i, (n, m) in enumerate(zip(prompt_lens, max_tokens))]


def run(seqs, *, budget, max_running, defer=True, micro_batches=1, kv_blocks=None):
    """Schedules `seqs` to the end. Returns the passes, each a list of (seq_id, start, end, kind),
    kind "prefill" or "decode", and per pass what stood before it: (whether some waiting request
    could not be admitted now for want of a slot or of KV blocks, ids of the running sequences
    past their prompt)."""
    if kv_blocks is None:  # room for every sequence at once
        kv_blocks = sum(math.ceil(s.max_len / BLOCK) for s in seqs)
    blocks = BlockManager(BLOCK, {"cpu": kv_blocks}, num_residual=len(seqs))
    config = SchedulerConfig(max_running=max_running, num_micro_batches=micro_batches,
                             prefill_budget=budget, defer_decodes_with_slack=defer)
    scheduler = Scheduler(config, blocks)
    for seq in seqs:
        scheduler.add(seq)
    passes, waiting_before = [], []
    while scheduler.has_unfinished():
        free_blocks = sum(len(free) for free in blocks.free.values())
        wanted = sum(math.ceil(s.max_len / BLOCK) for s in scheduler.waiting)
        waits_for_room = len(scheduler.running) + len(scheduler.waiting) > max_running or wanted > free_blocks
        waiting_before.append((waits_for_room,
                               {s.seq_id for s in scheduler.running if not s.is_prefilling}))
        plan = scheduler.schedule()
        items = plan.items
        assert items, "a pass with nothing to do"
        passes.append([(it.seq.seq_id, it.start, it.end, "prefill" if it.seq.is_prefilling else "decode")
                       for it in items])
        sampling = [it.seq for it in items if it.samples]
        scheduler.postprocess(plan, sampling, [TOKEN] * len(sampling))
    return passes, waiting_before


def decodes(pass_items):
    return [sid for sid, _, _, kind in pass_items if kind == "decode"]


def prefills(pass_items):
    return [sid for sid, _, _, kind in pass_items if kind == "prefill"]


def test_closed_batch_prefill_passes_carry_no_decodes_and_take_no_more_passes():
    # 4 prompts of 8 tokens, budget 8: one prompt per pass, then max_tokens - 1 decode passes for
    # the last one. The earlier ones have slack: their decodes wait for the prefill passes to end.
    lens, gen = [8, 8, 8, 8], [5, 5, 5, 5]
    deferred, _ = run(make_seqs(lens, gen), budget=8, max_running=4)
    eager, _ = run(make_seqs(lens, gen), budget=8, max_running=4, defer=False)
    expected_passes = math.ceil(sum(lens) / 8) + gen[-1] - 1
    assert len(deferred) == len(eager) == expected_passes
    for k in range(4):  # the prefill passes: one whole prompt each, no decode rows
        assert deferred[k] == [(k, 0, 8, "prefill")]
    assert decodes(eager[1]) == [0]  # decode-maximal: seq 0 decodes beside seq 1's prompt
    for k in range(4, expected_passes):
        assert sorted(decodes(deferred[k])) == [0, 1, 2, 3]


def test_the_sequence_that_finishes_last_is_never_deferred():
    # A: 4-token prompt, 20 tokens to generate; B: 12-token prompt, 2 tokens. A is the critical
    # path: deferring its decodes behind B's prefill would lengthen the batch.
    seqs = make_seqs([4, 12], [20, 2])
    passes, _ = run(seqs, budget=4, max_running=2)
    assert passes[0] == [(0, 0, 4, "prefill")]
    for k in (1, 2, 3):
        assert prefills(passes[k]) == [1] and decodes(passes[k]) == [0]
    assert len(passes) == 20  # A: its prompt pass, then one pass per further token
    assert len(seqs[0].output_token_ids) == 20 and len(seqs[1].output_token_ids) == 2


def test_no_deferral_while_requests_wait_for_room():
    seqs = make_seqs([6, 9, 5, 7, 8, 4], [6, 3, 5, 4, 6, 2])
    passes, before = run(seqs, budget=4, max_running=2)
    checked = 0
    for items, (waits_for_room, decoding) in zip(passes, before):
        if waits_for_room:  # every decoding sequence decodes (decode-maximal)
            assert set(decodes(items)) == decoding
            checked += bool(decoding)
    assert checked >= 3
    assert [len(s.output_token_ids) for s in seqs] == [6, 3, 5, 4, 6, 2]


def test_no_deferral_while_requests_wait_for_kv_blocks():
    # Slots for all, but KV blocks for two sequences at a time: the others wait for room.
    seqs = make_seqs([8, 8, 8, 8], [8, 8, 8, 8])
    passes, before = run(seqs, budget=4, max_running=4, kv_blocks=2 * math.ceil(16 / BLOCK))
    checked = 0
    for items, (waits_for_room, decoding) in zip(passes, before):
        if waits_for_room:
            assert set(decodes(items)) == decoding
            checked += bool(decoding)
    assert checked >= 3
    assert [len(s.output_token_ids) for s in seqs] == [8, 8, 8, 8]


def test_switched_off_every_decoding_sequence_decodes_every_pass():
    seqs = make_seqs([8, 8, 8], [4, 4, 4])
    passes, _ = run(seqs, budget=8, max_running=3, defer=False)
    for k, items in enumerate(passes[:3]):
        assert decodes(items) == list(range(k))  # all sequences admitted before this pass decode


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=7),
       st.integers(1, 16), st.integers(1, 7), st.integers(1, 3))
def test_deferral_never_lengthens_a_batch(requests, budget, max_running, micro_batches):
    """Against decode-maximal on the same requests (no stop tokens, so lengths are known): the
    same number of passes, every sequence gets all its tokens, and passes carrying prompt chunks
    never carry more decode rows."""
    lens, gen = [n for n, _ in requests], [m for _, m in requests]
    seqs_d, seqs_e = make_seqs(lens, gen), make_seqs(lens, gen)
    deferred, _ = run(seqs_d, budget=budget, max_running=max_running, micro_batches=micro_batches)
    eager, _ = run(seqs_e, budget=budget, max_running=max_running, defer=False,
                   micro_batches=micro_batches)
    assert len(deferred) == len(eager)
    assert [len(s.output_token_ids) for s in seqs_d] == gen
    assert sum(len(decodes(p)) for p in deferred if prefills(p)) <= sum(
        len(decodes(p)) for p in eager if prefills(p))


# ---- KV admission: on demand (preempting) and by lifetime reservation -------------------------
# The simulated model (tests/simulated_model.py): sampled_token, expected_tokens.


def make_stopping_seqs(requests) -> list[Sequence]:
    """requests: (prompt_len, max_tokens, stop_at): the token sampled at output index stop_at
    (when it exists) is the sequence's stop token; it may occur earlier."""
    seqs = []
    for i, (n, m, stop_at) in enumerate(requests):
        stop = frozenset({sampled_token(i, n + stop_at)}) if stop_at < m else frozenset()
        seqs.append(Sequence(i, [1] * n, SamplingParams(max_tokens=m), max_len=n + m, stop_ids=stop,
                             generator=torch.Generator()))
    return seqs


def simulated_postprocess(scheduler: Scheduler, plan) -> None:
    """The engine's postprocess with the simulated model's tokens."""
    sampling = [it.seq for it in plan.items if it.samples]
    scheduler.postprocess(plan, sampling, [sampled_token(s.seq_id, s.num_tokens) for s in sampling])


def check_pool(blocks: BlockManager, running: list[Sequence]) -> None:
    """No block owned twice or both owned and free; each tier's blocks in one contiguous run of a
    table, fastest tier first; residual rows unique."""
    owned = [b for s in running for b in s.block_table]
    free = [b for tier in blocks.free.values() for b in tier]
    assert len(set(owned)) == len(owned) and not set(owned) & set(free)
    assert len(owned) + len(free) == blocks.num_blocks
    for s in running:
        tiers = [TIERS.index(blocks.tier_of(b)) for b in s.block_table]
        assert tiers == sorted(tiers)
    rows = [s.residual_id for s in running] + list(blocks.free_residual)
    assert sorted(rows) == list(range(len(rows)))


def run_checked(seqs, *, budget, max_running, kv_blocks, admission="on-demand", mode="decode-maximal",
                tiers=("cpu",), defer=True):
    """Runs to the end, checking every pass: the budget and slots are never exceeded, no pool is
    over-committed, every item's tokens have KV slots. Returns (passes, scheduler)."""
    split = {t: kv_blocks // len(tiers) + (i < kv_blocks % len(tiers)) for i, t in enumerate(tiers)}
    blocks = BlockManager(BLOCK, split, num_residual=max_running)
    config = SchedulerConfig(max_running=max_running, num_micro_batches=1, prefill_budget=budget,
                             mode=mode, kv_admission=admission, defer_decodes_with_slack=defer)
    scheduler = Scheduler(config, blocks)
    for seq in seqs:
        scheduler.add(seq)
    passes = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        items = [item for mb in plan.micro_batches for item in mb]
        assert items, "a pass with nothing to do"
        passes += 1
        if mode == "decode-maximal":
            assert plan.num_prefill_tokens <= budget
        assert len(scheduler.running) <= max_running
        check_pool(blocks, scheduler.running)
        for item in items:
            assert item.seq in scheduler.running
            assert len(item.seq.block_table) * BLOCK >= item.end
        simulated_postprocess(scheduler, plan)
    assert blocks.num_free == blocks.num_blocks  # everything given back
    return passes, scheduler


def pass_bound(seqs, budget, num_tiers: int) -> int:
    """The oldest running sequence is never preempted while others run and is in every pass, so
    it finishes within its own prefill and decode passes; requests are served one after another
    at worst. With several tiers, a sequence left alone whose table ends in a spent tier (faster
    ones free) restarts, readmitted fastest tier first; it has crossed a block boundary since its
    last restart, so at most once per block of its life."""
    def restarts(s):
        return 0 if num_tiers == 1 else math.ceil(s.max_len / BLOCK)
    return sum((1 + restarts(s)) * math.ceil(s.max_len / budget) + s.max_len - s.num_prompt_tokens
               for s in seqs)


def test_a_tiny_pool_forces_preemption_and_every_sequence_gets_its_tokens():
    # 6 sequences of 8 + 24 tokens, KV for 12 blocks (48 tokens): each prompt fits, lifetimes do not.
    requests = [(8, 24, 24)] * 6
    seqs = make_stopping_seqs(requests)
    expected = [expected_tokens(s) for s in make_stopping_seqs(requests)]
    _, scheduler = run_checked(seqs, budget=8, max_running=6, kv_blocks=12)
    assert scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    assert any(s.num_preemptions for s in seqs)


def test_reservation_never_preempts_and_runs_fewer_at_once():
    requests = [(8, 24, 3)] * 6  # early stops: on demand runs more of them at once
    reserve_seqs, demand_seqs = make_stopping_seqs(requests), make_stopping_seqs(requests)
    reserve_passes, reserve = run_checked(reserve_seqs, budget=16, max_running=6, kv_blocks=16,
                                          admission="reserve")
    demand_passes, demand = run_checked(demand_seqs, budget=16, max_running=6, kv_blocks=16)
    assert reserve.num_preemptions == 0
    assert [s.output_token_ids for s in reserve_seqs] == [s.output_token_ids for s in demand_seqs]
    assert demand_passes < reserve_passes


def test_preempted_sequence_goes_back_to_the_head_of_the_queue():
    seqs = make_stopping_seqs([(4, 12, 12)] * 3)
    blocks = BlockManager(BLOCK, {"cpu": 6}, num_residual=3)
    scheduler = Scheduler(SchedulerConfig(max_running=3, num_micro_batches=1, prefill_budget=12,
                                          defer_decodes_with_slack=False), blocks)
    for seq in seqs:
        scheduler.add(seq)
    while not seqs[2].num_preemptions:
        simulated_postprocess(scheduler, scheduler.schedule())
    assert scheduler.waiting[0] is seqs[2]  # the latest admitted, first in line again
    assert seqs[2].block_table == [] and seqs[2].num_computed == 0
    assert seqs[2].num_prefill_tokens == seqs[2].num_tokens  # prompt + outputs so far, recomputed


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 14), st.integers(1, 14), st.integers(0, 16)), min_size=1, max_size=8),
       st.integers(1, 16), st.integers(1, 6), st.integers(0, 12), st.sampled_from(["on-demand", "reserve"]),
       st.sampled_from([("cpu",), ("gpu", "cpu"), ("gpu", "cpu", "disk")]), st.booleans())
def test_no_starvation_and_exact_tokens_over_random_workloads(requests, budget, max_running, spare,
                                                              admission, tiers, defer):
    """Any workload, any pool from 'the longest request alone' up: every request finishes with
    exactly its tokens, within the pass bound, with every per-pass invariant held."""
    seqs = make_stopping_seqs(requests)
    expected = [expected_tokens(s) for s in make_stopping_seqs(requests)]
    kv_blocks = max(math.ceil(s.max_len / BLOCK) for s in seqs) + spare
    passes, _ = run_checked(seqs, budget=budget, max_running=max_running, kv_blocks=kv_blocks,
                            admission=admission, tiers=tiers, defer=defer)
    assert [s.output_token_ids for s in seqs] == expected
    assert passes <= pass_bound(seqs, budget, len(tiers))


def test_block_schedule_reserves_lifetimes_and_keeps_lockstep():
    seqs = make_stopping_seqs([(4, 8, 8), (4, 8, 2), (4, 8, 8), (4, 8, 8)])
    passes, scheduler = run_checked(seqs, budget=4, max_running=2, kv_blocks=6, mode="block")
    assert scheduler.num_preemptions == 0
    # Blocks of 2: the first block lasts as long as its longer member (1 prefill + 7 decodes).
    assert passes == 2 * 8
    assert [s.output_token_ids for s in seqs] == [expected_tokens(s) for s in make_stopping_seqs(
        [(4, 8, 8), (4, 8, 2), (4, 8, 8), (4, 8, 8)])]


@pytest.mark.parametrize(("prompt_lens", "max_tokens", "max_running", "budget", "multiple", "defer"), [
    ([100, 100, 100, 100], [30, 30, 30, 30], 4, 40, 16, False),  # 1-3 decode rows beside the chunks
    ([90, 50, 120, 70, 60], [12, 40, 9, 25, 30], 2, 37, 8, True),  # queued requests: no decode defers
    ([64, 64, 64, 64, 64, 64], [20] * 6, 6, 130, 128, False),  # the GPU's multiple
])
def test_token_multiple_rounds_each_pass_with_its_decode_rows(prompt_lens, max_tokens, max_running, budget,
                                                              multiple, defer):
    """The rule (scheduler.py): a pass's prompt budget is cut so that the pass, decode rows and
    prompt tokens together, is a multiple of token_multiple, where the budget is larger than that
    cut. So with D decode rows a pass carries at most R - D prompt tokens, R the largest multiple
    <= D + budget (the whole budget where R <= D), and exactly that many when the budget ended it
    (its last prompt chunk's sequence is still prefilling after it). Every pass is checked; the
    workloads have such passes whose decode rows move the cut (D not a multiple)."""
    seqs = make_seqs(prompt_lens, max_tokens)
    blocks = BlockManager(BLOCK, {"cpu": sum(math.ceil(s.max_len / BLOCK) for s in seqs) + 2},
                          num_residual=max_running)
    scheduler = Scheduler(SchedulerConfig(max_running=max_running, num_micro_batches=1, prefill_budget=budget,
                                          token_multiple=multiple, defer_decodes_with_slack=defer), blocks)
    for seq in seqs:
        scheduler.add(seq)
    cut_by_decodes = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        num_prompt = plan.num_prefill_tokens
        num_decodes = plan.num_tokens - num_prompt
        rounded = (num_decodes + budget) // multiple * multiple
        allowed = rounded - num_decodes if rounded > num_decodes else budget
        assert num_prompt <= allowed, (num_decodes, num_prompt, allowed)
        prefilling = [it.seq for it in plan.items if it.seq.is_prefilling]
        sampling = [it.seq for it in plan.items if it.samples]
        scheduler.postprocess(plan, sampling, [TOKEN] * len(sampling))
        if prefilling and prefilling[-1].is_prefilling:  # the budget, not the prompts, ended the pass
            assert num_prompt == allowed, (num_decodes, num_prompt, allowed)
            assert plan.num_tokens % multiple == 0 or allowed == budget
            cut_by_decodes += num_decodes % multiple != 0
    assert cut_by_decodes >= 2
    assert [s.output_token_ids for s in seqs] == [[TOKEN] * m for m in max_tokens]


def test_a_request_larger_than_the_cache_is_refused_at_once():
    blocks = BlockManager(BLOCK, {"cpu": 3}, num_residual=1)
    scheduler = Scheduler(SchedulerConfig(max_running=1, num_micro_batches=1, prefill_budget=8), blocks)
    with pytest.raises(RuntimeError, match="needs 4 KV blocks"):
        scheduler.add(make_seqs([8], [8])[0])


# ---- on a real model: preemption and recompute against running each request alone -------------
def _engine_run(llm, prompts, params):
    """LLM.generate's loop, reading the engine's scheduler's preemption count."""
    engine = llm.engine
    seqs = [engine.make_sequence(p, sp) for p, sp in zip(prompts, params)]
    before = engine.scheduler.num_preemptions
    engine.add_requests([[seq] for seq in seqs])
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs], engine.scheduler.num_preemptions - before


@pytest.mark.parametrize("kind,compress_kv", [("opt", False), ("llama_gqa_untied", False), ("opt", True)])
def test_preemption_and_recompute_equal_each_request_alone(tiny_checkpoint, kind, compress_kv):
    """A KV cache of 40 tokens for 6 running requests of up to 32: preemption is forced; KV split
    over two tiers, so tables cross tiers and are regrown after recompute. Greedy, seeded
    sampling, and early stops at a token of each request's own uninterrupted output."""
    from flexsarathi import LLM
    from policy_search.policy import Policy

    folder, _ = tiny_checkpoint(kind)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (int(n),), generator=gen).tolist() for n in [12, 5, 9, 3, 11, 7]]
    alone = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=1, prefill_budget=64, compress_kv=compress_kv),
                kv_block_size=4)
    params = []
    for i, prompt in enumerate(prompts):
        sp = (SamplingParams(max_tokens=20, temperature=0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True))
        if i % 3 == 1:  # stop at the token this request samples 8th when run alone
            free = alone.generate([prompt], sp, use_tqdm=False)[0].token_ids
            sp = SamplingParams(max_tokens=20, temperature=sp.temperature, seed=sp.seed,
                                stop_token_ids=[free[7]], ignore_eos=True)
        params.append(sp)
    expected = [alone.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    tight = Policy(gpu_batch_size=6, prefill_budget=8, compress_kv=compress_kv, kv_cache_tokens=40,
                   kv_gpu=0.5, kv_cpu=0.5)
    got, preemptions = _engine_run(LLM(folder, dtype="float32", policy=tight, kv_block_size=4), prompts, params)
    assert preemptions > 0
    assert got == expected
    reserved, none = _engine_run(LLM(folder, dtype="float32", policy=tight.replace(kv_admission="reserve"), kv_block_size=4),
                                 prompts, params)
    assert none == 0 and reserved == expected


def test_a_request_longer_than_the_kv_capacity_is_refused(tiny_checkpoint):
    from flexsarathi import LLM
    from flexsarathi.errors import FlexSarathiError
    from policy_search.policy import Policy

    folder, _ = tiny_checkpoint("opt")
    llm = LLM(folder, dtype="float32", policy=Policy(kv_cache_tokens=16), kv_block_size=4)
    with pytest.raises(FlexSarathiError, match="request 1 needs 20 tokens of KV cache"):
        llm.generate([[1, 2], [1, 2, 3, 4]], SamplingParams(max_tokens=16), use_tqdm=False)


def test_set_schedule_switches_schedulers_on_one_engine(tiny_checkpoint):
    """Both schedules on one engine (as scripts/bench_schedule.py runs them) give the tokens of
    each request run alone; placement fields cannot be changed this way."""
    from flexsarathi import LLM
    from flexsarathi.errors import FlexSarathiError
    from policy_search.policy import Policy

    folder, _ = tiny_checkpoint("opt")
    prompts = [[3, 4, 5, 6], [7] * 11, [9, 8], [1, 2, 3, 4, 5, 6, 7]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 3, 14, 6)]
    alone = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=1, prefill_budget=64))
    expected = [alone.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    llm = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=6))
    for scheduler, admission in (("block", "reserve"), ("decode-maximal", "on-demand"),
                                 ("decode-maximal", "reserve")):
        llm.engine.set_schedule(scheduler=scheduler, kv_admission=admission)
        assert _engine_run(llm, prompts, params)[0] == expected
    with pytest.raises(FlexSarathiError, match="set_schedule changes only"):
        llm.engine.set_schedule(w_disk=1.0)
