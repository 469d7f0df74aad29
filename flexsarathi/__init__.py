"""FlexSarathi: offloading-aware throughput inference (FlexGen placement + SARATHI batching)."""
from flexsarathi.engine.llm_engine import RequestOutput
from flexsarathi.errors import CheckpointError, FlexSarathiError
from flexsarathi.llm import LLM
from flexsarathi.engine.pooling import ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams
from flexsarathi.engine.lora_requests import LoRARequest
from flexsarathi.engine.sampling import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "PoolingParams", "EmbeddingRequestOutput",
           "ClassificationRequestOutput", "FlexSarathiError", "CheckpointError"]
__version__ = "0.1.0"
