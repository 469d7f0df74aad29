"""The working set of a pass: compute-device bytes beyond the weights and the KV pools.

One formula for the engine's budget check (flexsarathi/engine/llm_engine.py: every pass, and the largest pass
a batch of requests can form, checked before any work) and the planner's memory model
(cost_model._memory), in plain arithmetic on model dims: the engine passes numbers, the planner
affine expressions in the placement fractions (policy_search/linear.py). What it charges is what
offload/executor.py holds on the compute device at once (docs/DESIGN.md, "Working set"):
  * the parked hidden states kept on the gpu tier (act_gpu of the pass's rows);
  * one micro-batch's layer tensors (its input, fused q/k/v, rotated q and k, the attention output,
    the output of the layer after attention, the rotary tables), one slice's intermediates of the
    layer after attention (POST_ATTENTION_ROWS rows: residual, normed x, FFN buffers
    ModelSpec.ffn_buffers wide, the MLP's output), and the next micro-batch's input being loaded;
  * the K/V context gathered onto the compute device for the micro-batch computing and the next
    one (the executor loads k+1 before computing k). Not gathered: decode context attended on the
    CPU (cpu_attention, KV off the gpu tier), decode context its pool attends in place
    (ModelSpec.decode_in_pool) and a prompt chunk whose keys are all its own new rows;
  * the fp32 K/V copies and fp32 scores of the largest decode and the largest prompt attention call;
    for the largest decode call attended in its pool, per key its int64 slot index and an fp32 score
    per head (the kernels' index copy and per-thread score rows, threads <= sequences);
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
INDEX_BYTES = 8  # a slot index as the in-pool decode kernels read it (int64)
# Rows of a micro-batch the layer after attention computes at once (offload/executor.py
# _post_attention): bounds the MLP's [rows, ffn] intermediates of a long prompt pass. Large enough
# that the matmuls run at full speed on a GPU and a CPU (4096 x hidden x ffn).
POST_ATTENTION_ROWS = 4096


@dataclass(frozen=True)
class PassTokens:
    total: int  # tokens of the pass, all micro-batches (the planner: an expression, as every field)
    widest: int  # tokens of its largest micro-batch
    slice_rows: int  # rows of one call of the layer after attention: min(widest, POST_ATTENTION_ROWS)
    context_slots: int  # K/V slots gathered onto the compute device at once (2 micro-batches)
    attention_slots: int  # keys of the largest decode call + the largest prompt call on the device
    attention_cells: int  # (query row, key) pairs of one score buffer of each of those two calls
    logit_rows: int  # rows of the LM head's output, all micro-batches
    in_pool_keys: int = 0  # keys of the largest decode call its pool attends in place (nothing gathered)


@dataclass(frozen=True)
class WorkingSet:
    tokens: int  # of the pass
    hidden_bytes: int  # one token's hidden state
    compute: int  # everything but the parked hidden states

    def nbytes(self, act_gpu: float) -> int:
        """The whole working set when the activation placement keeps act_gpu of them there."""
        return round(act_gpu * self.tokens) * self.hidden_bytes + self.compute


def working_set(model: ModelSpec, tokens: PassTokens, compress_kv: bool) -> WorkingSet:
    """Bytes of the pass's working set, in the model's compute dtype (ModelSpec.bytes_per_value)."""
    h, item = model.hidden_size, model.bytes_per_value
    rotary = not model.learned_positions
    # Per token of the micro-batch: its input, the next one's, the layer's output; the fused q/k/v
    # projection (v stays a view of it), q and k rotated, the attention output.
    whole = 3 * h + 2 * model.q_dim + 2 * model.kv_dim + rotary * (model.q_dim + model.kv_dim)
    # Per row of one slice after attention: the residual sum, the normed x and the MLP's output, the
    # FFN buffers (a MoE layer's: every routed expert's rows, and the router's logits).
    sliced = 3 * h + model.ffn_buffers * model.ffn_activation_width + model.num_experts
    tables = rotary * 2 * model.head_dim  # cos and sin per token of the pass (models/layers.py rope_tables)
    layer = (tokens.widest * whole + tokens.slice_rows * sliced + tokens.total * tables) * item
    # K and V gathered, and a second K for compressed pools (earlier blocks dequantized)
    context = (3 if compress_kv else 2) * tokens.context_slots * model.kv_dim * item
    attention = (tokens.attention_slots * 2 * model.kv_dim
                 + tokens.attention_cells * 2 * model.num_heads) * SCORE_BYTES  # scores and probs
    attention = attention + tokens.in_pool_keys * (INDEX_BYTES + model.num_heads * SCORE_BYTES)
    return WorkingSet(tokens=tokens.total, hidden_bytes=h * item,
                      compute=layer + context + attention + tokens.logit_rows * model.vocab_size * LOGIT_BYTES)


def gathered_tiers(policy: Policy, decode: bool) -> tuple[str, ...]:
    """KV tiers whose context is attended on the compute device (offload/executor.py
    attention_device): decodes attend off-gpu tiers on the CPU under cpu_attention. A decode's is
    gathered there unless its pool attends it in place (ModelSpec.decode_in_pool)."""
    return ("gpu",) if decode and policy.cpu_attention else TIERS


def decode_context(policy: Policy, max_len: int, pool_slots: Mapping[str, int],
                   in_pool: tuple[str, ...] = (), pooled: bool = False) -> int:
    """Upper bound on the slots one decoding sequence gathers onto the compute device (pooled: that
    its pools attend in place there instead; in_pool: those tiers). A decode group is padded per
    tier to its longest member's part there, so a group whose members split their context
    differently across tiers can pad to one max_len per tier; a part never exceeds its tier's pool."""
    return sum(min(max_len, pool_slots.get(t, 0)) for t in gathered_tiers(policy, decode=True)
               if (t in in_pool) == pooled)


def worst_passes(policy: Policy, running: int, prompt_lens: Sequence[int], max_lens: Sequence[int],
                 pool_slots: Mapping[str, int], all_logits: bool = False,
                 in_pool: tuple[str, ...] = ()) -> list[PassTokens]:
    """The largest pass of each kind the scheduler forms for a batch of requests (prompt_lens /
    max_lens: each request's prompt and prompt + max_tokens; pool_slots: KV slots per tier);
    all_logits: every row's logits are kept; in_pool: ModelSpec.in_pool_tiers. Recomputes after a
    preemption (on-demand admission) prefill up to max_len - 1 tokens.

    * block (FlexGen's lockstep): a pass of whole prompts (their keys are all new: nothing is
      gathered; a compressed pool's, grouped, are held as gathered keys, LLMEngine._pass_tokens),
      and a pass of one decode token per running sequence; never the two together.
    * decode-maximal: every running sequence decoding beside a prompt chunk of the whole budget
      (any prompt may be cut where a pass's budget runs out: a later chunk gathers its prefix).
    Micro-batches are balanced by tokens (the scheduler's _split, largest items first, each to the
    lightest: at most its share plus one item); the executor holds two micro-batches' contexts."""
    max_len, k = max(max_lens), policy.num_gpu_batches
    lengths = max_lens if policy.kv_admission == "on-demand" else prompt_lens
    decode, pooled = (decode_context(policy, max_len, pool_slots, in_pool, p) for p in (False, True))
    # One micro-batch gathers the next layer's context while this layer computes where its loads
    # leave the compute device (offload/executor.py gathers_ahead): any KV or activations off it.
    ahead = policy.kv_gpu < 1.0 or policy.act_gpu < 1.0

    def pass_tokens(decodes: int, prompt_tokens: int, longest_prompt: int, chunk_context: int,
                    prompt_keys: int, prompt_items: int, grouped_keys: int = 0) -> PassTokens:
        total = decodes + prompt_tokens
        # one decode token per item: balanced to the token; a prompt item may overhang its share
        widest = total if k == 1 else min(total, math.ceil(total / k) + (longest_prompt if prompt_tokens else 0))
        seqs = total if k == 1 else _sequences_per_micro_batch(decodes, prompt_tokens, prompt_items, k)
        # the executor holds two micro-batches: k and k + 1, or the last and the next layer's first
        held = min(decodes, 2 * seqs) if k > 1 else (2 if ahead else 1) * decodes
        grouped = min(grouped_keys, 2 * widest) if k > 1 else (2 if ahead else 1) * grouped_keys
        decoders = min(decodes, seqs)
        # a chunk's sequence is one of the running ones: each holds a decode's or a chunk's context
        per_seq = max(decode if decodes else 0, chunk_context)
        return PassTokens(total=total, widest=widest, slice_rows=min(widest, POST_ATTENTION_ROWS),
                          context_slots=held * per_seq + grouped,
                          attention_slots=decoders * min(decode, max_len) + prompt_keys,
                          attention_cells=decoders * min(decode, max_len) + min(longest_prompt, QUERY_BLOCK) * prompt_keys,
                          logit_rows=total if all_logits else running, in_pool_keys=decoders * min(pooled, max_len))

    if policy.scheduler == "block":
        longest = max(lengths)
        grouped = running * longest if policy.compress_kv else 0  # held as gathered keys (see above)
        return [pass_tokens(0, running * longest, longest, 0, longest, running, grouped),
                pass_tokens(running, 0, 0, 0, 0, 0)]
    longest = min(policy.prefill_budget, max(lengths))
    prompt_tokens = min(policy.prefill_budget, sum(lengths))
    # the budget's pieces: whole prompts, the rest of one cut in the previous pass, one cut in this
    items = min(prompt_tokens, prompt_tokens // min(prompt_lens) + 2)
    return [pass_tokens(running, prompt_tokens, longest, max_len, max_len, items)]


def _sequences_per_micro_batch(decodes: int, prompt_tokens: int, prompt_items: int, k: int) -> int:
    """At most how many sequences one of k micro-batches holds when the scheduler's _split places
    `prompt_items` prompt chunks (prompt_tokens in all), then `decodes` one-token items, each on the
    lightest. A decode lands on a micro-batch only while it is the lightest; with fewer chunks than
    micro-batches, the chunk-free ones are never heavier than the decodes shared among them, so a
    micro-batch holds at most decodes / (k - chunks) + 1 decodes, and one chunk (its own or none).
    Otherwise every item was added at a load <= the mean: ceil(total / k) + 1 items."""
    total = decodes + prompt_tokens
    if prompt_items < k:
        return min(total, math.ceil(decodes / (k - prompt_items)) + 1 + (1 if prompt_items else 0))
    return min(total, math.ceil(total / k) + 1)


def worst_pass_bytes(model: ModelSpec, policy: Policy, running: int, prompt_lens: Sequence[int],
                     max_lens: Sequence[int], pool_slots: Mapping[str, int], all_logits: bool = False) -> int:
    """The working set of the largest pass a batch can form (worst_passes), as the engine's
    fail-early check reserves it and the planner prices it."""
    in_pool = model.in_pool_tiers(policy.compress_kv)
    return max(working_set(model, tokens, policy.compress_kv).nbytes(policy.act_gpu)
               for tokens in worst_passes(policy, running, prompt_lens, max_lens, pool_slots, all_logits, in_pool))
