#!/usr/bin/env python
"""Where a pass's time goes when it moves nothing: everything on the compute device, a few running
sequences, dummy weights (prints; asserts nothing). The question it answers (issue 27): at FlexGen's
all-GPU batch-2 policy ours took 75 ms per token step where FlexGen took 20 ms, so the cost is host
work per layer or device syncs, not bytes. Prints the seconds per decode step, the Python functions
with the most own time (cProfile) and the torch operators called per step with their host time
(torch.profiler), syncs (`aten::item`, `cudaStreamSynchronize`, ...) among them.

    python scripts/profile_passes.py                                   # dummy:opt-1.3b on CUDA if present
    python scripts/profile_passes.py --model dummy:opt-125m --device cpu --dtype float32
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:opt-1.3b")
    p.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    p.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=2, help="running sequences (one GPU batch)")
    p.add_argument("--scheduler", default="block", choices=["block", "decode-maximal"])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--compress", action="store_true", help="4-bit weights (drawn as codes) and 4-bit KV, as "
                   "FlexGen's --compress-weight --compress-cache")
    p.add_argument("--top", type=int, default=25, help="rows of each table")
    args = p.parse_args()

    import torch

    from flexsarathi import LLM, SamplingParams
    from flexsarathi.cli.bench import _prompts
    from policy_search import Policy

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float16" if device == "cuda" else "float32")
    policy = Policy(gpu_batch_size=args.batch, num_gpu_batches=1, w_gpu=1, w_cpu=0, w_disk=0, kv_gpu=1, kv_cpu=0,
                    kv_disk=0, act_gpu=1, act_cpu=0, act_disk=0, overlap=False, scheduler=args.scheduler,
                    compress_weight=args.compress, compress_kv=args.compress)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{args.model} on {device} ({name}), {dtype}, torch {torch.__version__}; {cpu_line()}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with LLM(args.model, enable_prefix_caching=False, dtype=dtype, device=device, policy=policy,
             dummy_weight_codes=args.compress) as llm:
        vocab = llm.engine.config.vocab_size
        layers = llm.engine.config.num_layers
        params = SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True)
        llm.generate(_prompts(args.batch, 32, vocab, 1), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                     use_tqdm=False)  # warm-up

        def run() -> float:
            sync()
            start = time.perf_counter()
            llm.generate(_prompts(args.batch, args.prompt_len, vocab, 0), params, use_tqdm=False)
            sync()
            return time.perf_counter() - start

        plain = run()
        print(f"plain run: {plain:.3f} s for {args.gen_len} tokens x {args.batch}: "
              f"{1000 * plain / args.gen_len:.1f} ms per token step, "
              f"{1000 * plain / args.gen_len / layers:.2f} ms per layer-step ({layers} layers)")

        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
        print("\n== Python functions by own time (cProfile, one run) ==")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:12000])

        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run()
        print("\n== torch operators by host time (torch.profiler, one run) ==")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        if device == "cuda":  # where the GPU's own time goes (Triton's kernels by name)
            print("\n== kernels by GPU time (torch.profiler, one run) ==")
            print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
