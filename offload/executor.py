"""The pass executor: ONE loop, layer-major and micro-batch-minor (FlexGen's zig-zag order).

    for layer j:
        start loading layer j+1's weights
        for micro-batch k:
            compute layer j on micro-batch k (attention next to where its KV lives)
        release layer j

Each layer's weights are brought to the compute device once per pass and reused by every
micro-batch. The model is injected (offload/ never imports flexsarathi/): any object with
`embed`, `qkv`, `attend`, `finish` and `logits` as in flexsarathi.models.base.
"""
from __future__ import annotations

import torch

from offload.batch import AttentionGroup, MicroBatch
from offload.kv_cache import KVPool
from offload.weights import LayerWeightStore


class PassExecutor:
    def __init__(self, math, weights: LayerWeightStore, kv_pools: dict[str, KVPool],
                 device: torch.device, dtype: torch.dtype):
        self.math, self.weights, self.kv_pools = math, weights, kv_pools
        self.device, self.dtype = torch.device(device), dtype

    @torch.inference_mode()
    def run(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Runs one pass; returns, per micro-batch, fp32 logits of its `logit_rows` [R, vocab]."""
        batches = [mb.to(self.device) for mb in micro_batches]
        g = self.weights.global_weights()
        hidden = [self.math.embed(g, mb.token_ids, mb.positions).to(self.dtype) for mb in batches]
        num_layers = self.weights.num_layers
        self.weights.prefetch(0)
        for layer in range(num_layers):
            w = self.weights.get(layer)
            if layer + 1 < num_layers:
                self.weights.prefetch(layer + 1)
            for k, mb in enumerate(batches):
                hidden[k] = self._layer(layer, w, mb, hidden[k])
            self.weights.release(layer)
        return [self.math.logits(g, h[mb.logit_rows]) for h, mb in zip(hidden, batches)]

    def _layer(self, layer: int, w, mb: MicroBatch, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.math.qkv(w, hidden, mb.positions)  # [T, heads|kv_heads, head_dim]
        attn = torch.empty_like(q)
        for group in mb.groups:
            attn[group.token_rows] = self._attend(layer, group, q, k, v)
        return self.math.finish(w, hidden, attn.flatten(1))  # [T, hidden]

    def _attend(self, layer: int, group: AttentionGroup, q, k, v) -> torch.Tensor:
        pool = self.kv_pools[group.kv_tier]
        pool.store(layer, group.store_slots, k[group.token_rows], v[group.token_rows])
        k_ctx, v_ctx = pool.gather(layer, group.kv_slots)  # [B, L, kv_heads, head_dim]
        q_group = q[group.token_rows].unflatten(0, (group.num_seqs, group.num_queries))
        out, _ = self.math.attend(q_group, k_ctx.to(self.device), v_ctx.to(self.device),
                                  group.q_pos, group.kv_len)
        return out.flatten(0, 1)  # [B * n, heads, head_dim]
