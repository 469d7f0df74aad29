"""Model families as pure math (see base.py for the contract)."""
from flexsarathi.models.model_config import ModelConfig
from flexsarathi.models.base import ModelMath, Weights
from flexsarathi.models.gemma import GemmaMath
from flexsarathi.models.llama import LlamaMath
from flexsarathi.models.moe import MoeMath
from flexsarathi.models.opt import OPTMath


def build_model_math(config: ModelConfig) -> ModelMath:
    if config.family == "opt":
        return OPTMath(config)
    if config.is_gemma:
        return GemmaMath(config)
    return MoeMath(config) if config.moe is not None else LlamaMath(config)


__all__ = ["ModelMath", "Weights", "build_model_math", "GemmaMath", "LlamaMath", "MoeMath", "OPTMath"]
