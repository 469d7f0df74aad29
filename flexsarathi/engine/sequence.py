"""A request's state as it moves through the engine (vLLM's vocabulary)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from flexsarathi.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS or a stop token
    FINISHED_LENGTH = "length"  # max_tokens or the model's context
    FINISHED_FAILED = "failed"  # the pass gave it no token it could sample (Sequence.error says why)

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_FAILED)


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
    # Prefix caching (engine/prefix_cache.py): digests of its complete blocks so far, how many of
    # its table's blocks are registered, and the prompt tokens its first admission found cached
    block_digests: list[bytes] = field(default_factory=list, repr=False)
    num_registered_blocks: int = 0
    cache_salt: str | None = None  # its digests start from this (vLLM's cache_salt): shared only alike
    # A LoRA adapter served per request (engine/lora_requests.py): its id (0: none) and its
    # fingerprint, where its prefix-cache digests start (its blocks hold the adapted K/V)
    lora_id: int = 0
    lora_fingerprint: str | None = None
    num_cached_tokens: int = 0
    # per prompt position after the first: {token: Logprob} (params.prompt_logprobs)
    prompt_logprobs: list[dict] = field(default_factory=list)
    detokenizer: object | None = None  # tokenizer.IncrementalDetokenizer, for stop strings
    stop_text_end: int | None = None  # stop string hit: the generated text ends at this index
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    logprobs: list[dict] | None = None  # per generated token: {token: Logprob} (params.logprobs)
    error: str | None = None  # why it failed (FINISHED_FAILED): its request's output is this error
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token ids (both spacings)
    grammar: object | None = None  # structured_output.GrammarState (params.structured_outputs)
    # Preemption (on-demand KV admission): tokens to recompute as a prefill on re-admission.
    recompute_len: int = 0
    num_preemptions: int = 0
    # Sibling completions of this prompt (SamplingParams.n) that join when this sequence's prompt
    # prefill ends, sharing its KV (Scheduler.add_group); empty once forked.
    forks: list["Sequence"] = field(default_factory=list)
    # A pooling request (engine/pooling.py): its PoolingParams, and once its prompt is prefilled
    # its embedding or class probabilities (it finishes then, sampling nothing)
    pooling: object | None = None
    pooled: list[float] | None = None
    # The micro-batch builder's slot map of block_table (micro_batch_builder.SlotMap), reused
    # while the table only grows
    slot_map: object | None = field(default=None, repr=False)

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
        logprobs are recorded afresh by the recompute."""
        self.recompute_len = self.num_tokens
        self.num_computed = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.prompt_logprobs.clear()

    @property
    def context_full(self) -> bool:
        """Its tokens fill max_len (a prompt as long as the model's context): nothing to sample."""
        return self.num_tokens >= self.max_len

    def token_ids(self, start: int, end: int) -> list[int]:
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:  # outputs only (a decode step): no copy of the whole context
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def may_stop(self) -> bool:
        """Whether EOS, stop tokens and stop strings count yet (params.min_tokens)."""
        return len(self.output_token_ids) >= self.params.min_tokens

    def append(self, token: int) -> None:
        self.output_token_ids.append(token)
        # a grammar that took its end allows nothing more: its EOS stops the sequence even before
        # min_tokens (the sampler lets only EOS through there: sampling.process_logits)
        if token in self.stop_ids and (self.may_stop or (self.grammar is not None and self.grammar.complete)):
            self.status = SequenceStatus.FINISHED_STOPPED
            self.stop_reason = token
        elif self.context_full:
            self.status = SequenceStatus.FINISHED_LENGTH
        if self.detokenizer is not None:
            self._check_stop_strings()

    def _check_stop_strings(self) -> None:
        """vLLM's rule: the text ends before the first stop string (after it with
        include_stop_str_in_output); finish_reason "stop"."""
        new = self.detokenizer.add(self.output_token_ids[-1])
        if not new or not self.may_stop or self.stop_text_end is not None:
            return
        text = self.detokenizer.text
        window = len(new) + max(len(s) for s in self.params.stop) - 1  # a stop may straddle tokens
        start = max(len(text) - window, 0)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s, start)) != -1]
        if hits:
            index, self.stop_reason = min(hits)
            self.stop_text_end = index + (len(self.stop_reason) if self.params.include_stop_str_in_output else 0)
            self.status = SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
