"""Attention of query rows against a sequence's cached keys and values: pure math.

Every attention call is a padded batch of sequences that each bring `n` query rows at known
absolute positions and a context of `kv_len` cached tokens (the new tokens included). Decodes are
batched together (n = 1); a prompt chunk [a, b) is one sequence with n = b - a and kv_len = b, so
it sees all earlier tokens of its sequence and is causal within itself: chunked prefill is the same
math as whole-prompt prefill.

Scores and softmax are accumulated in fp32. The log-sum-exp of every row is returned so that
partial attentions over disjoint pieces of a context (e.g. a cache split across tiers) merge exactly.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

_QUERY_BLOCK = 256  # query rows per step: bounds the [heads, rows, context] score buffer


class _HostWorkspace(threading.local):
    """Grow-only fp32 buffers for the K/V copies of host attention, one set per thread.

    A decode pass's context copies are tens of MB per layer, above glibc's mmap threshold: fresh
    ones would be new mappings faulted in on first touch (docs/DESIGN.md, "Tried"). Reused buffers
    fault once. CUDA tensors do not need this (the caching allocator reuses blocks)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        numel = torch.Size(shape).numel()
        key = f"{name}:{dtype}"
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                buf = self.buffers[key] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(shape)


_HOST_WORKSPACE = _HostWorkspace()


def release_host_buffers() -> None:
    """Free this thread's reused attention buffers (they grow to the largest decode context seen;
    LLMEngine.close() calls this). Later calls simply allocate them again."""
    _HOST_WORKSPACE.buffers.clear()


def _fp32_heads_first(x: torch.Tensor, name: str) -> torch.Tensor:
    """[B, L, kvh, d] -> [B, kvh, L, d] fp32, contiguous (rows of d stay contiguous, so the copy
    streams; the score matmul then uses K transposed in place rather than a transposing copy)."""
    batch, length, kv_heads, dim = x.shape
    if x.device.type != "cpu":
        return x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    shape = (batch, kv_heads, length, dim)
    out = _HOST_WORKSPACE.take(name, shape)
    if x.dtype == torch.float32:
        return out.copy_(x.transpose(1, 2))
    # Transpose in the narrow type, then widen contiguously: faster than one transposing, widening
    # copy (measured: docs/BENCHMARKS.md, "Smaller measurements behind code comments").
    staged = _HOST_WORKSPACE.take(name, shape, x.dtype).copy_(x.transpose(1, 2))
    return out.copy_(staged)


# PyTorch's CPU flash-attention kernel (the one F.scaled_dot_product_attention uses on CPU),
# called directly because it also returns the log-sum-exp that merging partial attentions needs.
# It accumulates in fp32 for bf16/fp16 inputs, reads K/V strided (no copies), handles grouped-query
# heads, and tiles the scores. Measured on 2 cores: 4.6x faster than the matmul path below for a
# 256-row prompt chunk, but 2-3x slower for bf16 decode rows (one query per sequence), which
# therefore keep the matmul path; fp32 decode rows take it too (0.27-0.70 of the matmul path's
# time in four runs of scripts/bench_attention_lse.py, docs/GPU.md).
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_MIN_ROWS = 16  # half-precision query rows per sequence from which the flash kernel is used
# Query rows per flash call in longer chunks (_attend_flash). Measured on 2 cores, 32 heads of 128:
# a 512-row causal chunk 49 ms whole, 40.5 in tiles of 128 or 256, 46 in tiles of 64 (small calls
# run the kernel less efficiently); under a compressed cache's block rule tiles of one block.
_FLASH_TILE = 128
_FLASH_MIN_TILE = 32


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           kv_len: torch.Tensor, scale: float, sliding_window: int | None = None,
           kv_pos_offset: int | torch.Tensor = 0,
           key_blocks: tuple[int, str] | None = None,
           kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, n, heads, d]; k, v: [B, L, kv_heads, d]; q_pos: [B, n]; kv_len: [B].

    Key j of sequence b (absolute position kv_pos_offset + j) is visible to query i when
    j < kv_len[b], position <= q_pos[b, i], and (with a sliding window) position > q_pos - window.
    key_blocks=(block_size, "before" | "same") further keeps only keys in blocks before the
    query's block, or in the query's own block (a cache whose complete blocks are stored
    differently from the block being filled is attended as those two parts, then merged).
    Returns out [B, n, heads, d] in q's dtype and lse [B, n, heads] in fp32 (-inf where a row sees
    no key, which only happens for a partial context; its output is then 0).
    kernel: "auto" (on the CPU flash for fp32 and for half-precision prompt chunks, matmuls
    otherwise), "flash" or "matmul".
    """
    n = q.shape[1]

    def visible(start: int, stop: int) -> torch.Tensor:  # [B, rows, L]
        return visible_keys(q_pos[:, start:stop], kv_len, k.shape[1], kv_pos_offset, sliding_window, key_blocks)

    if kernel == "auto":
        use_flash = (_FLASH is not None and q.device.type == "cpu"
                     and (q.dtype == torch.float32 or (n >= _FLASH_MIN_ROWS and q.dtype in (torch.bfloat16, torch.float16))))
        kernel = "flash" if use_flash else "matmul"
    if kernel == "flash":  # under a block rule, tiles of one block: the "same" part is then block-diagonal
        tile_rows = max(_FLASH_MIN_TILE, key_blocks[0]) if key_blocks is not None else _FLASH_TILE
        return _attend_flash(q, k, v, visible(0, n), scale, tile_rows)
    if kernel != "matmul":
        raise ValueError(f"attend: kernel must be 'auto', 'flash' or 'matmul', got {kernel!r}")
    return _attend_matmul(q, k, v, visible, scale)


def visible_keys(q_pos: torch.Tensor, kv_len: torch.Tensor, length: int, kv_pos_offset: int | torch.Tensor = 0,
                 sliding_window: int | None = None, key_blocks: tuple[int, str] | None = None) -> torch.Tensor:
    """[B, rows, L] bool: which of `length` keys each query row sees (attend's rule). q_pos: [B, rows]."""
    index = torch.arange(length, device=q_pos.device)  # [L]
    # no op for the usual offset 0 (a decode's mask is built every pass; each op costs ~1.5 us)
    offset = kv_pos_offset if isinstance(kv_pos_offset, int) else kv_pos_offset[:, None, None]
    key_pos = index if isinstance(offset, int) and offset == 0 else index + offset
    qp = q_pos[:, :, None]  # [B, rows, 1]
    mask = (index < kv_len[:, None, None]) & (key_pos <= qp)
    if sliding_window is not None:
        mask &= key_pos > qp - sliding_window
    if key_blocks is not None:
        size, rule = key_blocks
        same = (key_pos // size) == (qp // size)
        mask &= same if rule == "same" else (key_pos // size) < (qp // size)
    return mask


# Keys per bias row are padded to this many elements: the GPU's memory-efficient attention kernel
# wants its bias rows aligned and otherwise pads a copy on every call.
_BIAS_ALIGN = 16


def decode_bias(q_pos: torch.Tensor, kv_len: torch.Tensor, length: int, dtype: torch.dtype,
                kv_pos_offset: int | torch.Tensor = 0, sliding_window: int | None = None) -> torch.Tensor:
    """The additive mask of a decode group (one query row per sequence, q_pos [B, 1]) over `length`
    keys: [B, 1, 1, L] in `dtype`, 0 where a key is visible and -inf elsewhere (attend's rule).
    The same for every layer of a pass: the executor builds it once per pass."""
    visible = visible_keys(q_pos, kv_len, length, kv_pos_offset, sliding_window)  # [B, 1, L]
    padded = -(-length // _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.full((q_pos.shape[0], 1, 1, padded), float("-inf"), dtype=dtype, device=q_pos.device)
    return bias[..., :length].masked_fill_(visible[:, None], 0.0)


def attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per sequence against its keys, where no log-sum-exp is wanted (the whole
    context is one part): one fused attention call (scaled_dot_product_attention: the efficient or
    flash kernel, fp32 accumulation inside), no fp32 copies of K and V. q: [B, 1, heads, d]; k, v:
    [B, L, kv_heads, d]; bias: decode_bias's. Returns out [B, 1, heads, d] in q's dtype. Every row
    must see at least one key (a decode sees itself). Grouped-query heads: the `group` query heads
    of a kv head are that many rows of one call (they share the sequence's bias), so K and V are
    never repeated."""
    batch, _, heads, dim = q.shape
    kv_heads = k.shape[2]
    out = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, heads // kv_heads, dim), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=bias, scale=scale)  # [B, kvh, group, d]
    # A view where the kernel's output layout allows it (the CPU's, CUDA's flash kernel); CUDA's
    # memory-efficient kernel (fp32) lays grouped heads out query-row-major: one copy then.
    return out.reshape(batch, 1, heads, dim)


def attend_own_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Prompts whose keys are exactly their own query rows (whole prompts, or first chunks), where no
    log-sum-exp is wanted: query i of each sequence sees keys 0..i of it, one fused causal call
    (scaled_dot_product_attention: flash kernels, fp32 accumulation inside; no mask, no score buffer,
    no fp32 copies of K and V; grouped-query heads read in place). q: [B, n, heads, d]; k, v:
    [B, n, kv_heads, d]. Returns out [B, n, heads, d] in q's dtype."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=q.shape[2] != k.shape[2])  # [B, heads, n, d]
    return out.transpose(1, 2)


def attend_own_rows_by_block(q: torch.Tensor, k_before: torch.Tensor, k_same: torch.Tensor, v: torch.Tensor,
                             block_size: int, scale: float) -> torch.Tensor:
    """attend_own_rows over a compressed cache's keys: query block c sees the earlier blocks' keys as
    they are stored (k_before) and its own block's exact (k_same), causally, V as stored: what the
    "before" and "same" key rules give merged, in one fused call per block (the keys side by side,
    a lower-right causal mask of [block rows, keys]), no log-sum-exp. Shapes as attend_own_rows'."""
    n = q.shape[1]
    out = torch.empty_like(q)
    for start in range(0, n, block_size):
        stop = min(start + block_size, n)
        keys = torch.cat((k_before[:, :start], k_same[:, start:stop]), dim=1) if start else k_same[:, :stop]
        mask = torch.arange(stop, device=q.device) <= torch.arange(start, stop, device=q.device)[:, None]
        out[:, start:stop] = F.scaled_dot_product_attention(
            q[:, start:stop].transpose(1, 2), keys.transpose(1, 2), v[:, :stop].transpose(1, 2), attn_mask=mask,
            scale=scale, enable_gqa=q.shape[2] != k_same.shape[2]).transpose(1, 2)
    return out


def _attend_flash(q, k, v, visible: torch.Tensor, scale: float, tile_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows in tiles of `tile_rows`, each trimmed to its rows that see some key and to the
    keys those rows see: the kernel computes every masked score, so a long chunk's causal mask and
    a compressed cache's block rules (its "before" part: a prompt's first block sees nothing; its
    "same" part: each block only itself) would otherwise cost the whole rows x keys product
    (docs/BENCHMARKS.md, "Smaller measurements")."""
    batch, n = q.shape[:2]
    seen = visible.any(dim=0)  # [n, L]: keys any sequence's row sees
    if n <= tile_rows and bool(seen.all()):
        return _flash_call(q, k, v, visible, scale)
    out = q.new_zeros(q.shape)  # rows that see no key: out 0, lse -inf
    lse = torch.full((batch, n, q.shape[2]), float("-inf"), device=q.device)
    for start in range(0, n, tile_rows):
        tile = seen[start:start + tile_rows]
        rows, cols = tile.any(dim=1).nonzero(), tile.any(dim=0).nonzero()
        if rows.numel() == 0:
            continue
        r0, r1, c0, c1 = start + int(rows[0]), start + int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        out[:, r0:r1], lse[:, r0:r1] = _flash_call(q[:, r0:r1], k[:, c0:c1], v[:, c0:c1], visible[:, r0:r1, c0:c1],
                                                   scale)
    return out, lse


def _flash_call(q, k, v, visible: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out, lse = _FLASH(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
                      attn_mask=bias[:, None], scale=scale)  # out [B, heads, n, d], lse [B, heads, n]
    out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    blind = ~visible.any(-1)  # [B, n]: rows that see no key (the kernel gives them lse 0)
    if bool(blind.any()):
        out = out.masked_fill(blind[:, :, None, None], 0.0)
        lse = lse.masked_fill(blind[:, :, None], float("-inf"))
    return out.contiguous(), lse.contiguous()


def _attend_matmul(q, k, v, visible, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 scores and softmax in blocks of query rows (see attend)."""
    batch, n, heads, dim = q.shape
    length, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    kf = _fp32_heads_first(k, "k")  # [B, kvh, L, d]
    vf = _fp32_heads_first(v, "v")  # [B, kvh, L, d]
    outs, lses = [], []
    for start in range(0, n, _QUERY_BLOCK):
        stop = min(n, start + _QUERY_BLOCK)
        rows = stop - start
        # [B, rows, kvh, g, d] -> [B, kvh, g*rows, d]: GQA without repeating K/V.
        qb = q[:, start:stop].float().view(batch, rows, kv_heads, group, dim)
        qb = qb.permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, group * rows, dim)
        scores = torch.matmul(qb, kf.transpose(-1, -2)).mul_(scale).view(batch, kv_heads, group, rows, length)
        scores.masked_fill_(~visible(start, stop)[:, None, None], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [B, kvh, g, rows]
        probs = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).min))
        probs = torch.nan_to_num_(probs, nan=0.0)
        out = torch.matmul(probs.view(batch, kv_heads, group * rows, length), vf)
        outs.append(out.view(batch, kv_heads, group, rows, dim).permute(0, 3, 1, 2, 4)
                    .reshape(batch, rows, heads, dim))
        lses.append(lse.permute(0, 3, 1, 2).reshape(batch, rows, heads))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    return out.to(q.dtype), lse


def merge_partial_attention(parts: list[tuple[torch.Tensor, torch.Tensor]],
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Exact softmax over a union of disjoint key sets from per-part (out, lse) pairs.

    out: [..., heads, d], lse: [..., heads]. out = sum_i exp(lse_i - lse) * out_i, where
    lse = logsumexp_i(lse_i). sinks [heads] (gpt-oss's learned logits): one more term per head in
    every row's softmax denominator (lse), with no value: a key that only takes weight away.
    """
    lses = torch.stack([lse for _, lse in parts])  # [P, ..., heads]
    if sinks is not None:  # [1, ..., heads]: the sink as a part whose output is 0
        lses_and_sink = torch.cat((lses, sinks.float().expand(lses.shape[1:])[None]))
        total = torch.logsumexp(lses_and_sink, dim=0)
    else:
        total = torch.logsumexp(lses, dim=0)
    weights = torch.nan_to_num(torch.exp(lses - total), nan=0.0)  # rows seeing no key weigh 0
    merged = sum(w.unsqueeze(-1) * o.float() for w, (o, _) in zip(weights, parts))
    return merged.to(parts[0][0].dtype)
