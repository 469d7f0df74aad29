"""The contract every model family fulfils: pure functions of (weights, activations, metadata).

A layer is split at attention so that the executor decides where attention runs (next to the KV
cache, on the compute device or the CPU) and the model never knows where a weight came from:

    hidden = embed(globals, token_ids, positions)              # [T, hidden]
    for each layer j:
        q, k, v = qkv(weights, hidden, positions, j)           # [T, heads|kv_heads, head_dim]
        attn = attend(q, k_ctx, v_ctx, ..., window_of(j))       # per sequence, against the cache
        hidden = post_attention(layer, hidden, attn)            # o_proj, residual, MLP
    logits = logits(globals, hidden[rows])                      # [rows, vocab] fp32

Weights are dicts of canonical names (`qkv_proj.weight`, ...); q/k/v and gate/up projections are
fused at load time so that each layer moves as few tensors as possible.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from flexsarathi.models import attention
from flexsarathi.models.model_config import ModelConfig

Weights = dict[str, torch.Tensor]
# a multimodal checkpoint's text model, per transformers version: where "model." / "lm_head." stand in text-only names
_NESTED = (("model.", ("language_model.model.", "model.language_model.")),
           ("lm_head.", ("language_model.lm_head.",)))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


@dataclass(frozen=True)
class StackedExperts:
    """How a checkpoint stores a layer weight as one tensor over all E experts (transformers'
    gpt-oss) rather than as the row blocks hf_layer_names concatenates: a weight as [E, in, out] (or
    MXFP4: `<name>_blocks` [E, out, in / 32, 16] and `<name>_scales` [E, out, in / 32]), a bias as
    [E, out]. Read as E row blocks [out, in] (biases [out]) one after the other, each expert's rows
    de-interleaved where `interleaved` (its gate and up rows alternate: rows 0, 2, 4, ... then 1, 3, ...)."""
    bias: bool = False
    interleaved: bool = False


class ModelMath(ABC):
    config: ModelConfig

    def __init__(self, config: ModelConfig):
        self.config = config
        self.scale = config.attention_scale or config.head_dim ** -0.5  # of q . k

    # ---- shapes (used by loaders, dummy weights and placement) -----------------------------
    @abstractmethod
    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        ...

    @abstractmethod
    def layer_shapes(self, layer: int = 0) -> dict[str, tuple[int, ...]]:
        """Canonical weight -> shape of `layer` (layers of a mixture-of-experts model may differ:
        dense MLP layers among sparse ones)."""
        ...

    def weight_kinds(self) -> dict[str, tuple[int, ...]]:
        """Every canonical layer weight any layer has -> its shape (the first layer that has it):
        a mixture-of-experts model's dense and sparse layers hold different kinds."""
        kinds: dict[str, tuple[int, ...]] = {}
        for layer in range(self.config.num_layers):
            for name, shape in self.layer_shapes(layer).items():
                kinds.setdefault(name, tuple(shape))
        return kinds

    def part_rows(self, name: str, layer: int = 0) -> tuple[int, ...]:
        """Rows of each checkpoint tensor that the 2-D layer weight `name` stacks, in hf_layer_names order
        (q, k and v in `qkv_proj.weight`): equal parts unless a family says otherwise."""
        parts, rows = len(self.hf_layer_names(layer)[name]), self.layer_shapes(layer)[name][0]
        return (rows // parts,) * parts

    def expert_stacks(self) -> dict[str, int]:
        """2-D weights that are experts stacked by rows -> how many (each expert a contiguous row
        range of equal size): placement keeps an expert's rows addressable on their own."""
        return {}

    def resident_weights(self) -> frozenset[str]:
        """2-D weights kept on the compute device uncompressed, like norms (routers: tiny, and a
        4-bit router would change which experts a token goes to)."""
        return frozenset()

    @abstractmethod
    def hf_layer_names(self, layer: int) -> dict[str, list[str]]:
        """Canonical layer weight -> the HF tensor names it is made of (concatenated on dim 0)."""
        ...

    @abstractmethod
    def hf_global_names(self) -> dict[str, list[str]]:
        ...

    def stacked_experts(self, layer: int) -> dict[str, StackedExperts]:
        """Canonical layer weights stored as one tensor over all experts (their one hf_layer_names
        name): how (StackedExperts). Empty for most families."""
        return {}

    def stored_names(self, hf_name: str) -> tuple[str, ...]:
        """Where a checkpoint may store the tensor hf_layer_names / hf_global_names call `hf_name`,
        besides that name: some OPT checkpoints drop the leading "model."; a multimodal checkpoint
        (config.nests_text_model) nests the text model, as transformers 4 (`language_model.model.*`) or
        5 (`model.language_model.*`) names it."""
        if not self.config.nests_text_model:
            return (hf_name.removeprefix("model."),)
        return tuple(nested + hf_name[len(plain):] for plain, prefixes in _NESTED if hf_name.startswith(plain)
                     for nested in prefixes)

    def unread_prefixes(self) -> tuple[str, ...]:
        """Name prefixes of a checkpoint's tensors this model never reads (a multimodal one's vision tower
        and projector; glm4_moe's multi-token-prediction layers after the last layer)."""
        c = self.config
        mtp = tuple(f"model.layers.{c.num_layers + i}." for i in range(c.unread_layers))
        return (_VISION if c.nests_text_model else ()) + mtp

    # A *ForSequenceClassification checkpoint's head: transformers' `score` linear over the final
    # hidden state (OPT's after project_out), no bias, read as a global weight.
    CLASSIFIER = "score.weight"
    CLASSIFIER_NAMES = {CLASSIFIER: ["score.weight"]}

    def classifier_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        return {} if c.classifier is None else {self.CLASSIFIER: (c.classifier.num_labels, c.embed_dim)}

    # ---- math ------------------------------------------------------------------------------
    @abstractmethod
    def embed(self, g: Weights, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def qkv(self, w: Weights, hidden: torch.Tensor, positions: torch.Tensor, layer: int = 0):
        """q [T, heads, d], k, v [T, kv_heads, d] of decoder layer `layer` (whose weights `w` are)."""

    @abstractmethod
    def post_attention(self, w: Weights, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def logits(self, g: Weights, hidden: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def final_hidden(self, g: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states after the last layer as the head reads them (transformers'
        last_hidden_state): what an embedding pools."""

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: every earlier key); config.windows lists them all."""
        return self.config.window_of(layer)

    def attend(self, q, k, v, q_pos, kv_len, window, kv_pos_offset=0, key_blocks=None):
        return attention.attend(q, k, v, q_pos, kv_len, self.scale, window, kv_pos_offset, key_blocks)

    def decode_bias(self, q_pos, kv_len, length, dtype, window, kv_pos_offset=0):
        return attention.decode_bias(q_pos, kv_len, length, dtype, kv_pos_offset, window)

    def attend_decode(self, q, k, v, bias):
        return attention.attend_decode(q, k, v, bias, self.scale)

    def attend_own_rows(self, q, k, v):
        return attention.attend_own_rows(q, k, v, self.scale)

    def attend_own_rows_by_block(self, q, k_before, k_same, v, block_size):
        return attention.attend_own_rows_by_block(q, k_before, k_same, v, block_size, self.scale)

    def merge_attention(self, parts, w: Weights | None = None):
        """The parts' (out, lse) merged; w: the layer's weights (a family with attention sinks reads them)."""
        return attention.merge_partial_attention(parts)

    def _qkv_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The fused projection's output [T, (h + 2 kvh) * d] as heads [T, h + 2 kvh, d] (a view of
        a contiguous output)."""
        c = self.config
        return qkv.reshape(qkv.shape[0], c.num_heads + 2 * c.num_kv_heads, c.head_dim)

    def _split_heads(self, heads: torch.Tensor):
        """_qkv_heads' heads as q [T, h, d], k, v [T, kvh, d] (views)."""
        c = self.config
        # one call for the three views: split_with_sizes is a single dispatch (three `heads[:, a:b]`
        # index calls cost 3x its host time; Tensor.split's Python wrapper more again), and a
        # decode layer on a GPU is host-bound
        return heads.split_with_sizes((c.num_heads, c.num_kv_heads, c.num_kv_heads), 1)

    def _split_qkv(self, qkv: torch.Tensor):
        return self._split_heads(self._qkv_heads(qkv))
