"""Model families as pure math (see base.py for the contract)."""
from flexsarathi.models.model_config import ModelConfig
from flexsarathi.models.base import ModelMath, Weights
from flexsarathi.models.llama import LlamaMath
from flexsarathi.models.opt import OPTMath


def build_model_math(config: ModelConfig) -> ModelMath:
    return OPTMath(config) if config.family == "opt" else LlamaMath(config)


__all__ = ["ModelMath", "Weights", "build_model_math", "LlamaMath", "OPTMath"]
