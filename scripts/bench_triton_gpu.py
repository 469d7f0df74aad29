#!/usr/bin/env python
"""The Triton dequant-matmul kernel against dequantize + cuBLAS matmul on a CUDA GPU, at the layer
shapes of LLaMA-2-70B and OPT-30B (prints; asserts nothing).

    python scripts/bench_triton_gpu.py                  # both models, 1 / 16 / 64 / 256 rows
    python scripts/bench_triton_gpu.py --models llama-2-70b --rows 1 16

Per fused layer weight (fp16 activations, 4-bit group-64 codes: the engine's weight format):
* kernel: `quant.triton_kernels.dequant_linear` (reads the 4-bit codes, dequantizes in registers);
* dequantize + matmul: `dequantize` into a reused fp16 buffer then `F.linear` (cuBLAS), what the
  engine runs at rows above `quant.fused.TRITON_MAX_ROWS` and on GPUs below sm_80;
* fp16 matmul: `F.linear` on the fp16 weight already dequantized (the floor a 16-bit model gets);
each the median of --repeats timed calls (CUDA events) after warm-up. Error: the largest absolute
difference of each path from dequantize + fp32 matmul, beside that reference's largest magnitude.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import harness  # puts the repository root on sys.path
import torch
import torch.nn.functional as F

from quant import QuantConfig, dequantize, quantize  # noqa: E402

MODELS = ("llama-2-70b", "opt-30b")


def layer_matrices(model: str) -> dict[str, tuple[int, int]]:
    """A registered model's layer weights [out_features, in_features] as the engine fuses them."""
    from flexsarathi.models import build_model_math
    from flexsarathi.models.model_config import ModelConfig
    from policy_search.model_registry import known_config

    shapes = build_model_math(ModelConfig.from_hf(known_config(model), source=model)).layer_shapes()
    return {name.removesuffix(".weight"): shape for name, shape in shapes.items() if len(shape) == 2}


def timed(fn, repeats: int) -> float:
    """Median seconds of one call (CUDA events around each, after three warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from quant import triton_kernels

    print(f"GPU: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__}")
    print(f"{'model':<12} {'weight':<8} {'shape':>14} {'rows':>5} {'kernel ms':>10} {'deq+mm ms':>10} "
          f"{'fp16 mm ms':>11} {'deq+mm/kernel':>14} {'kernel err':>11} {'deq+mm err':>11} {'max |ref|':>10}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    config = QuantConfig(bits=4, group_size=64, group_dim=-1)
    table = []
    for model in args.models:
        for name, (out_features, in_features) in layer_matrices(model).items():
            weight = (torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02).half()
            q = quantize(weight, config)
            del weight
            dense = dequantize(q, torch.float16)
            scratch = torch.empty_like(dense)
            for rows in args.rows:
                x = torch.randn(rows, in_features, device="cuda", generator=gen).half()
                ref = F.linear(x.float(), dense.float())
                supported = triton_kernels.supports(x, q)
                kernel = (lambda: triton_kernels.dequant_linear(x, q, None)) if supported else None
                fallback = lambda: F.linear(x, dequantize(q, torch.float16, out=scratch))  # noqa: E731
                t_kernel = timed(kernel, args.repeats) if kernel else float("nan")
                t_fallback = timed(fallback, args.repeats)
                t_dense = timed(lambda: F.linear(x, dense), args.repeats)
                err_kernel = (kernel().float() - ref).abs().max().item() if kernel else float("nan")
                err_fallback = (fallback().float() - ref).abs().max().item()
                print(f"{model:<12} {name:<8} {f'{out_features}x{in_features}':>14} {rows:>5} {t_kernel * 1e3:>10.3f} "
                      f"{t_fallback * 1e3:>10.3f} {t_dense * 1e3:>11.3f} {t_fallback / t_kernel:>13.2f}x "
                      f"{err_kernel:>11.2e} {err_fallback:>11.2e} {ref.abs().max().item():>10.3f}", flush=True)
                table.append({"model": model, "weight": name, "shape": [out_features, in_features], "rows": rows,
                              "kernel_ms": t_kernel * 1e3, "deq_mm_ms": t_fallback * 1e3, "fp16_mm_ms": t_dense * 1e3,
                              "deq_mm_over_kernel": t_fallback / t_kernel, "kernel_err": err_kernel,
                              "deq_mm_err": err_fallback, "max_abs_ref": ref.abs().max().item()})
            del q, dense, scratch
            torch.cuda.empty_cache()
    harness.write_result(args, table, dtype=torch.float16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
