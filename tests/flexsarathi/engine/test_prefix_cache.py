"""Automatic prefix caching: the block manager's bookkeeping counted by hand, and the engine's
tokens with it equal to those without it, on every placement, on stories260K."""
from __future__ import annotations

import hashlib
from array import array

import pytest
import torch

from flexsarathi import LLM, FlexSarathiError, SamplingParams
from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.prefix_cache import block_digests
from flexsarathi.engine.sequence import Sequence
from policy_search import Policy
from tests.conftest import on_call, raise_keyboard_interrupt

BS = 4


def seq(seq_id: int, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=max_tokens), max_len=len(tokens) + max_tokens,
                    stop_ids=frozenset(), generator=torch.Generator())


def computed(blocks: BlockManager, s: Sequence, tokens: int | None = None) -> None:
    """`s` admitted (its cached blocks taken) and its first `tokens` (default: all) computed."""
    cached = blocks.cached_prefix(s, blocks.blocks_for(s.num_tokens))
    blocks.allocate(s, s.num_tokens, cached)
    s.num_computed = s.num_tokens if tokens is None else tokens
    blocks.register(s)


# ---- digests and the block manager --------------------------------------------------------------
def test_a_blocks_digest_names_every_token_up_to_its_end():
    a = seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    by_hand, previous = [], b""
    for k in range(2):
        previous = hashlib.sha256(previous + array("q", a.prompt_token_ids[k * BS:(k + 1) * BS]).tobytes()).digest()
        by_hand.append(previous)
    assert block_digests(a, 2, BS) == by_hand
    same_second_block = seq(1, [0, 2, 3, 4, 5, 6, 7, 8])  # block 1's tokens alike, block 0's not
    assert block_digests(same_second_block, 2, BS)[1] != by_hand[1]
    assert block_digests(seq(2, [1, 2, 3, 4, 5, 6, 7, 8]), 2, BS) == by_hand


def test_an_admission_takes_the_registered_blocks_of_its_leading_tokens_but_the_last_tokens():
    blocks = BlockManager(BS, {"cpu": 12}, num_residual=4, prefix_caching=True)
    a = seq(0, list(range(10)))
    computed(blocks, a)  # blocks 0 and 1 complete: registered; the third holds 2 tokens
    b = seq(1, list(range(9)) + [99, 98, 97])  # 9 leading tokens alike: 2 complete blocks
    assert blocks.cached_prefix(b, 3) == a.block_table[:2]
    c = seq(2, list(range(8)))  # its 8 tokens fill two of a's blocks, but a pass computes its last
    assert blocks.cached_prefix(c, 2) == a.block_table[:1]
    d = seq(3, list(range(3, 12)))
    assert blocks.cached_prefix(d, 3) == []
    blocks.allocate(b, b.num_tokens, blocks.cached_prefix(b, 3))
    assert b.block_table[:2] == a.block_table[:2] and b.num_registered_blocks == 2
    assert [blocks.refs[x] for x in b.block_table] == [2, 2, 1]
    assert blocks.num_free == 12 - 3 - 1
    blocks.free_blocks(a)  # shared blocks stay held by b
    assert [blocks.refs[x] for x in b.block_table] == [1, 1, 1] and blocks.num_free == 12 - 3


def test_free_blocks_go_out_empty_first_then_a_tables_tail_before_its_head():
    blocks = BlockManager(BS, {"cpu": 6}, num_residual=2, prefix_caching=True)
    a = seq(0, list(range(12)))
    computed(blocks, a)
    head, middle, tail = a.block_table
    blocks.free_blocks(a)
    filler = seq(1, [50] * 12)
    blocks.allocate(filler, 12)  # the three blocks no one registered go first
    assert not set(filler.block_table) & {head, middle, tail}
    blocks.free_blocks(filler)  # unregistered: still handed out before a's
    other = seq(2, [60] * 16)
    blocks.allocate(other, 16)
    assert tail in other.block_table and head not in other.block_table and middle not in other.block_table
    blocks.free_blocks(other)
    again = seq(3, list(range(12)) + [1])
    assert blocks.cached_prefix(again, 4) == [head, middle]  # its tail is gone, the chain before stays


def test_a_preempted_sequence_finds_its_own_blocks_outputs_included():
    blocks = BlockManager(BS, {"cpu": 8}, num_residual=2, prefix_caching=True)
    a = seq(0, [7, 8, 9, 10, 11], max_tokens=8)
    computed(blocks, a)
    for token in (1, 2, 3, 4):  # decodes fill its second block with outputs
        a.append(token)
        blocks.grow(a, a.num_tokens)
        a.num_computed += 1
        blocks.register(a)
    table = list(a.block_table)
    assert a.num_registered_blocks == 2
    blocks.free_blocks(a)
    a.preempt()  # recomputes 9 tokens: two complete blocks, then the rest
    assert blocks.cached_prefix(a, blocks.blocks_for(a.num_prefill_tokens)) == table[:2]


def test_a_cached_run_stays_in_tier_order_and_leaves_its_rest_room_to_grow():
    blocks = BlockManager(BS, {"gpu": 2, "cpu": 2}, num_residual=3, prefix_caching=True)
    holder = seq(0, [1] * 8)
    blocks.allocate(holder, 8)  # both gpu blocks
    a = seq(1, list(range(8)))
    computed(blocks, a)  # both cpu blocks, registered
    cpu_blocks = list(a.block_table)
    blocks.free_blocks(a)
    blocks.free_blocks(holder)
    assert blocks.num_free == 4 and [blocks.tier_of(x) for x in cpu_blocks] == ["cpu", "cpu"]
    # 11 + 1 tokens: after its 2 cached cpu blocks the 3rd must come from cpu or slower, and there is
    # none; after 1 the other 2 neither: the run is cut to nothing and it starts in gpu as any does
    b = seq(2, list(range(8)) + [5, 5, 5], max_tokens=1)
    assert blocks.cached_prefix(b, 3) == []
    blocks.allocate(b, 12, [])
    assert [blocks.tier_of(x) for x in b.block_table] == ["gpu", "gpu", "cpu"]
    blocks.free_blocks(b)
    # 8 tokens in all: 1 cached cpu block and 1 more in cpu
    e = seq(4, [0, 1, 2, 3, 99], max_tokens=3)
    assert blocks.cached_prefix(e, 2) == cpu_blocks[:1]
    blocks.allocate(e, e.max_len, blocks.cached_prefix(e, 2))
    assert e.block_table[0] == cpu_blocks[0] and [blocks.tier_of(x) for x in e.block_table] == ["cpu", "cpu"]
    # a faster tier after a slower one ends a run
    blocks = BlockManager(BS, {"gpu": 2, "cpu": 4}, num_residual=2, prefix_caching=True)
    f = seq(5, list(range(9)))
    first, second = block_digests(f, 2, BS)
    blocks.cache.register(blocks.base["cpu"], first)
    blocks.cache.register(blocks.base["gpu"], second)
    assert blocks.cached_prefix(f, 3) == [blocks.base["cpu"]]


def test_a_table_short_of_its_blocks_is_an_error_not_lost_kv():
    blocks = BlockManager(BS, {"gpu": 1, "cpu": 1}, num_residual=2)
    a = seq(0, [1] * 4)
    blocks.allocate(a, 4)
    with pytest.raises(RuntimeError, match="ran out"):
        blocks._extend([blocks.base["cpu"]], 3, ("cpu",))


def test_a_new_layout_keeps_the_cached_blocks_of_kept_pools_it_still_has():
    blocks = BlockManager(BS, {"gpu": 2, "cpu": 4}, num_residual=2, prefix_caching=True)
    holder = seq(0, [1] * 8)
    blocks.allocate(holder, 8)  # the gpu blocks: a's go to cpu
    computed(blocks, a := seq(1, list(range(9))))
    locals_ = [b - blocks.base["cpu"] for b in a.block_table[:2]]
    blocks.free_blocks(a)
    blocks.free_blocks(holder)
    probe = seq(2, list(range(9)))
    blocks.resize({"gpu": 3, "cpu": 4}, 2, kept=("gpu", "cpu"))  # cpu's blocks renumbered, its slots kept
    assert blocks.cached_prefix(probe, 3) == [blocks.base["cpu"] + i for i in locals_]
    assert locals_ == [0, 1]
    blocks.resize({"gpu": 3, "cpu": 1, "disk": 4}, 2, kept=("gpu", "cpu"))  # the second one is gone
    assert blocks.cached_prefix(probe, 3) == [blocks.base["cpu"]] and len(blocks.cache) == 1
    blocks.resize({"gpu": 3, "cpu": 4}, 2, kept=("gpu",))  # cpu's pool made anew: nothing it held is there
    assert len(blocks.cache) == 0
    computed(blocks, a := seq(1, list(range(9))))
    blocks.release_all()
    assert len(blocks.cache) == 0 and blocks.num_free == 7


# ---- the engine on stories260K ------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared_prefix_prompts(tinystories_text):
    stories = [s.strip() for s in tinystories_text.split("<|endoftext|>") if s.strip()]
    system = stories[0][:300]  # ~80 tokens every prompt starts with
    return [system + " " + s[:80] for s in stories[1:7]]


def run(stories_dir, prompts, params, tmp_path=None, caching=True, **policy):
    llm = LLM(stories_dir, dtype="float32", policy=Policy(**{"gpu_batch_size": 1, "prefill_budget": 64, **policy}),
              enable_prefix_caching=caching, offload_dir=str(tmp_path) if tmp_path else None)
    with llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return outs, llm.last_stats


def test_one_request_at_a_time_each_finds_the_shared_prefix_and_the_tokens_are_unchanged(
        stories_dir, shared_prefix_prompts):
    params = SamplingParams(max_tokens=12, temperature=0)
    without, _ = run(stories_dir, shared_prefix_prompts, params, caching=False)
    outs, stats = run(stories_dir, shared_prefix_prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in without]
    assert all(o.num_cached_tokens == 0 for o in without)
    ids = [o.prompt_token_ids for o in outs]
    expected = expected_hits(ids)
    assert [o.num_cached_tokens for o in outs] == expected and expected[1] >= 64
    assert stats["prefix_cache_hit_tokens"] == sum(expected)
    assert stats["prefill_tokens_computed"] == sum(map(len, ids)) - sum(expected)


def expected_hits(ids: list[list[int]]) -> list[int]:
    """Each prompt's longest common prefix with any earlier prompt, in whole 16-token blocks, short of its
    last token (a pass computes that one for its logits)."""
    expected = [0]
    for k in range(1, len(ids)):
        common = max(next((i for i, (x, y) in enumerate(zip(ids[k], ids[j])) if x != y), min(len(ids[k]), len(ids[j])))
                     for j in range(k))
        expected.append(min(common, len(ids[k]) - 1) // 16 * 16)
    return expected


def test_requests_admitted_together_compute_a_shared_prefix_once(stories_dir, shared_prefix_prompts):
    """Every request fits the first pass (running set and budget), all starting with the same ~80
    tokens: the first computes them, the others wait that one pass for its blocks (not all computing
    the prefix side by side) and take them from the cache; the tokens are those without the cache."""
    params = SamplingParams(max_tokens=12, temperature=0)
    roomy = dict(gpu_batch_size=len(shared_prefix_prompts), prefill_budget=2048)
    without, _ = run(stories_dir, shared_prefix_prompts, params, caching=False, **roomy)
    outs, stats = run(stories_dir, shared_prefix_prompts, params, **roomy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in without]
    expected = expected_hits([o.prompt_token_ids for o in outs])
    assert [o.num_cached_tokens for o in outs] == expected and min(expected[1:]) >= 64
    assert stats["prefix_cache_hit_tokens"] == sum(expected)


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(stories_dir, shared_prefix_prompts):
    """vLLM's cache_salt (a prompt dict's key): four prompts sharing their start, one at a time, salted
    "a", "a", "b" and not at all: only the second finds blocks (the first's); the tokens are those
    without the cache. A salt that is no string is refused by name."""
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = shared_prefix_prompts[:4]
    salted = [{"prompt": p, "cache_salt": salt} if salt else {"prompt": p}
              for p, salt in zip(prompts, ["a", "a", "b", None])]
    without, _ = run(stories_dir, prompts, params, caching=False)
    outs, _ = run(stories_dir, salted, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in without]
    ids = [o.prompt_token_ids for o in outs]
    assert [o.num_cached_tokens for o in outs] == [0, expected_hits(ids[:2])[1], 0, 0]
    assert outs[1].num_cached_tokens >= 64
    with LLM(stories_dir, dtype="float32") as llm, pytest.raises(FlexSarathiError, match="cache_salt"):
        llm.generate([{"prompt": prompts[0], "cache_salt": 7}], params, use_tqdm=False)


PLACEMENTS = {
    "kv_cpu": dict(kv_gpu=0.0, kv_cpu=1.0),
    "kv_split_disk": dict(kv_gpu=0.3, kv_cpu=0.3, kv_disk=0.4),
    "cpu_attention": dict(kv_gpu=0.0, kv_cpu=1.0, cpu_attention=True, w_gpu=0.5, w_cpu=0.5),
    "compressed_kv": dict(compress_kv=True, kv_gpu=0.5, kv_cpu=0.5),
    "micro_batches": dict(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=24),
    "block": dict(gpu_batch_size=2, scheduler="block", kv_admission="reserve"),
    "tight_cache": dict(gpu_batch_size=4, prefill_budget=32, kv_cache_tokens=384, kv_gpu=0.5, kv_cpu=0.5),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_placement_with_the_cache_gives_the_all_on_device_tokens(
        stories_dir, shared_prefix_prompts, tmp_path, placement):
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    compress_kv = PLACEMENTS[placement].get("compress_kv", False)  # the reference's KV format alike
    reference, _ = run(stories_dir, shared_prefix_prompts, params, caching=False, compress_kv=compress_kv)
    outs, stats = run(stories_dir, shared_prefix_prompts, params, tmp_path, **PLACEMENTS[placement])
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert stats["prefix_cache_hit_tokens"] > 0


def test_prompt_logprobs_are_computed_not_cached(stories_dir, shared_prefix_prompts):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    without, _ = run(stories_dir, shared_prefix_prompts[:3], params, caching=False)
    outs, stats = run(stories_dir, shared_prefix_prompts[:3], params)
    assert stats["prefix_cache_hit_tokens"] == 0 and all(o.num_cached_tokens == 0 for o in outs)
    for got, want in zip(outs, without):
        assert [None if s is None else {t: lp.logprob for t, lp in s.items()} for s in got.prompt_logprobs] == \
               [None if s is None else {t: lp.logprob for t, lp in s.items()} for s in want.prompt_logprobs]


def test_the_cache_outlives_a_batch(stories_dir, shared_prefix_prompts):
    prompts = shared_prefix_prompts[:3]
    params = SamplingParams(max_tokens=8, temperature=0)
    reference, _ = run(stories_dir, prompts, params, caching=False)
    roomy = Policy(gpu_batch_size=1, prefill_budget=64, kv_cache_tokens=2048)
    with LLM(stories_dir, dtype="float32", policy=roomy) as llm:
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # room for all: every prompt is found whole
    assert [o.num_cached_tokens for o in again] == [(len(o.prompt_token_ids) - 1) // 16 * 16 for o in again]
    for outs in (first, again):
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


def test_new_pools_or_an_interrupted_pass_leave_nothing_cached(stories_dir, shared_prefix_prompts):
    prompts = shared_prefix_prompts[:3]
    params, longer = SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=40, temperature=0)
    reference, _ = run(stories_dir, prompts, longer, caching=False)
    with LLM(stories_dir, dtype="float32", policy=Policy(gpu_batch_size=1, prefill_budget=64)) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # pools sized to these lives
        assert len(llm.engine.blocks.cache) > 0
        grown = llm.generate(prompts, longer, use_tqdm=False)  # longer lives: larger pools, made anew
        assert grown[0].num_cached_tokens == 0
        shorter = llm.generate(prompts, params, use_tqdm=False)  # fewer blocks of the pools kept: found
        assert shorter[0].num_cached_tokens > 0
        with on_call(llm.engine.model, "post_attention", 3, raise_keyboard_interrupt), pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, longer, use_tqdm=False)
        assert len(llm.engine.blocks.cache) == 0  # nothing vouches for a pass cut short
        after = llm.generate(prompts, longer, use_tqdm=False)
        assert after[0].num_cached_tokens == 0
    for outs in (grown, after):
        assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert [o.token_ids for o in shorter] == [o.token_ids[:8] for o in reference]


def test_embeddings_with_the_cache_equal_those_without(stories_dir, shared_prefix_prompts):
    vectors = {}
    for caching in (False, True):
        with LLM(stories_dir, dtype="float32", task="embed", enable_prefix_caching=caching,
                 policy=Policy(gpu_batch_size=1, prefill_budget=64)) as llm:
            vectors[caching] = torch.tensor([o.outputs.embedding for o in llm.embed(shared_prefix_prompts)])
            hits = llm.last_stats["prefix_cache_hit_tokens"]
    assert hits > 0
    torch.testing.assert_close(vectors[True], vectors[False], rtol=1e-5, atol=1e-6)


def test_a_cached_run_that_would_leave_its_life_no_room_alone_is_not_taken():
    """On demand a prompt's blocks fit now, but its later tokens must grow in the tiers after the
    cached run, and alone even those could not hold them: preempted, it would be readmitted onto the
    same run for ever. The run is not taken; the request starts fastest tier first and finishes."""
    from flexsarathi.engine.scheduler import Scheduler, SchedulerConfig

    blocks = BlockManager(BS, {"gpu": 2, "cpu": 3}, num_residual=2, prefix_caching=True)
    holder = seq(0, [1] * 8)
    blocks.allocate(holder, 8)
    computed(blocks, a := seq(1, list(range(8))))  # two cpu blocks, registered
    blocks.free_blocks(a)
    blocks.free_blocks(holder)
    b = seq(2, list(range(8)) + [9], max_tokens=11)  # 9 prompt tokens (3 blocks now), 20 in its life (5)
    assert blocks.cached_prefix(b, blocks.blocks_for(b.num_prompt_tokens)) == []
    scheduler = Scheduler(SchedulerConfig(max_running=1, num_micro_batches=1, prefill_budget=8), blocks)
    scheduler.add(b)
    for _ in range(100):  # 20 tokens: a few prefill passes and 11 decodes
        plan = scheduler.schedule()
        sampling = [it.seq for it in plan.items if it.samples]
        scheduler.postprocess(plan, sampling, [5] * len(sampling))
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished() and scheduler.num_preemptions == 0
