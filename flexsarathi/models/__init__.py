"""Model families as pure math (see base.py for the contract)."""
from flexsarathi.models.model_config import ModelConfig
from flexsarathi.models.base import ModelMath, Weights
from flexsarathi.models.gemma import GemmaMath
from flexsarathi.models.gpt_oss import GptOssMath
from flexsarathi.models.granite import GraniteMath
from flexsarathi.models.llama import LlamaMath
from flexsarathi.models.moe import MoeMath
from flexsarathi.models.olmo import OlmoMath
from flexsarathi.models.opt import OPTMath
from flexsarathi.models.phi3 import Phi3Math


def build_model_math(config: ModelConfig) -> ModelMath:
    if config.family == "opt":
        return OPTMath(config)
    if config.is_gemma:
        return GemmaMath(config)
    if config.model_type == "phi3":
        return Phi3Math(config)
    if config.model_type == "granite":
        return GraniteMath(config)
    if config.is_olmo:
        return OlmoMath(config)
    if config.model_type == "gpt_oss":
        return GptOssMath(config)
    return MoeMath(config) if config.moe is not None else LlamaMath(config)


__all__ = ["ModelMath", "Weights", "build_model_math", "GemmaMath", "GptOssMath", "GraniteMath", "LlamaMath", "MoeMath",
           "OlmoMath", "OPTMath", "Phi3Math"]
