"""offload/kv_plans.py: a compressed pool's store and gather indices, worked out once per pass.
The values they lead to (stored codes, gathered contexts) are held to the reference by
test_compressed_reference.py and every placement test over a 4-bit cache; here: the plans' own
index arithmetic, derived by hand, and that a pass makes them once, not once per layer."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from offload import kv_cache
from offload.executor import PassExecutor
from offload.kv_plans import plan_gather, plan_store, upload_packed
from policy_search import Policy

CPU = torch.device("cpu")


def _ints(t):
    return None if t is None else t.tolist()


def test_a_store_plan_splits_tokens_into_completed_blocks_and_open_rows():
    """Block size 4. Sequence A (residual row 0) stores slots 2, 3: slot 3 completes block 0 and
    slot 2 lies in it; sequence B (row 1) stores slot 7, completing block 1; sequence C (row 2)
    stores slot 8, the first of block 2, which stays open."""
    plan = plan_store(torch.tensor([2, 3, 7, 8]), torch.tensor([0, 0, 1, 2]), 4, CPU)
    assert _ints(plan.slots) == [2, 3, 7, 8]
    assert _ints(plan.done_blocks) == [0, 1] and _ints(plan.done_rows) == [0, 1]
    # tokens 0, 1 go into completed block 0 at offsets 2, 3; token 2 into block 1 at offset 3
    assert _ints(plan.into_block) == [0, 0, 1] and _ints(plan.into_offset) == [2, 3, 3]
    assert _ints(plan.from_row) == [0, 1, 2]
    assert _ints(plan.keep_rows) == [2] and _ints(plan.keep_offsets) == [0] and _ints(plan.keep_src) == [3]


def test_a_store_plan_that_completes_no_block_stores_every_row_as_it_is():
    plan = plan_store(torch.tensor([5, 9]), torch.tensor([3, 1]), 4, CPU)  # offsets 1 and 1
    assert plan.done_blocks is None and plan.into_block is None and plan.from_row is None
    assert _ints(plan.keep_rows) == [3, 1] and _ints(plan.keep_offsets) == [1, 1]
    assert plan.keep_src is None  # every row, in order: K is stored without an index


def test_a_gather_plan_reads_positions_past_the_complete_blocks_from_the_open_block():
    """Block size 4, contexts padded to 6 positions with slot 0: the first sequence (residual row 7)
    has one complete block, so positions 4, 5 read its open row at offsets 0, 1; the second (row 2,
    3 keys) has none, so every position reads its open row (the padding too: attention masks
    positions past kv_len)."""
    kv_slots = torch.tensor([[8, 9, 10, 11, 20, 21], [12, 13, 14, 0, 0, 0]])
    plan = plan_gather(kv_slots, torch.tensor([7, 2]), torch.tensor([4, 0]), 4, CPU, CPU)
    assert _ints(plan.blocks) == [[2, 5], [3, 0]]
    assert _ints(plan.slots) == kv_slots.reshape(-1).tolist()
    assert _ints(plan.open_seq) == [0, 0, 1, 1, 1, 1, 1, 1] and _ints(plan.open_pos) == [4, 5, 0, 1, 2, 3, 4, 5]
    assert _ints(plan.open_rows) == [7, 7, 2, 2, 2, 2, 2, 2]
    assert _ints(plan.open_offsets) == [0, 1, 0, 1, 2, 3, 0, 1]


def test_a_pass_makes_each_plan_once_and_its_layers_none(tiny_checkpoint, monkeypatch):
    """Every layer of a pass stores the same slots and gathers the same contexts: the executor
    makes one plan per write and part as the pass starts (on a GPU, one upload), and a layer makes
    none (each layer-step used to redo the index arithmetic: ~20 host operations, ~10 uploads)."""
    folder, _ = tiny_checkpoint("opt")
    made = {"in a layer": 0, "per pass": 0}
    in_layer = [False]
    for name in ("plan_store", "plan_gather"):
        real = getattr(kv_cache, name)

        def counted(*args, _real=real, **kwargs):
            made["in a layer" if in_layer[0] else "per pass"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(kv_cache, name, counted)
    run_layer, passes = PassExecutor._run_layer, []

    def flagged(self, layer, batches, start):
        in_layer[0] = True
        try:
            return run_layer(self, layer, batches, start)
        finally:
            in_layer[0] = False

    def counted_pass(self, micro_batches, _run=PassExecutor.run):
        passes.append(sum(len(mb.kv_writes) for mb in micro_batches))
        return _run(self, micro_batches)

    monkeypatch.setattr(PassExecutor, "_run_layer", flagged)
    monkeypatch.setattr(PassExecutor, "run", counted_pass)
    # decodes gather on the GPU path: fp16 has no in-pool CPU attention
    policy = Policy(gpu_batch_size=2, overlap=False, scheduler="block", compress_kv=True)
    with LLM(folder, dtype="float16", device="cpu", policy=policy) as llm:
        llm.generate([[5, 6, 7, 8], [9, 10, 11, 12]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert made["in a layer"] == 0
    assert made["per pass"] >= sum(passes) > 0  # a plan per write (and per gathered part) of each pass


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (one packed upload to a GPU)")
def test_a_packed_upload_gives_each_tensor_on_the_device():
    tensors = [torch.tensor([3, 1, 4]), torch.tensor([[1, 5], [9, 2]]), torch.tensor([], dtype=torch.long)]
    moved = upload_packed(tensors, torch.device("cuda"))
    assert [m.device.type for m in moved] == ["cuda"] * 3
    assert [m.cpu().tolist() for m in moved] == [t.tolist() for t in tensors]
