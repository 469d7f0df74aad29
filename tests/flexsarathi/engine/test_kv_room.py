"""A KV cache larger than the machine can give, with no hardware= budget to catch it: one
MemoryBudgetError before the pool is allocated, naming the tier, the bytes it needs and the room
there is (what the memory can allocate now, or the offload folder's free disk), not torch's
"can't allocate memory" or an OOM kill as the pool's pages are touched."""
from __future__ import annotations

import shutil

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from offload.free_memory import free_bytes
from offload.kv_cache import KVPool
from offload.memory import MemoryBudgetError
from policy_search import Policy

TOKENS = 2**31 - 1  # the most Policy.kv_cache_tokens takes; hundreds of GB of KV for this model


@pytest.mark.parametrize("tier", ["gpu", "cpu", "disk"], ids=["compute-tier", "cpu", "disk"])  # "gpu": the marker
def test_a_kv_cache_beyond_the_machine_is_one_clear_error(tiny_checkpoint, tmp_path, tier):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    fractions = {f"kv_{t}": float(t == tier) for t in ("gpu", "cpu", "disk")}
    policy = Policy(gpu_batch_size=2, kv_cache_tokens=TOKENS, overlap=False, **fractions)
    with LLM(folder, dtype="float32", device="cpu", policy=policy, offload_dir=str(tmp_path)) as llm:
        c = llm.engine.config
        slots = TOKENS // llm.engine.block_size * llm.engine.block_size
        need = KVPool.nbytes_for(c.num_layers, slots, c.num_kv_heads, c.head_dim, torch.float32, None)
        room = shutil.disk_usage(tmp_path).free if tier == "disk" else free_bytes(torch.device("cpu"))
        assert need > 2 * room  # the case: far beyond this machine
        for _ in range(2):  # refused before anything is allocated, the same again
            with pytest.raises(MemoryBudgetError) as err:
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)
            message = str(err.value)
            assert f"the {tier} tier's KV cache" in message and "kv_cache_tokens" in message
            assert err.value.requested == need and err.value.tier == tier
            assert 0.5 * room < err.value.capacity < 2 * room  # the room there is now
        assert not llm.engine.kv_pools
