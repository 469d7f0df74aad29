#!/usr/bin/env python
"""Kernel launches and host time per decode layer-step, ours beside a plain-PyTorch layer (prints;
asserts nothing; `tests/offload/test_launch_count.py` pins the count). Times are medians of every
layer-step (ours: each layer of each decode pass; plain: as many repeats), ours and plain timed in
alternating rounds; their ratio is the median over rounds of each round's ratio (ours, then the plain
steps right after), so a busy neighbour's burst moves the times little and the ratio less. Also the
median host time of a decode step outside its eager pass: scheduling, building the micro-batch,
sampling (it grows with --batch; a pass replayed from a CUDA graph prepares its inputs itself).

An all-on-device decode pass moves nothing, so its speed on a GPU is host time: about 25 us per
kernel launch (docs/DESIGN.md, "Decode passes on a GPU"). This counts the aten operators that launch
a kernel (views and bare allocations do not) inside the layer loop of decode passes, on any device:
on the CPU the GPU code path runs with a half-precision model (decode attention is the same SDPA
call there), so the count is measurable without a GPU. Beside it, the same count and host time for
a plain PyTorch OPT decode layer (fused qkv, one KV write, SDPA: the floor) in the same process,
one per layer of the model, through the same context lengths as our decode passes.

    python scripts/count_launches.py                         # tiny OPT, fp16, batch 2, on the CPU
    python scripts/count_launches.py --device cuda           # the same on a GPU (also its profiler's count)
    python scripts/count_launches.py --graphs                # with CUDA graphs where the pass allows them
    python scripts/count_launches.py --batch 72              # also: a block prefill of 72 prompts, per layer-step
    python scripts/count_launches.py --compress-kv           # over a 4-bit KV cache

Over a 4-bit KV cache a GPU attends decode rows with one Triton kernel reading the codes
(quant/triton_kv_attention.py); on the CPU the same route runs in Triton's interpreter (the script
sets TRITON_INTERPRET=1), its launch counted as one, its host time then the interpreter's (not a
GPU's launch cost: read the launches). `--gather-kv` takes the gather route instead (dequantized
context + SDPA), what a GPU without triton runs.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from flexsarathi.machine.launch_counter import LaunchCounter  # noqa: E402


def tiny_opt(folder: str, hidden: int, heads: int, layers: int, dtype: torch.dtype) -> None:
    """A random OPT checkpoint of these shapes (transformers writes it: the test extra)."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       ffn_dim=4 * hidden, max_position_embeddings=1024, word_embed_proj_dim=hidden)
    torch.manual_seed(0)
    OPTForCausalLM(config).to(dtype).save_pretrained(folder, safe_serialization=True)


class PlainLayer:
    """An OPT decode layer as a plain PyTorch program writes it: the floor for launches and host time."""

    def __init__(self, hidden: int, heads: int, batch: int, context: int, dtype, device):
        def w(*shape):
            return torch.randn(*shape, dtype=dtype, device=device) * 0.02

        self.heads, self.dim = heads, hidden // heads
        self.ln1, self.ln2 = (w(hidden) + 1, w(hidden)), (w(hidden) + 1, w(hidden))
        self.qkv, self.qkv_b, self.o, self.o_b = w(3 * hidden, hidden), w(3 * hidden), w(hidden, hidden), w(hidden)
        self.fc1, self.fc1_b, self.fc2, self.fc2_b = w(4 * hidden, hidden), w(4 * hidden), w(hidden, 4 * hidden), w(hidden)
        self.kv = torch.zeros(batch * context, 2, heads, self.dim, dtype=dtype, device=device)  # [slots, 2, h, d]
        self.batch, self.context = batch, context
        # a padded batch of sequences of different lengths needs a mask, as ours: built once, outside
        self.bias = torch.zeros(batch, 1, 1, context, dtype=dtype, device=device)

    def step(self, x: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        """x: [B, hidden]; slots: [B] this token's KV slot; the first `length` slots of each row are its context."""
        b, h, d = self.batch, self.heads, self.dim
        y = F.layer_norm(x, x.shape[-1:], *self.ln1)
        qkv = F.linear(y, self.qkv, self.qkv_b)  # [B, 3 * hidden]
        self.kv.index_copy_(0, slots, qkv[:, h * d:].view(b, 2, h, d))  # one KV write
        kv = self.kv.view(b, self.context, 2, h, d)[:, :length]
        attn = F.scaled_dot_product_attention(qkv[:, :h * d].view(b, h, 1, d), kv[:, :, 0].transpose(1, 2),
                                              kv[:, :, 1].transpose(1, 2), attn_mask=self.bias[..., :length])  # [B, h, 1, d]
        x = x + F.linear(attn.view(b, h * d), self.o, self.o_b)
        y = F.linear(F.relu(F.linear(F.layer_norm(x, x.shape[-1:], *self.ln2), self.fc1, self.fc1_b)), self.fc2, self.fc2_b)
        return x + y


def plain_measurer(args, dtype, device, sync):
    """(launches per layer of the plain layer, a function that times as many layer-steps as one of
    our timed generates makes and returns their host seconds). The floor decodes as ours does: a
    model of args.layers layers (each its own weights, as ours has), through the same context
    lengths as our decode passes (prompt + 1 up to prompt + steps keys)."""
    context = args.prompt_len + args.steps + 1
    layers = [PlainLayer(args.hidden, args.heads, args.batch, context, dtype, device) for _ in range(args.layers)]
    x = torch.randn(args.batch, args.hidden, dtype=dtype, device=device)
    rows = torch.arange(args.batch, device=device) * context  # each sequence's first slot
    with torch.inference_mode():
        first = rows + args.prompt_len  # the first decode pass's slots (made outside the count)
        for _ in range(3):
            layers[0].step(x, first, args.prompt_len + 1)
        with LaunchCounter() as counter:
            layers[0].step(x, first, args.prompt_len + 1)

    @torch.inference_mode()
    def timed() -> list[float]:
        times = []
        for step in range(args.steps):
            length = args.prompt_len + 1 + step  # this pass's keys, its new token the last
            slots = rows + length - 1
            for layer in layers:
                sync()
                start = time.perf_counter()
                layer.step(x, slots, length)
                sync()
                times.append(time.perf_counter() - start)
        return times

    return counter.launches, timed


def measure_ours(args, folder: str, dtype, device, sync, plain_round) -> dict:
    """Launches and host time per decode layer-step of the engine (layer loop only), and per decode
    pass outside the layers (embedding, head, metadata). Our timed runs alternate with
    `plain_round`'s (args.rounds of each), so both see the same machine: a busy neighbour's burst
    moves both medians, not their ratio."""
    from flexsarathi import LLM, SamplingParams
    from flexsarathi.engine.llm_engine import LLMEngine
    from offload.executor import PassExecutor
    from offload.kv_cache import gathered_plain_decodes
    from policy_search import Policy

    policy = Policy(gpu_batch_size=args.batch, num_gpu_batches=1, overlap=False, scheduler="block",
                    compress_kv=args.compress_kv)
    prompts = [[(7 * i + j) % 500 + 2 for j in range(args.prompt_len)] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
    counts = {"layer": 0, "pass": 0, "layer_s": 0.0, "pass_s": 0.0, "run_s": 0.0, "layer_steps": 0, "passes": 0,
              "timed_passes": 0}
    layer_counter, pass_counter = LaunchCounter(), LaunchCounter()  # nested: the pass's sees the layers' too
    layer_times: list[float] = []
    run_layer, run_pass, engine_step = PassExecutor._run_layer, PassExecutor.run, LLMEngine.step

    def is_decode(batches) -> bool:
        return all(g.is_decode for mb in batches for g in mb.groups)

    def counted_layer(self, layer, batches, start):
        layer_counter.reset()
        with layer_counter:
            result = run_layer(self, layer, batches, start)
        kind = "" if is_decode(batches) else "prompt_"  # the block prefill of every prompt, or a decode
        counts[kind + "layer"] = counts.get(kind + "layer", 0) + layer_counter.launches
        counts[kind + "layer_steps"] = counts.get(kind + "layer_steps", 0) + 1
        return result

    def counted_pass(self, micro_batches):
        before = counts["layer"]
        pass_counter.reset()
        with pass_counter:
            result = run_pass(self, micro_batches)
        if is_decode(micro_batches):
            counts["passes"] += 1
            counts["pass"] += pass_counter.launches - (counts["layer"] - before)
        return result

    def timed_layer(self, layer, batches, start):  # no dispatch mode here: its Python costs per operator
        if not is_decode(batches):
            return run_layer(self, layer, batches, start)
        sync()
        began = time.perf_counter()
        result = run_layer(self, layer, batches, start)
        sync()
        layer_times.append(time.perf_counter() - began)
        counts["layer_s"] += layer_times[-1]  # taken out of the pass's time (outside_us)
        return result

    def timed_pass(self, micro_batches):
        before = counts["layer_s"]
        sync()
        began = time.perf_counter()
        result = run_pass(self, micro_batches)
        sync()
        if is_decode(micro_batches):
            counts["timed_passes"] += 1
            counts["run_s"] += time.perf_counter() - began
            counts["pass_s"] += time.perf_counter() - began - (counts["layer_s"] - before)
        return result

    step_times: list[float] = []  # per decode step: its host time outside the pass

    def timed_step(self):
        passes, run_s = counts["timed_passes"], counts["run_s"]
        began = time.perf_counter()
        result = engine_step(self)
        if counts["timed_passes"] == passes + 1:  # a decode pass ran (not the prefill)
            step_times.append(time.perf_counter() - began - (counts["run_s"] - run_s))
        return result

    # gathered_plain_decodes: decode attention as the GPU runs it (gather + SDPA), on the CPU too;
    # over a 4-bit cache the Triton kernel as the GPU runs it (interpreted on the CPU)
    with LLM(folder, enable_prefix_caching=False,
             dtype=dtype, device=device, policy=policy, cuda_graphs=args.graphs) as llm, \
            gathered_plain_decodes(), triton_decodes(args, device):
        llm.generate(prompts, params, use_tqdm=False)  # warm-up (and graph capture)
        try:
            PassExecutor._run_layer, PassExecutor.run = counted_layer, counted_pass
            llm.generate(prompts, params, use_tqdm=False)
            PassExecutor._run_layer, PassExecutor.run, LLMEngine.step = timed_layer, timed_pass, timed_step
            plain_times, ratios, total = [], [], 0.0
            for _ in range(args.rounds):
                began, first = time.perf_counter(), len(layer_times)
                llm.generate(prompts, params, use_tqdm=False)
                total += time.perf_counter() - began
                plain_times += (plain := plain_round())
                if len(layer_times) > first:  # this round's ours against the plain steps right after it
                    ratios.append(statistics.median(layer_times[first:]) / statistics.median(plain))
        finally:
            PassExecutor._run_layer, PassExecutor.run, LLMEngine.step = run_layer, run_pass, engine_step
        graph_steps = llm.engine.stats.get("graph_passes", 0)
    steps = max(counts["layer_steps"], 1)
    return {"launches": counts["layer"] / steps, "host_us": 1e6 * statistics.median(layer_times) if layer_times else 0.0,
            "prompt_launches": counts.get("prompt_layer", 0) / max(counts.get("prompt_layer_steps", 0), 1),
            "outside_launches": counts["pass"] / max(counts["passes"], 1),
            "outside_us": 1e6 * counts["pass_s"] / max(counts["timed_passes"], 1),
            "step_outside_us": 1e6 * statistics.median(step_times) if step_times else None,
            "eager_layer_steps": counts["layer_steps"], "graph_passes": graph_steps, "generate_s": total / args.rounds,
            "plain_us": 1e6 * statistics.median(plain_times), "ratio": statistics.median(ratios) if ratios else 0.0}


@contextlib.contextmanager
def triton_decodes(args, device: torch.device):
    """Over a 4-bit KV cache: each launch of the KV cache's Triton kernels (decode attention, V's
    quantize) counted as one; on the CPU the GPU's route run by the interpreter; --gather-kv: the
    route a GPU without triton takes (dequantized context, SDPA). Else nothing."""
    if not args.compress_kv or importlib.util.find_spec("triton") is None:
        yield
        return
    from flexsarathi.machine.launch_counter import counting_triton_launches
    from offload.kv_cache import gathered_decodes, triton_decodes_on_cpu
    from quant import triton_kv_attention, triton_quantize

    interpreted = device.type == "cpu" and not args.gather_kv
    with counting_triton_launches((triton_kv_attention, "_decode_kernel"), (triton_quantize, "_quantize_kernel")), \
            triton_decodes_on_cpu() if interpreted else contextlib.nullcontext(), \
            gathered_decodes() if args.gather_kv else contextlib.nullcontext():
        yield


def profiler_kernels(args, folder: str, dtype, device) -> float:
    """CUDA kernels per decode layer-step as the profiler sees them (launches of every kind)."""
    from flexsarathi import LLM, SamplingParams
    from policy_search import Policy

    policy = Policy(gpu_batch_size=args.batch, num_gpu_batches=1, overlap=False, scheduler="block",
                    compress_kv=args.compress_kv)
    prompts = [[(7 * i + j) % 500 + 2 for j in range(args.prompt_len)] for i in range(args.batch)]
    with LLM(folder, enable_prefix_caching=False, dtype=dtype, device=device, policy=policy, cuda_graphs=False) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        many = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)

        def kernels(params) -> int:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
            return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

        # the prompt pass alone, then with args.steps decode passes: the difference is theirs
        return (kernels(many) - kernels(one)) / (args.steps * args.layers)


def kv_line(args) -> str:
    if not args.compress_kv:
        return ""
    route = "gather route" if args.gather_kv or importlib.util.find_spec("triton") is None else "Triton kernel"
    interpreted = ", interpreted: host times are not a GPU's" if route == "Triton kernel" and args.device == "cpu" else ""
    return f", 4-bit KV cache ({route}{interpreted})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="decode passes per timed run")
    p.add_argument("--rounds", type=int, default=5, help="timed runs of ours, each followed by as many plain layer-steps")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs for the passes that allow them")
    p.add_argument("--compress-kv", action="store_true", help="a 4-bit KV cache (its decode passes run eagerly)")
    p.add_argument("--gather-kv", action="store_true",
                   help="with --compress-kv: the gather route (dequantized context + SDPA), not the Triton kernel")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    if args.compress_kv and not args.gather_kv and args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the GPU's kernel, interpreted
        if importlib.util.find_spec("triton") is None:
            print("triton is not installed: the gather route, as a GPU without triton runs it")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({where}), {args.dtype}, torch {torch.__version__}; {cpu_line()}")
    print(f"tiny OPT: hidden {args.hidden}, {args.heads} heads, {args.layers} layers; batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.steps} decode passes{kv_line(args)}")
    with tempfile.TemporaryDirectory() as folder:
        tiny_opt(folder, args.hidden, args.heads, args.layers, dtype)
        plain_launches, plain_round = plain_measurer(args, dtype, device, sync)
        ours = measure_ours(args, folder, dtype, device, sync, plain_round)
        plain_us = ours.pop("plain_us")
        with triton_decodes(args, device):
            kernels = profiler_kernels(args, folder, dtype, device) if device.type == "cuda" else None
    figures = {"ours": ours, "plain": {"launches": plain_launches, "host_us": plain_us},
               "profiler_kernels_per_layer_step": kernels}
    print(f"{'':28}{'launches':>10}{'host us':>10}")
    print(f"{'ours, per layer-step':28}{ours['launches']:>10.1f}{ours['host_us']:>10.1f}")
    print(f"{'plain PyTorch, per layer':28}{plain_launches:>10.1f}{plain_us:>10.1f}")
    print(f"{'ours / plain':28}{ours['launches'] / plain_launches:>10.2f}{ours['ratio']:>10.2f}")
    print(f"outside the layers, per decode pass: {ours['outside_launches']:.1f} launches, {ours['outside_us']:.1f} us")
    if ours["step_outside_us"] is not None:  # None: every decode pass was replayed from a graph
        print(f"outside the pass, per decode step (schedule, build the micro-batch, sample): "
              f"{ours['step_outside_us']:.1f} us (median)")
    print(f"per prompt layer-step (block prefill of {args.batch} prompts): {ours['prompt_launches']:.1f} launches")
    if args.graphs:
        print(f"decode passes replayed from a CUDA graph: {ours['graph_passes']}; "
              f"eager decode layer-steps: {ours['eager_layer_steps']}")
    if kernels is not None:
        print(f"CUDA profiler: {kernels:.1f} kernels per decode layer-step")
    print(f"generate: {ours['generate_s']:.3f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
