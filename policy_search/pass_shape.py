"""What a modelled run's passes carry (`PassShape`) and the run as a whole (`RunShape`): the values
passes.py (closed forms) and simulate.py (replays) both produce and the cost model prices."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PassShape:
    """The content of one pass; token counts are totals over all micro-batches."""
    kind: str  # "prefill", "decode", "mixed", "ramp/drain"
    count: float  # passes of this shape in the modelled run
    decode_tokens: float  # sequences decoding one token each
    prompt_tokens: float  # prompt tokens (whole prompts or chunks)
    context: float  # mean KV tokens a decode token attends to, itself included
    max_context: float  # longest context any sequence of this pass has (sizes KV buffers)
    prior_kv_tokens: float  # KV tokens of earlier chunks that this pass's chunks read
    prompt_pairs: float  # causal (query, key) pairs of the prompt tokens
    sampled: float  # sequences that sample a token (LM head rows)
    prompt_rows_per_sequence: float  # prompt rows of one sequence in this pass (attention scores)
    micro_batches: int

    @property
    def tokens(self) -> float:
        return self.decode_tokens + self.prompt_tokens


@dataclass(frozen=True)
class RunShape:
    passes: tuple[PassShape, ...]
    generated_tokens: float  # useful tokens the modelled run produces
    requests: float  # requests the modelled run completes
    kv_tokens: float  # KV-cache capacity reserved per layer, tokens
    running: int  # sequences running at once (B)
    steady_state: bool  # True when the run models an unbounded stream

    @property
    def total_passes(self) -> float:
        return sum(p.count for p in self.passes)
