"""The working set of a pass: compute-device bytes beyond the weights and the KV pools.

One formula for the engine's budget check (flexsarathi/engine/llm_engine.py: every pass, and the largest pass
a batch of requests can form, checked before any work) and the planner's memory model
(cost_model._memory), in plain arithmetic on model dims: the engine passes numbers, the planner
affine expressions in the placement fractions (policy_search/linear.py). What it charges is what
offload/executor.py holds on the compute device at once (docs/DESIGN.md, "Working set"):
  * the parked hidden states kept on the gpu tier (act_gpu of the pass's rows);
  * one micro-batch's layer intermediates, and the next micro-batch's input being loaded;
  * the K/V context gathered onto the compute device for the micro-batch computing and the next
    one (the executor loads k+1 before computing k). Not gathered: decode context attended on the
    CPU (cpu_attention, KV off the gpu tier) and a prompt chunk whose keys are all its own new rows;
  * the fp32 K/V copies and fp32 scores of the largest decode and the largest prompt attention call;
  * every micro-batch's fp32 logits (the pass returns them together).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from policy_search.model_spec import ModelSpec
from policy_search.policy import TIERS, Policy

LOGIT_BYTES = 4  # logits are kept in fp32
SCORE_BYTES = 4  # attention scores and the K/V copies they are computed from are fp32
QUERY_BLOCK = 256  # query rows per score buffer (flexsarathi/models/attention.py _QUERY_BLOCK)


@dataclass(frozen=True)
class PassTokens:
    total: int  # tokens of the pass, all micro-batches
    widest: int  # tokens of its largest micro-batch
    context_slots: int  # K/V slots gathered onto the compute device at once (2 micro-batches)
    attention_slots: int  # keys of the largest decode call + the largest prompt call on the device
    attention_cells: int  # (query row, key) pairs of one score buffer of each of those two calls
    logit_rows: int  # rows of the LM head's output, all micro-batches


@dataclass(frozen=True)
class WorkingSet:
    tokens: int  # of the pass
    hidden_bytes: int  # one token's hidden state
    compute: int  # everything but the parked hidden states

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
    # input, output, q, k, v, the two FFN activations of one micro-batch (a MoE layer's: every
    # routed expert's rows, and the router's logits), the next one's input
    ffn = 2 * model.ffn_activation_width + model.num_experts
    layer = tokens.widest * (3 * h + model.q_dim + 2 * model.kv_dim + ffn) * item
    # K and V gathered, and a second K for compressed pools (earlier blocks dequantized)
    context = (3 if compress_kv else 2) * tokens.context_slots * model.kv_dim * item
    attention = (tokens.attention_slots * 2 * model.kv_dim
                 + tokens.attention_cells * 2 * model.num_heads) * SCORE_BYTES  # scores and probs
    return WorkingSet(tokens=tokens.total, hidden_bytes=h * item,
                      compute=layer + context + attention + tokens.logit_rows * model.vocab_size * LOGIT_BYTES)


def gathered_tiers(policy: Policy, decode: bool) -> tuple[str, ...]:
    """KV tiers whose context the executor gathers onto the compute device (offload/executor.py
    attention_device): decodes attend off-gpu tiers on the CPU under cpu_attention."""
    return ("gpu",) if decode and policy.cpu_attention else TIERS


def decode_context(policy: Policy, max_len: int, pool_slots: Mapping[str, int]) -> int:
    """Upper bound on the slots one decoding sequence gathers onto the compute device. A decode
    group is padded per tier to its longest member's part there, so a group whose members split
    their context differently across tiers can pad to one max_len per tier; a part never exceeds
    its tier's pool."""
    return sum(min(max_len, pool_slots.get(t, 0)) for t in gathered_tiers(policy, decode=True))


def worst_pass(policy: Policy, running: int, prompt_lens: Sequence[int], max_lens: Sequence[int],
               pool_slots: Mapping[str, int], all_logits: bool = False) -> PassTokens:
    """The largest pass a batch of requests can form (prompt_lens / max_lens: each request's prompt
    and prompt + max_tokens; pool_slots: KV slots per tier). Decode-maximal chunks are capped by the
    budget, and so are recomputes after a preemption (prompt + outputs so far); all_logits: every
    row's logits are kept."""
    longest_prompt, max_len = max(prompt_lens), max(max_lens)
    if policy.scheduler == "block":  # whole prompts: their keys are all new, nothing is gathered
        prompt_tokens, chunk_context = running * longest_prompt, 0
    else:  # any prompt may be cut where a pass's budget runs out: later chunks gather their prefix
        recompute = policy.kv_admission == "on-demand"  # a recompute prefills up to max_len - 1
        lengths = max_lens if recompute else prompt_lens
        longest_prompt = min(policy.prefill_budget, max(lengths))
        prompt_tokens = min(policy.prefill_budget, sum(lengths))
        chunk_context = max_len  # a chunk attends alone: its parts add up to its context
    total = running + prompt_tokens
    k = policy.num_gpu_batches
    widest = min(total if k == 1 else math.ceil(total / k) + longest_prompt, total)
    decode = decode_context(policy, max_len, pool_slots)
    # Each sequence is in one micro-batch; two micro-batches hold at most 2 * widest of them.
    held = running if k == 1 else min(running, 2 * widest)
    decoders = min(running, widest)
    return PassTokens(total=total, widest=widest, context_slots=held * max(decode, chunk_context),
                      attention_slots=decoders * min(decode, max_len) + max_len,
                      attention_cells=decoders * min(decode, max_len) + min(longest_prompt, QUERY_BLOCK) * max_len,
                      logit_rows=total if all_logits else running)
