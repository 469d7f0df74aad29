"""Per-pass time of each resource and per-tier memory, as affine expressions in the placement fractions.

One pass runs every layer over its work items (DESIGN.md, "The pass"): while layer j computes, layer
j+1's weights stream in, and each micro-batch's KV cache and hidden states move between tiers. The
model follows FlexGen's (flexgen/cost_model.py) with these differences:
  * one formula for prefill, decode and mixed passes: they differ only in what they carry;
  * matmul time per micro-batch is max(compute at the prefill rate, decode rows at the decode rate,
    weight bytes / HBM bandwidth), so prompt chunks piggybacked on decodes are nearly free until the
    pass turns compute-bound, and tiny micro-batches pay for re-reading the weights;
  * attention is causal (half of FlexGen's s^2), decode attention on the CPU covers the KV fractions on
    CPU and disk, with grouped-query attention and 4-bit compression of weights and KV;
  * memory counts the stage with the largest intermediates, not the sum of all stages.

With overlap a pass lasts as long as its slowest chain (`time_terms`):
  load     disk -> host -> device: a disk-resident tensor crosses both links before use (off-GPU
           K/V also gathered on the host into one pinned buffer first: _kv_gather_seconds)
  store    device -> host -> disk
  compute  GPU + CPU: the pass loop runs a micro-batch's GPU work and its CPU attention in turn
  host     host->device copies + CPU attention: both stream host memory (FlexGen adds the weight
           copy to its decode time for the same reason: its fitted T4 runs show no overlap there)
Without overlap every resource waits for the others: the sum. Either way the engine's step outside
the pass (scheduling, micro-batches, sampling: HardwareSpec.step_overhead and sequence_overhead,
`_step_seconds`) adds to every chain: the next pass starts after it.

Without a GPU (`HardwareSpec.compute_on_host`: the compute device is the host CPU) the copies between
the cpu tier and the "gpu" tier's working buffers are memcpys run by the very cores that compute, so
the chains are: load = disk->host (the drive's DMA overlaps the cores), store = host->disk, and
compute = gpu + cpu + host->device + device->host. Disk-resident weights cost no memcpy there: the
engine's O_DIRECT reads land in the 4096-aligned working buffers themselves (offload/placement.py).

Embeddings, the final norm and the LM head stay on the compute device whatever the fractions, as the
engine keeps them (offload/placement.py): they never stream and count on the gpu tier.

Mixture of experts (ModelSpec.num_experts > 0). Every expert's bytes are stored and, by default,
streamed; FLOPs count each token's top-k experts only, and a micro-batch's matmuls read only the
experts its rows route to: the expected share is `ModelSpec.expert_touched_fraction(rows)`,
1 - (1 - k/E)^rows for uniform routing. Two policy choices:
  routed_expert_reads  cpu/disk-tier experts are read after the layer's router ran, only those the
                       pass's rows route to (touched fraction of the pass's tokens). Those reads
                       cannot start before the router, so they add a chain "routed": the layer's
                       compute before its experts, then the expert reads (the expert matmuls
                       overlap the reads, and the next layer's other weights load meanwhile).
  cpu_experts          the w_cpu part of every expert is computed on the CPU where it lives (its
                       touched experts streamed at HardwareSpec.cpu_read_bandwidth, the routed FLOPs
                       at cpu_matmul_flops), like cpu_attention: it is not copied to the device,
                       each micro-batch's rows go to the host and their outputs come back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from policy_search.hardware import HardwareSpec
from policy_search.linear import FRACTION_EXPRS as f, const
from policy_search.model_spec import ModelSpec
from policy_search.pass_shape import PassShape, RunShape
from policy_search.policy import TIERS, Policy
from policy_search.quant_format import CPU_INT4_KERNEL_MAX_ROWS, GPU_INT4_KERNEL_MAX_ROWS
from policy_search.working_set import POST_ATTENTION_ROWS, QUERY_BLOCK, SCORE_BYTES, PassTokens, working_set

RESOURCES = ("host->device", "device->host", "disk->host", "host->disk", "gpu", "cpu")
ROUTED = "routed"  # routed_expert_reads' chain: compute before the experts, then their reads (not a resource)
STEP = "step"  # the engine's host work outside the pass, serial with it: added to every chain (not a resource)


@dataclass(frozen=True)
class PassCost:
    shape: PassShape
    resources: dict[str, np.ndarray]  # seconds per pass, per resource
    memory: dict[str, np.ndarray]  # bytes per tier while this pass runs (homes + working buffers)
    on_host: bool = False  # the compute device is the host CPU (HardwareSpec.compute_on_host)


def time_terms(resources: dict[str, np.ndarray], overlap: bool,
               on_host: bool = False) -> dict[str, np.ndarray]:
    """Expressions whose maximum is the pass time (see the module docstring)."""
    r = resources
    step = r.get(STEP, 0.0)
    if not overlap:
        return {"serial": sum(r[name] for name in RESOURCES) + step}
    if on_host:
        chains = {
            "load": r["disk->host"],
            "store": r["host->disk"],
            "compute": r["gpu"] + r["cpu"] + r["host->device"] + r["device->host"],
        }
    else:
        chains = {
            "load": r["disk->host"] + r["host->device"],
            "store": r["device->host"] + r["host->disk"],
            "compute": r["gpu"] + r["cpu"],
            "host": r["host->device"] + r["cpu"],
        }
    if ROUTED in r:
        chains[ROUTED] = r[ROUTED]
    return {name: chain + step for name, chain in chains.items()}


def pass_cost(shape: PassShape, run: RunShape, policy: Policy, model: ModelSpec,
              hw: HardwareSpec, graphed: bool = False) -> PassCost:
    """graphed: the policy's placement is known to let decode passes replay CUDA graphs
    (estimate of a whole policy: policy_search.graphs); the LP, whose placement is open, prices
    every pass as eager."""
    resources = _layer_resources(shape, policy, model, hw, graphed)
    layers = model.num_layers
    resources = {name: expr * layers for name, expr in resources.items()}
    head = _head_resources(shape, model, hw)
    for name, expr in head.items():
        resources[name] = resources[name] + expr
    if ROUTED in resources:  # the LM head runs after the last layer's experts
        resources[ROUTED] = resources[ROUTED] + head["gpu"]
    resources[STEP] = const(_step_seconds(shape, hw))
    return PassCost(shape=shape, resources=resources, memory=_memory(shape, run, policy, model),
                    on_host=hw.compute_on_host)


def _step_seconds(s: PassShape, hw: HardwareSpec) -> float:
    """Host seconds of the engine's step around one pass: a fixed part and a part per sequence the
    pass computes (each decoding sequence, each prompt or chunk: its rows / prompt_rows_per_sequence)."""
    chunks = s.prompt_tokens / s.prompt_rows_per_sequence if s.prompt_rows_per_sequence > 0 else 0.0
    return hw.step_overhead + hw.sequence_overhead * (s.decode_tokens + chunks)


def _matmul_seconds(params: float, tokens: float, decode_tokens: float, micro_batches: int,
                    hw: HardwareSpec, bytes_per_value: int, read_params: float | None = None) -> float:
    """GPU time of `micro_batches` equal matmuls over a `params` weight (all rows of the pass).
    read_params: the parameters each micro-batch reads when fewer than `params` per row (a MoE
    layer's experts: each row multiplies `params`, the micro-batch reads the experts it touches)."""
    if tokens <= 0:
        return 0.0
    read = params if read_params is None else read_params
    if hw.compute_on_host:
        # A CPU GEMM's time is affine in its rows: each call streams the weights from memory, then does
        # the FMAs, and a few cores overlap the two poorly (measured: within 8% from 8 to 1024 rows).
        return (micro_batches * read * bytes_per_value / hw.gpu_memory_bandwidth
                + 2 * params * tokens / hw.gpu_matmul_prefill_flops)
    per_micro_batch = max(2 * params * tokens / micro_batches / hw.gpu_matmul_prefill_flops,
                          2 * params * decode_tokens / micro_batches / hw.gpu_matmul_decode_flops,
                          read * bytes_per_value / hw.gpu_memory_bandwidth)
    return micro_batches * per_micro_batch


def uses_cpu_int4_kernel(s: PassShape, policy: Policy, hw: HardwareSpec) -> bool:
    """Whether the pass multiplies its 4-bit weights with the CPU int4 kernel: on the host, with a
    measured kernel rate, decode-only micro-batches of at most CPU_INT4_KERNEL_MAX_ROWS rows."""
    return (policy.compress_weight and hw.compute_on_host and hw.cpu_int4_matmul_flops is not None
            and s.prompt_tokens == 0 and s.decode_tokens / s.micro_batches <= CPU_INT4_KERNEL_MAX_ROWS)


def uses_gpu_int4_kernel(s: PassShape, policy: Policy, hw: HardwareSpec) -> bool:
    """Whether the pass multiplies its 4-bit weights with the GPU's fused Triton kernel: on a GPU whose
    profile measured it, micro-batches of at most GPU_INT4_KERNEL_MAX_ROWS rows (prompt rows too)."""
    return (policy.compress_weight and not hw.compute_on_host and hw.gpu_int4_matmul_flops is not None
            and s.tokens / s.micro_batches <= GPU_INT4_KERNEL_MAX_ROWS)


def _layer_matmul_seconds(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec) -> float:
    """One layer's matmuls over the pass but its routed experts', 4-bit weights included: an int4
    kernel on the packed weight (no dequantization) where `uses_cpu_int4_kernel` or
    `uses_gpu_int4_kernel` (on a GPU each micro-batch reads the codes: at least their bytes at the
    memory's rate), else each micro-batch dequantizes the weight right before its matmul and runs
    the dense one."""
    params = model.layer_dense_matrix_params
    if uses_cpu_int4_kernel(s, policy, hw):
        return 2 * params * s.tokens / hw.cpu_int4_matmul_flops
    if uses_gpu_int4_kernel(s, policy, hw):
        return max(2 * params * s.tokens / hw.gpu_int4_matmul_flops,
                   s.micro_batches * params * model.weight_format.bytes_per_value / hw.gpu_memory_bandwidth)
    matmul = _matmul_seconds(params, s.tokens, s.decode_tokens, s.micro_batches, hw, model.bytes_per_value)
    if policy.compress_weight:
        matmul += s.micro_batches * params / hw.gpu_dequant_rate
    return matmul


def _expert_seconds(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec) -> tuple[float, float]:
    """One layer's routed-expert matmuls over the pass, all computed on the compute device and all
    on the CPU (cpu_experts): (device seconds, CPU seconds). Each token multiplies its top-k experts
    (layer_routed_params); each micro-batch reads the experts its rows touch."""
    if not model.num_experts or s.tokens <= 0:
        return 0.0, 0.0
    k = s.micro_batches
    routed = model.layer_routed_params
    read = model.expert_touched_fraction(s.tokens / k) * model.layer_expert_params  # per micro-batch
    if uses_cpu_int4_kernel(s, policy, hw):  # a few rows per expert: the packed bytes bound it too
        device = max(2 * routed * s.tokens / hw.cpu_int4_matmul_flops,
                     k * read * model.weight_format.bytes_per_value / hw.gpu_memory_bandwidth)
    else:
        device = _matmul_seconds(routed, s.tokens, s.decode_tokens, k, hw, model.bytes_per_value, read)
        if policy.compress_weight:
            device += k * read / hw.gpu_dequant_rate
    # the CPU's matmul streams each micro-batch's touched experts (as stored) and then does the FMAs
    cpu = (k * read * model.matrix_bytes_per_value(policy.compress_weight) / hw.cpu_read_bandwidth
           + 2 * routed * s.tokens / hw.cpu_matmul_flops)
    if policy.compress_weight:
        cpu += k * read / hw.cpu_dequant_rate
    return device, cpu


def _streamed_expert_bytes(s: PassShape, policy: Policy, model: ModelSpec) -> float:
    """Expert bytes of one layer read from the cpu or disk tier per unit fraction: all of them, or
    with routed_expert_reads those some row of the pass routes to."""
    experts = model.layer_expert_bytes(policy.compress_weight)
    return experts * model.expert_touched_fraction(s.tokens) if policy.routed_expert_reads else experts


def delegates_experts(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec) -> bool:
    """Whether cpu_experts computes this pass's cpu-tier experts on the CPU: on a host compute device
    always (it saves the memcpy into the working buffers); on a GPU machine where the CPU computes
    them sooner than their bytes would cross host->device (few rows per expert: decode passes), the
    pass's prompt chunks otherwise copying them as without the option. Both sides scale with w_cpu,
    so the choice is the pass's, not the placement's."""
    if not (policy.cpu_experts and model.num_experts):
        return False
    if hw.compute_on_host:
        return True
    return _expert_seconds(s, policy, model, hw)[1] < _streamed_expert_bytes(s, policy, model) / hw.host_to_device


def _expert_copied_fraction(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec) -> np.ndarray:
    """Share of the experts copied to the compute device's working buffers (see _layer_bytes_moved):
    a delegating pass computes the cpu tier's part where it lives."""
    delegated = delegates_experts(s, policy, model, hw)
    if hw.compute_on_host:
        return const(0.0) if delegated else f.w_cpu
    return f.w_disk if delegated else f.w_off_gpu


def _moe_resources(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec,
                   gpu_before_experts: np.ndarray) -> dict[str, np.ndarray]:
    """A MoE layer's expert compute and, under routed_expert_reads, its routed chain: the compute
    before the experts, then the streamed expert bytes over the links they cross."""
    device, cpu_seconds = _expert_seconds(s, policy, model, hw)
    delegated = delegates_experts(s, policy, model, hw)
    on_cpu = f.w_cpu if delegated else const(0.0)
    out = {"gpu": (const(1.0) - on_cpu) * device, "cpu": on_cpu * cpu_seconds}
    if delegated:  # every row's hidden state to the host, its expert output back
        rows_bytes = s.tokens * model.hidden_bytes_per_token
        out["device->host"] = const(rows_bytes / hw.device_to_host)
        out["host->device"] = const(rows_bytes / hw.host_to_device)
    if policy.routed_expert_reads and policy.overlap:
        streamed = _streamed_expert_bytes(s, policy, model)
        out[ROUTED] = gpu_before_experts + streamed * (
            f.w_disk / hw.disk_to_host + _expert_copied_fraction(s, policy, model, hw) / hw.host_to_device)
    return out


def _layer_resources(s: PassShape, policy: Policy, model: ModelSpec,
                     hw: HardwareSpec, graphed: bool = False) -> dict[str, np.ndarray]:
    """Seconds per resource for one layer of one pass."""
    decode_kv_tokens = s.decode_tokens * s.context  # KV tokens decode attention reads
    cpu_attention = policy.cpu_attention and s.decode_tokens > 0
    # Share of decode attention done on the GPU: all of it, or only where the cache is on the GPU.
    gpu_decode_share = f.kv_gpu if cpu_attention else const(1.0)
    to_device, to_host, disk_read, disk_write = _layer_bytes_moved(s, policy, model, hw)

    matmul = _layer_matmul_seconds(s, policy, model, hw)
    pair_flops = model.attention_flops_per_pair()
    prompt_attention = s.prompt_pairs * pair_flops / hw.gpu_attention_prefill_flops
    # a 4-bit pool a GPU kernel attends in place (quant/triton_kv_attention.py): its codes read once,
    # dequantized in registers; else the context is gathered and dequantized first
    codes_in_pool = policy.compress_kv and not hw.compute_on_host and "gpu" in model.in_pool_tiers(True)
    decode_attention = max(decode_kv_tokens * pair_flops / hw.gpu_attention_decode_flops,
                           decode_kv_tokens * model.kv_bytes_per_token(codes_in_pool) / hw.gpu_memory_bandwidth)
    overhead = s.micro_batches * _layer_overhead(s, hw, graphed)  # the executor's fixed cost
    gpu = const(matmul + prompt_attention + overhead) + gpu_decode_share * decode_attention
    kv_values = model.kv_values_per_token
    if policy.compress_kv:  # dequantize what GPU attention gathers, quantize what the pass stores
        dequantized = const(0.0) if codes_in_pool else gpu_decode_share * decode_kv_tokens
        gpu = gpu + (dequantized + const(s.prior_kv_tokens + s.tokens)) * (kv_values / hw.gpu_dequant_rate)
    cpu = const(0.0)
    if cpu_attention:
        cpu_seconds = decode_kv_tokens * pair_flops / hw.cpu_attention_flops
        if policy.compress_kv:
            cpu_seconds += decode_kv_tokens * kv_values / hw.cpu_dequant_rate
        cpu = f.kv_off_gpu * cpu_seconds
    out = {"host->device": (to_device / hw.host_to_device + _disk_read_cpu(s, policy, model, hw)
                            + _kv_gather_seconds(s, policy, model, hw, cpu_attention)),
           "device->host": to_host / hw.device_to_host,
           "disk->host": disk_read / hw.disk_to_host, "host->disk": disk_write / hw.host_to_disk,
           "gpu": gpu, "cpu": cpu}
    if model.num_experts:
        for name, expr in _moe_resources(s, policy, model, hw, gpu).items():
            out[name] = out.get(name, const(0.0)) + expr
    return out


def _kv_gather_seconds(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec,
                       cpu_attention: bool) -> np.ndarray:
    """Off-GPU K/V bound for the GPU is first gathered on the host, its rows from the pool's slots
    into one pinned buffer, then copied up (offload/kv_cache.py KVPool._select): one pass over those
    bytes at the host's memory rate (HardwareSpec.cpu_read_bandwidth), on the I/O thread before the
    copy, so on the load chain with it. On a host compute device that gather is the copy itself."""
    if hw.compute_on_host:
        return const(0.0)
    gathered_tokens = s.prior_kv_tokens + (0.0 if cpu_attention else s.decode_tokens * s.context)
    return f.kv_off_gpu * (gathered_tokens * model.kv_bytes_per_token(policy.compress_kv) / hw.cpu_read_bandwidth)


def _layer_overhead(s: PassShape, hw: HardwareSpec, graphed: bool) -> float:
    """Host seconds per layer and micro-batch beyond the math (HardwareSpec): a decode pass of one
    micro-batch replayed from a CUDA graph pays the graph's, where the hardware has that figure."""
    replayed = graphed and s.prompt_tokens == 0 and s.micro_batches == 1 and hw.graph_layer_overhead is not None
    return hw.graph_layer_overhead if replayed else hw.layer_overhead


def _layer_streamed_bytes(s: PassShape, policy: Policy, model: ModelSpec) -> float:
    """One layer's weight bytes a pass reads from the cpu or disk tier, per unit fraction: all of
    them, less the experts no row routes to under routed_expert_reads."""
    weight_bytes = model.layer_placed_bytes(policy.compress_weight)
    if not model.num_experts:
        return weight_bytes
    return weight_bytes - model.layer_expert_bytes(policy.compress_weight) + _streamed_expert_bytes(s, policy, model)


def _disk_read_cpu(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec) -> np.ndarray:
    """Seconds the computing cores lose per layer to the disk store's reader threads on a host
    compute device: every streamed disk weight byte costs `hw.disk_read_cpu` of CPU (O_DIRECT
    syscalls, page pinning, completions; 0.02-0.06 CPU s/GB measured beside the engine's passes on a
    2-core EPYC, policy_search/README.md). Charged with the cores' other work that brings weights
    into the working buffers (host->device). Mapped KV/activation reads are not measured: not charged."""
    if not hw.compute_on_host:
        return const(0.0)  # a GPU machine's reader threads run beside the GPU, not on it
    return f.w_disk * (_layer_streamed_bytes(s, policy, model) * model.disk_read_ratio(policy.compress_weight)
                       * hw.disk_read_cpu)


def _layer_bytes_moved(s: PassShape, policy: Policy, model: ModelSpec, hw: HardwareSpec):
    """Bytes one layer of the pass moves: (host->device, device->host, disk->host, host->disk)."""
    weight_bytes = model.layer_placed_bytes(policy.compress_weight)  # routers stay where they are
    kv_bytes = model.kv_bytes_per_token(policy.compress_kv)  # per token per layer, as stored
    hidden_bytes = model.hidden_bytes_per_token
    query_bytes = model.q_dim * model.bytes_per_value  # a query row or an attention-output row
    decode_kv_tokens = s.decode_tokens * s.context
    cpu_attention = policy.cpu_attention and s.decode_tokens > 0
    # Streamed weights reach the compute device through host memory: on a GPU, disk-resident ones via
    # pinned staging buffers (a copy); on the host, O_DIRECT reads land in the 4096-aligned working
    # buffers themselves (offload/placement.py), so only cpu-tier weights are copied.
    copied_weights = f.w_cpu if hw.compute_on_host else f.w_off_gpu
    to_device = copied_weights * weight_bytes
    if model.num_experts:  # experts: only the streamed ones, and not those computed on the CPU
        experts = model.layer_expert_bytes(policy.compress_weight)
        streamed = _streamed_expert_bytes(s, policy, model)
        to_device = copied_weights * (weight_bytes - experts) + _expert_copied_fraction(s, policy, model, hw) * streamed
        weight_bytes = _layer_streamed_bytes(s, policy, model)  # what disk-tier weights read
    to_device = (to_device
                 + f.kv_off_gpu * s.prior_kv_tokens * kv_bytes  # earlier chunks' KV for chunk attention
                 + f.act_off_gpu * s.tokens * hidden_bytes)  # each micro-batch's layer input
    if cpu_attention:
        to_device = to_device + f.kv_off_gpu * s.decode_tokens * query_bytes  # attention outputs back
    else:
        to_device = to_device + f.kv_off_gpu * decode_kv_tokens * kv_bytes  # cache to the GPU
    to_host = (f.kv_off_gpu * s.tokens * kv_bytes  # new K, V stored where the cache lives
               + f.act_off_gpu * s.tokens * hidden_bytes)  # each micro-batch's layer output
    if cpu_attention:
        to_host = to_host + f.kv_off_gpu * s.decode_tokens * query_bytes  # queries to the CPU
    disk_read = (f.w_disk * weight_bytes * model.disk_read_ratio(policy.compress_weight) + f.kv_disk * (decode_kv_tokens + s.prior_kv_tokens) * kv_bytes
                 + f.act_disk * s.tokens * hidden_bytes)
    disk_write = f.kv_disk * s.tokens * kv_bytes + f.act_disk * s.tokens * hidden_bytes
    return to_device, to_host, disk_read, disk_write


def _head_resources(s: PassShape, model: ModelSpec, hw: HardwareSpec) -> dict[str, np.ndarray]:
    """The LM head over the sampled rows, once per micro-batch (each computes its own logits); it
    stays on the compute device, so nothing moves."""
    micro_batches = max(1, min(s.micro_batches, math.ceil(s.sampled)))
    seconds = _matmul_seconds(model.lm_head_params, s.sampled, s.sampled, micro_batches, hw,
                              model.bytes_per_value)
    zero = const(0.0)
    return {"host->device": zero, "device->host": zero, "disk->host": zero, "host->disk": zero,
            "gpu": const(seconds), "cpu": zero}


def working_tokens(s: PassShape, run: RunShape, policy: Policy, model: ModelSpec) -> PassTokens:
    """The modelled pass's working_set shape (policy_search/working_set.py), in affine expressions:
    per micro-batch, the sequences' contexts the executor gathers onto the compute device."""
    k, longest = s.micro_batches, s.max_context
    decoders = s.decode_tokens / k
    in_pool = model.in_pool_tiers(policy.compress_kv)  # attended in place: indexed, not gathered
    if policy.cpu_attention:  # only the gpu tier's part: min(longest, gpu pool) <= gpu pool
        gpu_part = f.kv_gpu * run.kv_tokens
        decode, pooled = (const(0.0), gpu_part) if "gpu" in in_pool else (gpu_part, const(0.0))
    elif not in_pool:  # every tier's part; one context per sequence (tiers split alike: docs/DESIGN.md)
        decode, pooled = const(longest), const(0.0)
    else:  # each tier's share of it by the fractions (non-negative coefficients: policy_search/bounds.py)
        pooled = sum((longest * getattr(f, f"kv_{t}") for t in in_pool), const(0.0))
        decode = sum((longest * getattr(f, f"kv_{t}") for t in TIERS if t not in in_pool), const(0.0))
    chunks = s.prompt_tokens / k / max(s.prompt_rows_per_sequence, 1) if s.prior_kv_tokens > 0 else 0.0
    # whole prompts attended in one causal call: a compressed pool's new keys are held as gathered
    # ones (its K is quantized by block), the engine's LLMEngine._pass_tokens
    grouped = s.prompt_tokens / k if policy.compress_kv and s.prior_kv_tokens == 0 else 0.0
    prompt_call = longest if s.prompt_tokens > 0 else 0.0  # keys of one prompt chunk's call
    # Every field that working_set adds up is an expression (a float would add to every coefficient).
    return PassTokens(total=const(s.tokens), widest=const(s.tokens / k),
                      slice_rows=const(min(s.tokens / k, POST_ATTENTION_ROWS)),
                      context_slots=(2 if k > 1 else 1) * (decoders * decode + const(chunks * longest + grouped)),
                      attention_slots=decoders * decode + const(prompt_call),
                      attention_cells=decoders * decode + const(
                          prompt_call * min(s.prompt_rows_per_sequence, QUERY_BLOCK)),
                      logit_rows=const(s.sampled), in_pool_keys=decoders * pooled)


def working_bytes(s: PassShape, run: RunShape, policy: Policy, model: ModelSpec) -> np.ndarray:
    """The pass's gpu-tier working set (working_set.py) as an affine expression in the fractions."""
    working = working_set(model, working_tokens(s, run, policy, model), policy.compress_kv)
    return f.act_gpu * (s.tokens * working.hidden_bytes) + working.compute  # the parked share, as WorkingSet.nbytes


def kv_cache_bytes(run: RunShape, policy: Policy, model: ModelSpec) -> float:
    """The reserved KV cache, all layers and tiers together: whole blocks for every running lifetime
    (run.kv_tokens), and with a 4-bit pool each running sequence's open block of K in full precision
    (KVPool's residual rows, where K waits to be quantized a block at a time)."""
    cache = run.kv_tokens * model.num_layers * model.kv_bytes_per_token(policy.compress_kv)
    if policy.compress_kv:
        cache += run.running * policy.kv_block_size * model.kv_dim * model.bytes_per_value * model.num_layers
    return cache


def _memory(s: PassShape, run: RunShape, policy: Policy, model: ModelSpec) -> dict[str, np.ndarray]:
    layers = model.num_layers
    layer_weight_bytes = model.layer_placed_bytes(policy.compress_weight)
    all_weight_bytes = layers * layer_weight_bytes  # placed by the fractions; embeddings and routers stay on the gpu tier
    kv_bytes = model.kv_bytes_per_token(policy.compress_kv)
    kv_home = kv_cache_bytes(run, policy, model)
    hidden_bytes = model.hidden_bytes_per_token
    act_home = s.tokens * hidden_bytes  # one layer's hidden states for every micro-batch
    k = s.micro_batches
    decode_rows = s.decode_tokens / k
    rows = s.tokens / k
    # One micro-batch's off-GPU cache read for one layer (decodes' context + earlier chunks).
    kv_read_tokens = decode_rows * s.max_context + s.prior_kv_tokens / k
    cpu_attention = policy.cpu_attention and s.decode_tokens > 0
    # Streamed weights: the layer computing and the weight_prefetch ones loading (one without overlap).
    stream_buffer = policy.weight_buffers * model.largest_layer_weight_bytes(policy.compress_weight)

    gpu = (f.w_gpu * all_weight_bytes + const(model.embedding_bytes + layers * model.layer_resident_bytes) + f.kv_gpu * kv_home
           + f.w_off_gpu * stream_buffer + working_bytes(s, run, policy, model))
    if policy.compress_weight:  # one matrix dequantized at a time
        gpu = gpu + const(model.largest_matrix_params * model.bytes_per_value)

    cpu = (f.w_cpu * all_weight_bytes + f.kv_cpu * kv_home + f.act_cpu * act_home
           + f.w_disk * stream_buffer  # disk weights pass through host buffers
           + f.kv_disk * ((2 * kv_read_tokens + rows) * kv_bytes)  # disk cache read and written via host
           + f.act_disk * (2 * rows * hidden_bytes))
    if cpu_attention:  # one micro-batch's scores (fp32), and its dequantized cache when compressed
        workspace = decode_rows * model.num_heads * s.max_context * SCORE_BYTES
        if policy.compress_kv:
            workspace += decode_rows * s.max_context * model.kv_bytes_per_token(False)
        cpu = cpu + f.kv_off_gpu * workspace
    if policy.cpu_experts and model.num_experts:  # a micro-batch's expert rows on the CPU (in any pass)
        cpu = cpu + const(rows * (2 * hidden_bytes + 2 * model.ffn_activation_width * model.bytes_per_value))
    disk = f.w_disk * all_weight_bytes + f.kv_disk * kv_home + f.act_disk * act_home
    return {"gpu": gpu, "cpu": cpu, "disk": disk}
