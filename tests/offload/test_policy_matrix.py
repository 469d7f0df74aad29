"""Every placement, schedule and split gives the tokens (and logits, up to float rounding) of the
everything-on-the-compute-device run; gpu-tier memory stays within its budget."""
from __future__ import annotations

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from offload.memory import MemoryBudgetError
from offload.tiered_weights import LOADING
from policy_search import Policy
from policy_search.hardware import HardwareSpec
from tests.prompt_logits import prompt_logits

BASE = dict(gpu_batch_size=2, num_gpu_batches=1, prefill_budget=6)
CASES = {
    "weights_cpu": dict(w_gpu=0.0, w_cpu=1.0),
    "weights_disk": dict(w_gpu=0.0, w_disk=1.0),
    "weights_30_40_30": dict(w_gpu=0.3, w_cpu=0.4, w_disk=0.3),
    "kv_cpu": dict(kv_gpu=0.0, kv_cpu=1.0),
    "kv_cpu_cpu_attention": dict(kv_gpu=0.0, kv_cpu=1.0, cpu_attention=True),
    "kv_disk": dict(kv_gpu=0.0, kv_disk=1.0),
    "kv_split_cpu_attention": dict(kv_gpu=0.3, kv_cpu=0.4, kv_disk=0.3, cpu_attention=True),
    "kv_split": dict(kv_gpu=0.5, kv_cpu=0.5),
    "act_cpu": dict(act_gpu=0.0, act_cpu=1.0),
    "act_split_disk": dict(act_gpu=0.2, act_cpu=0.4, act_disk=0.4),
    "overlap_off": dict(overlap=False, w_gpu=0.5, w_cpu=0.5, kv_gpu=0.5, kv_cpu=0.5),
    "two_micro_batches": dict(num_gpu_batches=2),
    "three_micro_batches_offloaded": dict(num_gpu_batches=3, w_gpu=0.2, w_cpu=0.4, w_disk=0.4,
                                          kv_gpu=0.0, kv_cpu=1.0, cpu_attention=True),
    "block_schedule": dict(scheduler="block", num_gpu_batches=2, w_gpu=0.5, w_cpu=0.5),
    "everything_off_gpu": dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5, kv_gpu=0.0, kv_cpu=0.5, kv_disk=0.5,
                               act_gpu=0.0, act_cpu=0.5, act_disk=0.5, cpu_attention=True,
                               num_gpu_batches=2),
}
COMPRESSED_CASES = ["weights_30_40_30", "kv_split_cpu_attention", "everything_off_gpu", "overlap_off"]
# gemma3 (sliding layers, window 5, among full ones: each layer attends within its own window): the
# cases whose attention routes differ (pool tiers, the CPU's decode attention, micro-batches, schedules)
WINDOWED_CASES = ["weights_disk", "kv_cpu_cpu_attention", "kv_disk", "kv_split_cpu_attention", "act_split_disk",
                  "three_micro_batches_offloaded", "block_schedule", "everything_off_gpu"]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (3, 13, 7, 20, 5)]


def _run(folder: str, policy: Policy, prompts, tmp_path, **kwargs):
    # Small KV blocks: sequences straddle tiers often (and K compression groups 8 tokens). The exact
    # 4-bit product: the int8 kernel's choice follows a call's row count, so other micro-batch
    # shapes would mix in its rounding (its placements: tests/flexsarathi/engine/test_engine_cpu_matmul.py).
    llm = LLM(folder, dtype="float32", policy=policy, offload_dir=str(tmp_path / "offload"), kv_block_size=8,
              cpu_matmul="dequantize", **kwargs)
    outputs = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    logits = prompt_logits(llm, prompts[:3])
    return outputs, logits, llm


@pytest.fixture(scope="module")
def references(tiny_checkpoint, stories_dir_or_none, tmp_path_factory):
    """Per model and compression: the everything-on-the-compute-device run."""
    cache = {}

    def get(model: str, compressed: bool):
        key = (model, compressed)
        if key not in cache:
            folder = stories_dir_or_none if model == "stories260K" else tiny_checkpoint(model)[0]
            if folder is None:
                pytest.skip("stories260K is absent")
            policy = Policy(**BASE, compress_weight=compressed, compress_kv=compressed)
            vocab = 512 if model == "stories260K" else 128
            prompts = _prompts(vocab)
            outputs, logits, llm = _run(folder, policy, prompts, tmp_path_factory.mktemp("ref"))
            cache[key] = (folder, prompts, outputs, logits, _weight_bytes_on_gpu(llm))
        return cache[key]

    return get


@pytest.fixture(scope="module")
def stories_dir_or_none():
    from tests.conftest import STORIES

    return str(STORIES) if (STORIES / "model.safetensors").is_file() else None


def _weight_bytes_on_gpu(llm) -> int:
    uses = llm.engine.memory.in_use_by_what("gpu")
    return sum(n for what, n in uses.items() if "weight" in what or "embeddings" in what)


def _check(references, model, compressed, changes, tmp_path):
    folder, prompts, ref_outputs, ref_logits, ref_weight_bytes = references(model, compressed)
    policy = Policy(**{**BASE, **changes, "compress_weight": compressed, "compress_kv": compressed})
    outputs, logits, llm = _run(folder, policy, prompts, tmp_path)
    assert outputs == ref_outputs
    # Different micro-batch shapes round matmuls differently (~1e-6); with compression such a
    # difference can move a value across a rounding boundary of its 4-bit code, one step of its
    # group, which moves the logits by ~1e-4. Tokens must still be identical.
    atol = 1e-3 if compressed else 2e-5
    for got, ref in zip(logits, ref_logits):
        torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    memory = llm.engine.memory
    assert 0 < memory.peak("gpu")
    if policy.w_gpu < 1:  # streamed weights: the gpu tier holds less than the whole model
        assert _weight_bytes_on_gpu(llm) < ref_weight_bytes
    # on a GPU, disk-tier weights come up through pinned staging buffers held on the cpu tier
    staged = policy.w_disk if llm.engine.device.type == "cuda" else 0
    for tier in ("cpu", "disk"):
        uses = {"cpu": policy.w_cpu + policy.kv_cpu + staged, "disk": policy.w_disk + policy.kv_disk}[tier]
        held = {what: n for what, n in memory.peak_by_what(tier).items() if what != LOADING}  # not the load's own
        assert (sum(held.values()) > 0) == (uses > 0), held


@pytest.mark.parametrize("model", ["opt_deep", "llama_deep", "stories260K"])
@pytest.mark.parametrize("case", list(CASES))
def test_placement_gives_reference_tokens(references, model, case, tmp_path):
    _check(references, model, False, CASES[case], tmp_path)


@pytest.mark.parametrize("model", ["opt_deep", "llama_deep", "stories260K"])
@pytest.mark.parametrize("case", COMPRESSED_CASES)
def test_compressed_placement_gives_compressed_reference_tokens(references, model, case, tmp_path):
    _check(references, model, True, CASES[case], tmp_path)


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("case", WINDOWED_CASES)
def test_placement_of_a_model_with_sliding_and_full_layers_gives_reference_tokens(references, case, compressed,
                                                                                   tmp_path):
    _check(references, "gemma3_deep", compressed, CASES[case], tmp_path)


def test_gpu_budget_is_enforced_before_any_work(references, tmp_path):
    folder, prompts, ref_outputs, _, ref_weight_bytes = references("llama_deep", False)
    budget = int(ref_weight_bytes * 0.9)  # below the weights; room for the working set (policy_search/working_set.py)
    hardware = HardwareSpec.preset("t4").with_memory(gpu=budget / 0.8)
    assert hardware.budgets()["gpu"] == pytest.approx(budget, abs=1)
    with pytest.raises(MemoryBudgetError, match="gpu"):
        LLM(folder, dtype="float32", policy=Policy(**BASE), hardware=hardware, offload_dir=str(tmp_path)) \
            .generate(prompts, PARAMS, use_tqdm=False)
    offloaded = Policy(**BASE, w_gpu=0.0, w_cpu=1.0)
    llm = LLM(folder, dtype="float32", policy=offloaded, hardware=hardware, offload_dir=str(tmp_path))
    outputs = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert outputs == ref_outputs
    assert llm.engine.memory.peak("gpu") <= budget


def test_auto_policy_runs_the_searched_placement(references, tmp_path):
    from flexsarathi.engine.planner_spec import planner_model_spec
    from policy_search import Workload, search

    folder, prompts, ref_outputs, _, ref_weight_bytes = references("opt_deep", False)
    hardware = HardwareSpec.preset("t4").with_memory(gpu=ref_weight_bytes * 8, cpu=1 << 30)
    workload = Workload(prompt_len=12, gen_len=6)
    llm = LLM(folder, dtype="float32", policy="auto", hardware=hardware, offload_dir=str(tmp_path), workload=workload)
    # the model as the engine runs it here (its dtype, the tiers its decodes attend in the pool)
    expected, est = search(planner_model_spec(folder, "float32", device="cpu"), hardware, workload)
    assert llm.engine.policy == expected and est.fits
    outputs = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    if not (expected.compress_weight or expected.compress_kv):
        assert outputs == ref_outputs
    assert llm.engine.memory.peak("gpu") <= hardware.budgets()["gpu"]


def test_a_pass_too_large_for_the_gpu_budget_fails_before_any_work(references, tmp_path):
    from offload.memory import MemoryBudgetError

    folder, prompts, _, _, ref_weight_bytes = references("llama_deep", False)
    kv_on_cpu = Policy(**BASE, kv_gpu=0.0, kv_cpu=1.0)
    llm = LLM(folder, policy=kv_on_cpu, offload_dir=str(tmp_path))
    fixed = llm.engine.memory.in_use("gpu")  # weights and embeddings
    hardware = HardwareSpec.preset("t4").with_memory(gpu=(fixed + 1024) / 0.8)  # no room to compute
    llm = LLM(folder, policy=kv_on_cpu, offload_dir=str(tmp_path), hardware=hardware)
    with pytest.raises(MemoryBudgetError, match="largest pass"):
        llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.last_stats["passes"] == 0 and llm.last_stats["generated_tokens"] == 0  # not a single pass ran


def test_offload_folder_faults_are_clear_and_the_next_run_recovers(tiny_checkpoint, tmp_path, monkeypatch):
    import errno
    import shutil as shutil_module

    from flexsarathi import FlexSarathiError
    from offload.disk_store import OffloadError

    folder, _ = tiny_checkpoint("opt_deep")
    on_disk = Policy(**BASE, w_gpu=0.0, w_disk=1.0)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises((FlexSarathiError, OffloadError), match="a_file"):
        LLM(folder, policy=on_disk, offload_dir=str(blocker / "offload"))
    offload = tmp_path / "offload"
    real_usage = shutil_module.disk_usage
    monkeypatch.setattr(shutil_module, "disk_usage",
                        lambda path: real_usage(path)._replace(free=1024))  # a full disk
    with pytest.raises(OffloadError, match="free"):
        LLM(folder, policy=on_disk, offload_dir=str(offload))
    assert not list(offload.rglob("manifest.json"))  # nothing a later run could trust
    monkeypatch.setattr(shutil_module, "disk_usage", real_usage)
    prompts = [[5, 6, 7, 8]]
    llm = LLM(folder, dtype="float32", policy=on_disk, offload_dir=str(offload))  # recovers: writes the store
    assert llm.generate(prompts, PARAMS, use_tqdm=False)[0].token_ids == \
        LLM(folder, dtype="float32", policy=Policy(**BASE)).generate(prompts, PARAMS, use_tqdm=False)[0].token_ids
    assert len(list(offload.rglob("manifest.json"))) == 1


@pytest.mark.parametrize("scheduler,gpu_share", [("decode-maximal", 8), ("block", 16), ("decode-maximal", 64)])
def test_searched_policy_passes_the_engines_largest_pass_check(references, tmp_path, scheduler, gpu_share):
    """policy="auto" under GPU budgets of 8 to 64 times the weights (splits, then many sequences): the searched
    placement fits the engine's fail-early check for the largest pass the batch can form (the
    planner prices that pass, not only the run's average passes: issue 27 saw a searched opt-6.7b
    policy refused by 71.7 MiB on t4 caps), runs the workload's full batch within the budget and,
    uncompressed, gives the all-on-device tokens."""
    from policy_search import Workload

    folder, _, _, _, ref_weight_bytes = references("llama_deep", False)
    hardware = HardwareSpec.preset("t4").with_memory(gpu=ref_weight_bytes * gpu_share / 0.8, cpu=1 << 30)
    workload = Workload(prompt_len=24, gen_len=8)
    policy = LLM.search_policy(folder, hardware, workload, "float32", scheduler=scheduler)  # policy="auto"'s
    llm = LLM(folder, dtype="float32", policy=policy, hardware=hardware, offload_dir=str(tmp_path))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (24,), generator=gen).tolist() for _ in range(policy.max_running)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.memory.peak("gpu") <= hardware.budgets()["gpu"]
    if not (policy.compress_weight or policy.compress_kv):
        reference = LLM(folder, dtype="float32", policy=Policy(gpu_batch_size=policy.max_running), offload_dir=str(tmp_path / "ref"))
        assert outputs == [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("model", ["stories260K", "gemma3_deep"])  # gemma3: the masks of each layer's window
@pytest.mark.parametrize("placement,compress_kv", [("kv_cpu_cpu_attention", True), ("kv_cpu_cpu_attention", False),
                                                   ("kv_split_cpu_attention", False), (None, False)])
def test_decode_attention_in_the_pool_gives_the_gather_routes_tokens(references, model, placement, compress_kv,
                                                                      tmp_path, monkeypatch):
    """Decode rows attended in the pool on the CPU (KVPool.attend_decode: from a 4-bit pool's codes,
    from a plain pool's slots in place, the compute device's own pool included) give the greedy
    tokens of gathering the context, then attending it."""
    from offload.kv_cache import KVPool, gathered_decodes  # noqa: PLC0415

    folder, prompts, _, _, _ = references(model, True)
    policy = Policy(**{**BASE, **(CASES[placement] if placement else {}), "compress_kv": compress_kv})
    calls = []
    attend_decode = KVPool.attend_decode
    monkeypatch.setattr(KVPool, "attend_decode", lambda self, *a: calls.append(1) or attend_decode(self, *a))
    from_codes, logits, _ = _run(folder, policy, prompts, tmp_path / "codes")
    assert calls, "no decode row was attended in the pool"
    in_pool = len(calls)
    with gathered_decodes():  # every decode gathers its context, then attends it
        gathered, gathered_logits, _ = _run(folder, policy, prompts, tmp_path / "gathered")
    assert len(calls) == in_pool  # none attended in the pool
    assert from_codes == gathered
    for got, ref in zip(logits, gathered_logits):  # prompt logits: no decode row in them
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
