"""`ModelConfig`: the model's shape and math options for the runtime: policy_search's `HFConfig`
(the one config.json parser, shared with the planner) plus the checkpoint's torch dtype.

Two families: OPT (`opt`) and LLaMA (`llama`, `mistral`, `qwen2`, `qwen3`; with mixture-of-experts MLPs `mixtral`, `qwen2_moe`, `qwen3_moe`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flexsarathi.errors import CheckpointError
from policy_search.errors import SpecError
from policy_search.hf_config import HFConfig, RopeConfig, dtype_name, read_config_json

__all__ = ["ModelConfig", "RopeConfig", "parse_dtype"]


def parse_dtype(value, where: str = "dtype") -> torch.dtype:
    """float32, float16 or bfloat16 from any of their spellings, a torch.dtype among them (torch.int8 is
    refused here, not by the first layer norm)."""
    try:
        return getattr(torch, dtype_name(value, where))
    except SpecError as exc:
        raise CheckpointError(str(exc)) from None


@dataclass(frozen=True)
class ModelConfig(HFConfig):
    @property
    def checkpoint_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "ModelConfig":
        try:
            data, path = read_config_json(folder)
        except SpecError as exc:
            raise CheckpointError(str(exc)) from None
        return cls.from_hf(data, source=path)

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        try:
            return cls.parse(cfg, source)
        except SpecError as exc:
            raise CheckpointError(str(exc)) from None
