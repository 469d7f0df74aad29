"""The working set of a pass: compute-device bytes beyond the weights and the KV pools.

The engine's budget check (flexsarathi/engine.py: every pass, and the largest pass a batch of
requests can form, checked before any work) in pure arithmetic on model dims, so the planner can
price the same bytes. cost_model._memory does not call it yet: see issue #15's report (charging
the engine's worst pass makes FlexGen's own opt-175b policy infeasible on a T4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from policy_search.model_spec import ModelSpec
from policy_search.policy import Policy

LOGIT_BYTES = 4  # logits are kept in fp32


@dataclass(frozen=True)
class PassTokens:
    total: int  # tokens of the pass, all micro-batches
    widest: int  # tokens of its largest micro-batch
    context_slots: int  # KV slots one attention call gathers (K and V)
    logit_rows: int  # rows of the LM head's output


@dataclass(frozen=True)
class WorkingSet:
    tokens: int  # of the pass
    hidden_bytes: int  # one token's hidden state
    compute: int  # one micro-batch's layer intermediates, its attention context, the logits

    @property
    def parked(self) -> int:
        """Hidden states of the pass if all are kept on the gpu tier (the planner scales by act_gpu)."""
        return self.tokens * self.hidden_bytes

    def nbytes(self, act_gpu: float) -> int:
        """The whole working set when the activation placement keeps act_gpu of them there."""
        return round(act_gpu * self.tokens) * self.hidden_bytes + self.compute


def working_set(model: ModelSpec, tokens: PassTokens, compress_kv: bool) -> WorkingSet:
    """Bytes of the pass's working set, in the model's compute dtype (ModelSpec.bytes_per_value)."""
    h, item = model.hidden_size, model.bytes_per_value
    # input, output, q, k, v and the two FFN activations of one micro-batch's rows
    layer = tokens.widest * (2 * h + model.q_dim + 2 * model.kv_dim + 2 * model.ffn_size) * item
    # K and V gathered for attention, and a second K for compressed pools (earlier blocks dequantized)
    attention = (3 if compress_kv else 2) * tokens.context_slots * model.kv_dim * item
    return WorkingSet(tokens=tokens.total, hidden_bytes=h * item,
                      compute=layer + attention + tokens.logit_rows * model.vocab_size * LOGIT_BYTES)


def worst_pass(policy: Policy, running: int, prompt_lens: Sequence[int], max_lens: Sequence[int],
               all_logits: bool = False) -> PassTokens:
    """The largest pass a batch of requests can form (prompt_lens / max_lens: each request's prompt
    and prompt + max_tokens). Decode-maximal chunks are capped by the budget, and so are recomputes
    after a preemption (prompt + outputs so far); all_logits: every row's logits are kept."""
    longest_prompt = max(prompt_lens)
    if policy.scheduler == "block":
        prompt_tokens = running * longest_prompt
    else:
        recompute = policy.kv_admission == "on-demand"  # a recompute prefills up to max_len - 1
        lengths = max_lens if recompute else prompt_lens
        longest_prompt = min(policy.prefill_budget, max(lengths))
        prompt_tokens = min(policy.prefill_budget, sum(lengths))
    total = running + prompt_tokens
    k = policy.num_gpu_batches
    widest = total if k == 1 else math.ceil(total / k) + longest_prompt
    return PassTokens(total=total, widest=min(widest, total), context_slots=running * max(max_lens),
                      logit_rows=total if all_logits else running)

