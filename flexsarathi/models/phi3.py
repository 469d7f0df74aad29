"""Phi-3 and Phi-4 (model_type phi3): the LLaMA family's math with q/k/v and gate/up fused in the
checkpoint itself (`qkv_proj`, `gate_up_proj`, in the order the engine fuses them), so each is read
as the one tensor it is. Its long-context RoPE (`longrope`) and partial rotary embedding are refused
when the config is parsed (policy_search/hf_config.py)."""
from __future__ import annotations

from flexsarathi.models.base import ModelMath
from flexsarathi.models.llama import LlamaMath


class Phi3Math(LlamaMath):
    def hf_layer_names(self, layer):
        p = f"model.layers.{layer}."
        return {**super().hf_layer_names(layer), "qkv_proj.weight": [p + "self_attn.qkv_proj.weight"],
                "gate_up_proj.weight": [p + "mlp.gate_up_proj.weight"]}

    def part_rows(self, name, layer=0):
        # one checkpoint tensor per fused weight: a LoRA adapter's qkv_proj covers all its rows
        return ModelMath.part_rows(self, name, layer)
