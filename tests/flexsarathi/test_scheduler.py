"""The scheduler's decisions, pass by pass, on real sequences and block bookkeeping (no model: a
pass advances what the scheduler planned and samples a fixed token, as the engine's
post-processing does; the model's math under these schedules is tested in test_models.py)."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsarathi.block_manager import BlockManager
from flexsarathi.sampling import SamplingParams
from flexsarathi.scheduler import Scheduler, SchedulerConfig
from flexsarathi.sequence import Sequence

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
        items = [item for mb in plan.micro_batches for item in mb]
        assert items, "a pass with nothing to do"
        passes.append([(it.seq.seq_id, it.start, it.end, "prefill" if it.seq.is_prefilling else "decode")
                       for it in items])
        for item in items:
            item.seq.num_computed += item.num_tokens
        for item in items:
            if item.samples:
                item.seq.append(TOKEN)
                if item.seq.status.finished:
                    scheduler.finish(item.seq)
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
