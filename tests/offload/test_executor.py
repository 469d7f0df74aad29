"""offload/executor.py: the shortcut for prompt chunks whose context is all new (attend the new
rows directly, no gather, no patch) gives exactly what gathering the pool's slots and patching gives,
with the KV cache split across tiers (chunks whose keys straddle tiers take it for one part only)."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from offload.executor import FUSED, GENERAL, PassExecutor
from offload.kv_cache import gathered_plain_decodes
from policy_search import Policy
from tests.prompt_logits import prompt_logits

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _run(folder, tmp_path, shortcut: bool, monkeypatch):
    taken = []
    original = PassExecutor._reads_new_rows

    def reads_new_rows(self, part):
        use = original(self, part) and shortcut
        taken.append(use)
        return use

    monkeypatch.setattr(PassExecutor, "_reads_new_rows", reads_new_rows)
    policy = Policy(gpu_batch_size=3, num_gpu_batches=1, prefill_budget=9, kv_gpu=0.5, kv_cpu=0.5)
    llm = LLM(folder, policy=policy, offload_dir=str(tmp_path / "offload"), kv_block_size=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (5, 17, 9, 2)]
    tokens = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    logits = prompt_logits(llm, prompts)
    llm.close()
    return tokens, logits, sum(taken)


@pytest.mark.parametrize("model", ["opt", "llama_gqa_untied"])
def test_new_rows_shortcut_equals_gather_and_patch(tiny_checkpoint, tmp_path, monkeypatch, model):
    folder = tiny_checkpoint(model)[0]
    tokens, logits, used = _run(folder, tmp_path / "a", True, monkeypatch)
    ref_tokens, ref_logits, unused = _run(folder, tmp_path / "b", False, monkeypatch)
    assert used > 0 and unused == 0
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def _decode_logits(folder, lengths, fused: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Every decode pass's logits of an all-resident engine, and how many groups took the one fused
    call decided for the pass (executor.FUSED); fused False: none may (their parts go the GENERAL way)."""
    original_kind, original_run = PassExecutor._attend_kind, PassExecutor.run
    decided, logits = [], []

    def attend_kind(self, group, part, written):
        kind = original_kind(self, group, part, written)
        decided.append(kind is FUSED and fused)
        return kind if fused or kind is not FUSED else GENERAL

    def run(self, micro_batches):
        out = original_run(self, micro_batches)
        if all(g.is_decode for mb in micro_batches for g in mb.groups):
            logits.extend(out)
        return out

    policy = Policy(gpu_batch_size=4, num_gpu_batches=1, scheduler="block")
    # the GPU's route on the CPU: contexts gathered from the pool (the CPU's own attends in it)
    with monkeypatch.context() as patch, LLM(folder, policy=policy, kv_block_size=4) as llm, gathered_plain_decodes():
        patch.setattr(PassExecutor, "_attend_kind", attend_kind)
        patch.setattr(PassExecutor, "run", run)
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    return logits, sum(decided)


@pytest.mark.parametrize("lengths", [(9, 9, 9, 9), (5, 17, 9, 2)], ids=["one-group", "groups"])
@pytest.mark.parametrize("model", ["opt", "llama_gqa_untied"])
def test_the_fused_decode_groups_give_the_general_routes_logits(tiny_checkpoint, monkeypatch, model, lengths):
    """An all-resident decode micro-batch's groups take the route decided once per pass (store, gather
    from the pool, one fused call with the pass's mask per group); the general route (the part
    attended through `_attend`) gives the same logits, bit for bit: prompts of one length (one group
    of every row: views) and of four (a group each at first: rows gathered and scattered back)."""
    folder = tiny_checkpoint(model)[0]
    logits, taken = _decode_logits(folder, lengths, True, monkeypatch)
    ref_logits, not_taken = _decode_logits(folder, lengths, False, monkeypatch)
    assert taken >= len(logits) == 5 and not_taken == 0
    assert len(ref_logits) == len(logits)
    for got, ref in zip(logits, ref_logits):
        assert torch.equal(got, ref)
