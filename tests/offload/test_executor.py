"""offload/executor.py: the shortcut for prompt chunks whose context is all new (attend the new
rows directly, no gather, no patch) gives exactly what gathering the pool's slots and patching gives,
with the KV cache split across tiers (chunks whose keys straddle tiers take it for one part only)."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from offload.executor import PassExecutor
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


def _decode_logits(folder, lengths, resident_step: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Every decode pass's logits of an all-resident engine, and how many micro-batches took the
    step decided for the pass (PassExecutor._resident_decode); resident_step False: none may."""
    original_decide, original_run = PassExecutor._resident_decode, PassExecutor.run
    decided, logits = [], []

    def decide(self, mb):
        plan = original_decide(self, mb) if resident_step else None
        decided.append(plan is not None)
        return plan

    def run(self, micro_batches):
        out = original_run(self, micro_batches)
        if all(g.is_decode for mb in micro_batches for g in mb.groups):
            logits.extend(out)
        return out

    policy = Policy(gpu_batch_size=4, num_gpu_batches=1, scheduler="block")
    # the GPU's route on the CPU: contexts gathered from the pool (the CPU's own attends in it)
    with monkeypatch.context() as patch, LLM(folder, policy=policy, kv_block_size=4) as llm, gathered_plain_decodes():
        patch.setattr(PassExecutor, "_resident_decode", decide)
        patch.setattr(PassExecutor, "run", run)
        gen = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in lengths]
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    return logits, sum(decided)


@pytest.mark.parametrize("lengths", [(9, 9, 9, 9), (5, 17, 9, 2)], ids=["one-group", "groups"])
@pytest.mark.parametrize("model", ["opt", "llama_gqa_untied"])
def test_the_resident_decode_step_gives_the_general_steps_logits(tiny_checkpoint, monkeypatch, model, lengths):
    """An all-resident decode micro-batch takes the step decided once per pass (store, gather from
    the pool, one masked attention call per group); the general step (its tests per layer-step)
    gives the same logits, bit for bit: prompts of one length (one group of every row: views) and
    of four (a group each at first: rows gathered and scattered back)."""
    folder = tiny_checkpoint(model)[0]
    logits, taken = _decode_logits(folder, lengths, True, monkeypatch)
    ref_logits, not_taken = _decode_logits(folder, lengths, False, monkeypatch)
    assert taken == len(logits) == 5 and not_taken == 0
    assert len(ref_logits) == len(logits)
    for got, ref in zip(logits, ref_logits):
        assert torch.equal(got, ref)
