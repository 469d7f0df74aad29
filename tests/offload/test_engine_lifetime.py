"""An LLM dropped without close() is collected: nothing (an I/O or prefetch thread, a cycle the
collector cannot break) keeps its engine alive, so the weights' finalizer runs (on CUDA it waits
for the prefetch copies still in flight: tests/offload/test_cuda.py)."""
import gc
import weakref

import pytest

from flexsarathi import LLM, SamplingParams
from policy_search import Policy

STREAMED = Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=6, w_gpu=0.2, w_cpu=0.4, w_disk=0.4,
                  kv_gpu=0.5, kv_cpu=0.5, act_gpu=0.5, act_cpu=0.5)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_dropped_llm_is_collected_with_its_weights(tiny_checkpoint, tmp_path, overlap):
    folder = tiny_checkpoint("llama_deep")[0]
    llm = LLM(folder, dtype="float32", device="cpu", policy=STREAMED.replace(overlap=overlap),
              offload_dir=str(tmp_path))
    llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    for _, load in llm.engine.weights._pending.values():  # the next pass's first layers, prefetched:
        if load is not None:  # their loads hold the weights until they end (then nothing does)
            load.result()
    weights, engine = weakref.ref(llm.engine.weights), weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None and weights() is None
