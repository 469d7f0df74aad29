"""offload/executor.py: the shortcut for prompt chunks whose context is all new (attend the new
rows directly, no gather, no patch) gives exactly what gathering the pool's slots and patching gives,
with the KV cache split across tiers (chunks whose keys straddle tiers take it for one part only)."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from offload.executor import PassExecutor
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
