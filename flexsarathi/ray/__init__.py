"""FlexSarathi on Ray Data: one LLM per actor, many actors (on one machine or a cluster).

    import ray
    from flexsarathi.ray import build_processor

    processor = build_processor("path/to/checkpoint", sampling={"max_tokens": 32, "temperature": 0},
                                concurrency=4, num_gpus=1)          # four engines, one GPU each
    rows = processor(ray.data.from_items([{"prompt": "Once upon a time"}])).take_all()
    # rows[0]["generated_text"], ["generated_token_ids"], ["finish_reason"], ["error"], ...

`flexsarathi generate --ray` runs a batch file the same way (flexsarathi.ray.job). Importing this
package imports ray: the engine without --ray never does.
"""
from __future__ import annotations

from flexsarathi.errors import FlexSarathiError

try:
    import ray  # noqa: F401
    import ray.data  # noqa: F401
except ImportError as exc:
    raise FlexSarathiError(f"flexsarathi.ray needs Ray Data ({exc}): pip install 'flexsarathi[ray]'") from None

from flexsarathi.ray.processor import EMBEDDING_COLUMNS, OUTPUT_COLUMNS, Processor, build_processor  # noqa: E402
from flexsarathi.ray.spec import EngineSpec  # noqa: E402

__all__ = ["build_processor", "Processor", "EngineSpec", "OUTPUT_COLUMNS", "EMBEDDING_COLUMNS"]
