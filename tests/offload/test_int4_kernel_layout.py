"""4-bit weights at rest in the CPU int4 kernel's layout (bf16 on the CPU): placed over gpu / cpu /
disk they give exactly the tokens and logits of the same format all on the compute device; their
row pieces fall on 64-row blocks; a store in another layout is rebuilt, never misread."""
from __future__ import annotations

import shutil

import pytest
import torch

import quant.cpu_matmul
from flexsarathi import LLM, SamplingParams
from offload.disk_store import DiskStore
from offload.weights import RowSplit
from policy_search import Policy
from quant import cpu_int8_matmul
from quant.cpu_matmul import BLOCK_ROWS, layout_matches_torch
from tests.prompt_logits import prompt_logits

pytestmark = pytest.mark.skipif(not layout_matches_torch(),
                                reason="torch's CPU int4 layout differs from ours on this CPU (not AVX-512)")

BASE = dict(gpu_batch_size=2, num_gpu_batches=1, prefill_budget=6, compress_weight=True)
PLACEMENTS = {
    "weights_cpu": dict(w_gpu=0.0, w_cpu=1.0),
    "weights_disk": dict(w_gpu=0.0, w_disk=1.0),
    "weights_30_40_30": dict(w_gpu=0.3, w_cpu=0.4, w_disk=0.3),
    "overlap_off_split": dict(overlap=False, w_gpu=0.2, w_cpu=0.3, w_disk=0.5),
}
# Greedy, 6 tokens, 5 prompts: with prefill budget 6 the prompts are chunked, so passes carry 1-6
# rows (the kernel); the long prompt's one-pass prefill below carries more than the kernel's limit.
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (3, 13, 7, 20, 5)]


def _run(folder, policy, offload_dir, prompts=None):
    # the CPU int4 kernel is the CPU compute path's: named, since a GPU machine's default is CUDA;
    # cpu_matmul="dequantize": on a VNNI CPU the int8 modes keep weights row-major for the int8 kernel
    llm = LLM(folder, dtype="bfloat16", device="cpu", policy=policy, offload_dir=str(offload_dir), kv_block_size=8,
              cpu_matmul="dequantize")
    prompts = prompts or _prompts()
    tokens = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    return tokens, prompt_logits(llm, prompts[:3]), llm


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory):
    cache = {}

    def get(model: str):
        if model not in cache:
            folder = tiny_checkpoint(model)[0]
            tokens, logits, llm = _run(folder, Policy(**BASE), tmp_path_factory.mktemp("ref"))
            cache[model] = folder, tokens, logits, _formats(llm)
        return cache[model]

    return get


def _formats(llm) -> set[str]:
    """The types of the layer's 2-D weights as the model gets them."""
    weights = llm.engine.weights
    layer = weights.get(0)
    weights.release(0)
    return {type(w).__name__ for w in layer.values() if not (isinstance(w, torch.Tensor) and w.dim() < 2)}


@pytest.mark.parametrize("model,case", [("opt_blocks64", case) for case in PLACEMENTS]
                         + [("llama_blocks64", "weights_30_40_30")])
def test_placed_kernel_layout_gives_the_all_on_device_tokens(reference, model, case, tmp_path):
    folder, ref_tokens, ref_logits, ref_formats = reference(model)
    assert ref_formats == {"Int4Packed"}  # every large weight is in the kernel's layout
    tokens, logits, llm = _run(folder, Policy(**BASE, **PLACEMENTS[case]), tmp_path)
    assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits):  # the same bits multiplied the same way
        assert torch.equal(got, ref)
    plan = llm.engine.weights.plan
    assert all(p.kernel_layout for p in plan.tensors)
    for p in plan.tensors:  # pieces on whole blocks, and the tiers charged exactly their rows' bytes
        assert all(piece.row_start % BLOCK_ROWS == 0 for piece in p.pieces)
    memory = llm.engine.memory.in_use_by_what("cpu")
    assert memory.get("weights (cpu tier)", 0) == sum(p.bytes_on("cpu") for p in plan.tensors) * plan.num_layers


def test_prefill_rows_above_the_kernel_limit_take_the_dequantize_path_and_agree(reference, tmp_path):
    from policy_search.quant_format import CPU_INT4_KERNEL_MAX_ROWS

    folder, *_ = reference("opt_blocks64")
    long_prompt = [torch.randint(3, 128, (CPU_INT4_KERNEL_MAX_ROWS + 20,),
                                 generator=torch.Generator().manual_seed(3)).tolist()]
    whole = dict(BASE, prefill_budget=CPU_INT4_KERNEL_MAX_ROWS + 20)
    ref = _run(folder, Policy(**whole), tmp_path / "a", long_prompt)
    placed = _run(folder, Policy(**whole, w_gpu=0.0, w_cpu=0.5, w_disk=0.5), tmp_path / "b", long_prompt)
    assert placed[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(placed[1], ref[1]))


def _manifest_tensor_names(offload_dir) -> set[str]:
    import json

    names = set()
    for manifest in offload_dir.rglob("manifest.json"):
        names |= set(json.loads(manifest.read_text())["tensors"])
    return names


def test_a_store_in_another_layout_is_rebuilt_not_misread(reference, tmp_path, monkeypatch):
    """A row-major 4-bit store (written where the kernel's layout is not ours, emulated by telling
    the engine so) put where this machine's kernel-layout store belongs: rebuilt, then the tokens
    are the kernel layout's all-on-device ones."""
    folder, ref_tokens, ref_logits, _ = reference("opt_blocks64")
    on_disk = Policy(**BASE, w_gpu=0.0, w_disk=1.0)
    with monkeypatch.context() as patched:
        patched.setattr(quant.cpu_matmul, "layout_matches_torch", lambda: False)
        row_major_tokens, _, old = _run(folder, on_disk, tmp_path / "old")
        assert _formats(old) == {"QTensor"}
        old_store = old.engine.weights.store
    assert any(n.endswith(".data") for n in _manifest_tensor_names(tmp_path / "old"))
    # The kernel-layout engine's store folder, filled with the row-major store's files.
    probe = LLM(folder, dtype="bfloat16", device="cpu", policy=on_disk, offload_dir=str(tmp_path / "probe"),
                kv_block_size=8, cpu_matmul="dequantize")
    new_store: DiskStore = probe.engine.weights.store
    assert new_store.key != old_store.key
    target = tmp_path / "new" / new_store.path.name
    shutil.copytree(old_store.path, target)
    tokens, logits, llm = _run(folder, on_disk, tmp_path / "new")
    assert tokens == ref_tokens and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert _formats(llm) == {"Int4Packed"}
    names = _manifest_tensor_names(tmp_path / "new")
    assert any(n.endswith(".packed") for n in names) and not any(n.endswith(".data") for n in names)
    assert row_major_tokens  # the row-major engine ran (its tokens differ in rounding, not compared)


KERNEL_SHAPES = {"qkv": (384, 128), "o": (128, 128), "fc1": (512, 128), "fc2": (128, 512), "odd": (100, 128),
                 "norm": (128,)}


@pytest.mark.parametrize("fractions", [(0.3, 0.4, 0.3), (0.0, 0.5, 0.5), (0.77, 0.0, 0.23), (0.05, 0.05, 0.9)])
def test_plan_cuts_kernel_layout_weights_on_blocks_and_keeps_each_tiers_fraction(fractions):
    from offload.placement import TIERS, plan_layer
    from quant import QuantConfig

    quant = QuantConfig(bits=4, group_size=64)
    plans = {p.name: p for p in plan_layer(KERNEL_SHAPES, torch.bfloat16, quant, fractions, torch.device("cpu"))}
    assert {n for n, p in plans.items() if p.kernel_layout} == {"qkv", "o", "fc1", "fc2"}  # 100 rows: not whole blocks
    total = sum(p.shape[0] * p.row_bytes for p in plans.values())
    for p in plans.values():
        unit = BLOCK_ROWS if p.kernel_layout else 1
        assert all(piece.row_start % unit == 0 for piece in p.pieces)
        # the stored bytes are those of our own 4-bit format: codes + 4 bytes per group
        assert p.row_bytes == p.shape[1] // 2 + 4 * p.shape[1] // 64
    widest_block = max(p.row_bytes * (BLOCK_ROWS if p.kernel_layout else 1) for p in plans.values())
    for tier, fraction in zip(TIERS, fractions):  # each cut rounds to the nearest block: half a block
        assert abs(sum(p.bytes_on(tier) for p in plans.values()) - fraction * total) <= widest_block


@pytest.mark.parametrize("dtype,device,group_size", [(torch.float32, "cpu", 64), (torch.bfloat16, "meta", 64),
                                                     (torch.bfloat16, "cpu", 16)])
def test_kernel_layout_only_for_bf16_on_the_cpu_with_a_group_it_takes(dtype, device, group_size):
    from offload.placement import plan_layer, weight_layout_tag
    from quant import QuantConfig

    quant = QuantConfig(bits=4, group_size=group_size)
    assert not any(p.kernel_layout for p in plan_layer(KERNEL_SHAPES, dtype, quant, (1, 0, 0), torch.device(device)))
    assert weight_layout_tag(dtype, torch.device(device), quant) == "rowmajor"
    assert weight_layout_tag(torch.bfloat16, torch.device("cpu"), QuantConfig(bits=4, group_size=64)) != "rowmajor"


def test_pack_store_read_round_trip_is_exact_on_every_tier(tmp_path):
    """Each layer's weights, placed 30/40/30 and read back through the working buffers (a second
    engine reusing the store), are byte for byte the packing of the source weights."""
    from offload.memory import MemoryTracker
    from offload.tiered_weights import TieredWeights
    from quant import QuantConfig, quantize
    from quant.cpu_matmul import Int4Packed, pack_for_cpu_kernel

    shapes = {k: v for k, v in KERNEL_SHAPES.items() if k != "odd"}
    quant = QuantConfig(bits=4, group_size=64)

    def layer(i):
        g = torch.Generator().manual_seed(100 + i)
        return {name: torch.randn(shape, generator=g).bfloat16() for name, shape in shapes.items()}

    for attempt in range(2):  # the first writes the store, the second reads it
        weights = TieredWeights(
            num_layers=2, layer_shapes=shapes, read_globals=lambda: {}, read_layer=layer,
            fractions=(0.3, 0.4, 0.3), device=torch.device("cpu"), dtype=torch.bfloat16, quant=quant,
            tracker=MemoryTracker(), overlap=attempt == 0,
            disk_store=lambda: DiskStore(tmp_path, "round-trip", direct_io=True))
        for i in range(2):
            got = weights.get(i)
            for name, source in layer(i).items():
                if source.dim() != 2:
                    continue
                expected = pack_for_cpu_kernel(quantize(source, quant))
                # a weight cut by the gpu tier comes as its gpu rows and its streamed rows (RowSplit)
                parts = got[name].parts if isinstance(got[name], RowSplit) else (got[name],)
                assert all(isinstance(part, Int4Packed) for part in parts)
                assert torch.equal(torch.cat([part.packed for part in parts]), expected.packed)
                assert torch.equal(torch.cat([part.scales_zeros for part in parts]).view(torch.int16),
                                   expected.scales_zeros.view(torch.int16))
            weights.release(i)
        weights.close()


@pytest.mark.skipif(not cpu_int8_matmul.available() or cpu_int8_matmul.KERNEL.isa_name() not in ("avx512_vnni", "avx_vnni"),
                    reason="needs the int8 kernel on a VNNI path (this CPU lacks avx512_vnni and avx_vnni)")
def test_on_a_vnni_cpu_the_int8_modes_keep_weights_row_major(tiny_checkpoint, tmp_path):
    """Where the int8 kernel runs a VNNI path it beats torch's int4 kernel (llm_engine.int8_kernel_preferred):
    cpu_matmul int8 / int8x2 keep bf16 4-bit weights row-major (QTensors the int8 kernel multiplies, in a
    store of another key), dequantize keeps the int4 layout."""
    folder = tiny_checkpoint("llama_blocks64")[0]
    keys = {}
    for mode, kind in (("int8", "QTensor"), ("int8x2", "QTensor"), ("dequantize", "Int4Packed")):
        with LLM(folder, dtype="bfloat16", device="cpu", policy=Policy(**BASE, w_gpu=0.0, w_disk=1.0),
                 offload_dir=str(tmp_path), kv_block_size=8, cpu_matmul=mode) as llm:
            assert _formats(llm) == {kind}
            assert not any(p.kernel_layout for p in llm.engine.weights.plan.tensors) or kind == "Int4Packed"
            keys[mode] = llm.engine.weights.store.key
    assert keys["int8"] == keys["int8x2"] != keys["dequantize"]
