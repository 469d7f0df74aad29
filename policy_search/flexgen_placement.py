"""FlexGen's `--percent` weight placement in our fields: the shares of a layer's weight bytes it puts
on each tier. FlexGen places each tensor of a layer whole, on the tier whose cumulative share (disk,
then cpu, then gpu) holds the tensor's midpoint, its attention and its MLP being two layers
(flexgen/flex_opt.py: init_weight_list, SelfAttention.init_weight, MLP.init_weight). So the
percentages are not the bytes: OPT-30B at `--percent 20 80` holds only out_proj on the GPU, 8.3% of
the bytes. Our fractions split bytes exactly, so FlexGen's placement is these shares: the same bytes
on the GPU, the same bytes streamed per layer."""
from __future__ import annotations

from policy_search.model_spec import ModelSpec


def flexgen_weight_split(model: ModelSpec, w_gpu_percent: float, w_cpu_percent: float) -> tuple[float, float, float]:
    """(gpu, cpu, disk) shares of an OPT layer's weight bytes under FlexGen's `--percent w_gpu w_cpu ...`."""
    if model.ffn_kind != "mlp" or model.num_experts:
        raise ValueError(f"flexgen_weight_split: FlexGen places OPT layers; {model.name} is not one")
    h, ffn = model.hidden_size, model.ffn_size
    attention = [h * h, h] * 4 + [h, h]  # q, k, v, out_proj (weight, bias); LayerNorm weight, bias
    mlp = [ffn * h, ffn, h * ffn, h, h, h]  # fc1, fc2 (weight, bias); LayerNorm weight, bias
    # a midpoint below the first bound is on disk, below the second on the cpu, else on the gpu
    bounds = ((100 - w_gpu_percent - w_cpu_percent, "disk"), (100 - w_gpu_percent, "cpu"))
    placed = {"gpu": 0, "cpu": 0, "disk": 0}
    for sizes in (attention, mlp):
        total, start = sum(sizes), 0
        for size in sizes:
            middle = 100 * (start + size / 2) / total
            placed[next((tier for bound, tier in bounds if middle < bound), "gpu")] += size
            start += size
    whole = sum(placed.values())
    return placed["gpu"] / whole, placed["cpu"] / whole, placed["disk"] / whole


def flexgen_weight_fields(model_name: str, w_gpu_percent: float, w_cpu_percent: float) -> dict[str, float]:
    """Policy's w_gpu, w_cpu, w_disk for FlexGen's `--percent w_gpu w_cpu ...` on a registered OPT model."""
    split = flexgen_weight_split(ModelSpec.from_name(model_name), w_gpu_percent, w_cpu_percent)
    return dict(zip(("w_gpu", "w_cpu", "w_disk"), split))
