"""A request's state as it moves through the engine (vLLM's vocabulary)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from flexsarathi.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS or a stop token
    FINISHED_LENGTH = "length"  # max_tokens or the model's context

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_len: int  # prompt + max_tokens, capped by the model's context
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop tokens
    generator: torch.Generator
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)  # global KV block ids (BlockManager)
    residual_id: int = -1  # row of the pools' full-precision buffer for the block being filled
    prompt_logprobs: list[float] = field(default_factory=list)
    keep_prompt_logits: bool = False  # keep full-vocabulary logits of every prompt row (scoring)
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # [chunk, vocab] per chunk
    # Preemption (on-demand KV admission): tokens to recompute as a prefill on re-admission.
    recompute_len: int = 0
    num_preemptions: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed as a prefill before the next sample: the prompt, or after a preemption
        the prompt and every output so far (recomputed; the outputs stay outputs)."""
        return max(self.num_prompt_tokens, self.recompute_len)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prefill_tokens

    def preempt(self) -> None:
        """Its KV blocks were taken back: it waits again and recomputes what it had. The sampling
        generator keeps its state, so seeded sampling continues as if uninterrupted; prompt
        logprobs and logits are recorded afresh by the recompute."""
        self.recompute_len = self.num_tokens
        self.num_computed = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.prompt_logprobs.clear()
        self.prompt_logits.clear()

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    def append(self, token: int) -> None:
        self.output_token_ids.append(token)
        if token in self.stop_ids:
            self.status = SequenceStatus.FINISHED_STOPPED
        elif self.num_tokens >= self.max_len:
            self.status = SequenceStatus.FINISHED_LENGTH

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
