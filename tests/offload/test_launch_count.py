"""Kernel launches per decode layer-step of the GPU code path, counted on the CPU (the launch
counter: flexsarathi/machine/launch_counter.py; the same figure and the host time beside a plain
PyTorch layer: scripts/count_launches.py). An all-on-GPU decode pass is bound by host time per
launch (docs/DESIGN.md, "Decode passes on a GPU"); FlexGen's OPT layer issues about 19, a plain
PyTorch layer 11 (fused qkv, one KV write, SDPA)."""
from __future__ import annotations

import json

import pytest

from flexsarathi import LLM, SamplingParams
from flexsarathi.machine.launch_counter import LaunchCounter
from offload.executor import PassExecutor
from offload.kv_cache import gathered_plain_decodes
from policy_search import Policy
from tests.triton_interpreter import needs_triton, run_interpreted

# OPT: LayerNorm, qkv, the K/V pair written, the context gathered, SDPA, o_proj, residual, LayerNorm,
# fc1, ReLU, fc2, residual. LLaMA-family layers add RMSNorm's scale, RoPE on q and k at once (in place:
# K stays beside V, one pair written) and SwiGLU; the first layer of a pass also makes the pass's RoPE
# tables (two layers here: 28 and 21; a steady layer took 30 with RoPE out of place and RMSNorm's casts).
MOST = {"opt": 12, "llama_gqa_untied": 24.5}


def decode_launches(folder: str, graphs: bool = False, device: str = "cpu") -> tuple[float, list]:
    """(launches per decode layer-step, each step's operators) of two equal-length prompts."""
    counts, steps = [], []
    run_layer = PassExecutor._run_layer

    def counted(self, layer, batches, start):
        if not all(g.is_decode for mb in batches for g in mb.groups):
            return run_layer(self, layer, batches, start)
        with LaunchCounter() as counter:
            result = run_layer(self, layer, batches, start)
        counts.append(counter.launches)
        steps.append([op[0] for op in counter.ops])
        return result

    policy = Policy(gpu_batch_size=2, overlap=False, scheduler="block")
    with LLM(folder, dtype="float16", device=device, policy=policy, cuda_graphs=graphs) as llm, \
            gathered_plain_decodes():  # the GPU's decode attention on the CPU too
        PassExecutor._run_layer = counted
        try:
            llm.generate([[5, 6, 7, 8], [9, 10, 11, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                         use_tqdm=False)
        finally:
            PassExecutor._run_layer = run_layer
    assert counts, "no decode pass ran"
    return sum(counts) / len(counts), steps


@pytest.mark.parametrize("kind", sorted(MOST))
def test_decode_layer_step_launches(tiny_checkpoint, kind):
    folder, _ = tiny_checkpoint(kind)
    launches, steps = decode_launches(folder)
    assert launches <= MOST[kind], steps[0]


def test_opt_decode_layer_step_is_the_lean_sequence(tiny_checkpoint):
    """The exact operators, in order: an extra copy or mask rebuilt per layer shows up here by name."""
    folder, _ = tiny_checkpoint("opt")
    _, steps = decode_launches(folder)
    assert steps[0] == ["layer_norm", "linear", "index_copy_", "index_select", "scaled_dot_product_attention",
                        "linear", "add", "layer_norm", "linear", "relu_", "linear", "add"]


def test_llama_decode_layer_step_is_the_lean_sequence(tiny_checkpoint):
    """A LLaMA layer after the pass's first (which makes the RoPE tables), operator by operator."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    _, steps = decode_launches(folder)
    assert steps[1] == ["rms_norm", "mul", "linear", "mul", "mul", "mul_", "sub_", "mul_", "add_", "index_copy_",
                        "index_select", "scaled_dot_product_attention", "linear", "add", "rms_norm", "mul", "linear",
                        "silu", "mul_", "linear", "add_"]


def prompt_launches(folder: str, prompts: int, compress_kv: bool = False) -> list[int]:
    """Launches of each prompt layer-step of a block prefill of `prompts` 8-token prompts."""
    counts, run_layer = [], PassExecutor._run_layer

    def counted(self, layer, batches, start):
        if all(g.is_decode for mb in batches for g in mb.groups):
            return run_layer(self, layer, batches, start)
        with LaunchCounter() as counter:
            result = run_layer(self, layer, batches, start)
        counts.append(counter.launches)
        return result

    policy = Policy(gpu_batch_size=prompts, overlap=False, scheduler="block", compress_kv=compress_kv)
    with LLM(folder, dtype="float16", device="cpu", policy=policy) as llm:
        PassExecutor._run_layer = counted
        try:
            llm.generate([[5 + i] * 8 for i in range(prompts)], SamplingParams(max_tokens=1, ignore_eos=True),
                         use_tqdm=False)
        finally:
            PassExecutor._run_layer = run_layer
    return counts


@pytest.mark.parametrize("compress_kv", [False, True])
@pytest.mark.parametrize("kind", sorted(MOST))
def test_a_prompt_layer_step_launches_as_many_kernels_for_16_prompts_as_for_2(tiny_checkpoint, kind, compress_kv):
    """Whole prompts of one length attend in one causal call, or one masked call per block of a
    compressed cache (PassExecutor.one_causal_call): a prompt layer-step's launches do not grow with
    its prompts (72 prompts of a small OPT: 1459 launches per layer-step, 36 ms of host time on a
    GPU; 10602 over a 4-bit cache)."""
    folder, _ = tiny_checkpoint(kind)
    two, sixteen = prompt_launches(folder, 2, compress_kv), prompt_launches(folder, 16, compress_kv)
    assert two and sixteen == two


def test_a_compressed_decode_quantizes_its_new_v_once(tiny_checkpoint, monkeypatch):
    """Over a 4-bit KV cache the new V rows are quantized once per layer-step, for the attention (as
    they read back) and for the store alike (PassExecutor._v_read_back): each took its own quantize,
    ~50 launches on a GPU (a decode layer-step 135 -> 98 launches)."""
    from offload import kv_cache

    folder, _ = tiny_checkpoint("opt")
    quantized, real = [], kv_cache.quantize

    def counted(x, config, **kwargs):
        quantized.append(config)
        return real(x, config, **kwargs)

    monkeypatch.setattr(kv_cache, "quantize", counted)
    layer_steps, run_layer = [], PassExecutor._run_layer

    def counted_layer(self, layer, batches, start):
        decode = all(g.is_decode for mb in batches for g in mb.groups)
        quantized.clear()
        result = run_layer(self, layer, batches, start)
        if decode:
            layer_steps.append([c for c in quantized if c == self.kv_pools["gpu"].v_config])
        return result

    policy = Policy(gpu_batch_size=2, overlap=False, scheduler="block", compress_kv=True)
    monkeypatch.setattr(PassExecutor, "_run_layer", counted_layer)
    with LLM(folder, dtype="float16", device="cpu", policy=policy) as llm:
        llm.generate([[5, 6, 7, 8], [9, 10, 11, 12]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert layer_steps and all(len(v_quantized) == 1 for v_quantized in layer_steps), layer_steps


@needs_triton
def test_a_compressed_decode_layer_step_is_two_triton_kernels_and_the_layer(tiny_checkpoint):
    """Over a 4-bit KV cache a GPU quantizes the new V rows straight into their pool slots in one
    Triton launch and attends the codes in another (quant/triton_quantize.py,
    quant/triton_kv_attention.py); here the same route runs in Triton's interpreter
    (triton_decodes_on_cpu), each kernel counted as one launch. The exact operators (81 launches per
    layer-step on the gather route; 12 now), and a pass's first layer-step also makes the pool's
    non-finite flag (one zeros per pass)."""
    folder, _ = tiny_checkpoint("opt")
    script = f"""
        import json
        from flexsarathi import LLM, SamplingParams
        from flexsarathi.machine.launch_counter import LaunchCounter, counting_triton_launches
        from offload.executor import PassExecutor
        from offload.kv_cache import triton_decodes_on_cpu
        from policy_search import Policy
        from quant import triton_kv_attention, triton_quantize

        steps, run_layer = [], PassExecutor._run_layer

        def counted(self, layer, batches, start):
            if not all(g.is_decode for mb in batches for g in mb.groups):
                return run_layer(self, layer, batches, start)
            with LaunchCounter() as counter:
                result = run_layer(self, layer, batches, start)
            steps.append((layer, [op[0] for op in counter.ops]))
            return result

        policy = Policy(gpu_batch_size=2, overlap=False, scheduler="block", compress_kv=True)
        with LLM({folder!r}, dtype="float16", device="cpu", policy=policy) as llm, triton_decodes_on_cpu(), \\
                counting_triton_launches((triton_kv_attention, "_decode_kernel"), (triton_quantize, "_quantize_kernel")):
            PassExecutor._run_layer = counted
            llm.generate([[5, 6, 7, 8], [9, 10, 11, 12]], SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
        print(json.dumps(steps))
    """
    steps = json.loads(run_interpreted(script).strip().splitlines()[-1])
    layer = ["layer_norm", "linear", "_quantize_kernel", "_decode_kernel", "linear", "add", "layer_norm", "linear",
             "relu_", "linear", "add", "index_put_"]  # V went into the pool with its quantize; K's residual row
    assert len(steps) == 2 * 3  # 3 decode passes of the 2-layer OPT
    for index, ops in steps:
        assert ops == (layer if index else [*layer[:2], "zeros", *layer[2:]]), (index, ops)
