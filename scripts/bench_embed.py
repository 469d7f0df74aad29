#!/usr/bin/env python
"""Embedding throughput: `LLM(task="embed").embed` beside what a user runs instead, transformers'
AutoModel the way sentence-transformers drives it (texts sorted by length, batches padded to their
longest, the last real token's hidden state, L2-normalized), on the same token ids of a checkpoint
of Qwen3-Embedding-0.6B's shape (random weights, written once under --folder). The two take turns
(harness.alternate); prints each one's seconds, prompt tokens per second and the ratio, and the
smallest cosine between the two engines' embeddings of a text; asserts nothing.

    .venv/bin/python scripts/bench_embed.py                        # 64 texts of 32-256 tokens, fp32
    .venv/bin/python scripts/bench_embed.py --layers 4 --texts 16  # a quick look
    .venv/bin/python scripts/bench_embed.py --dtype bfloat16 --hf-batch 32

Ours packs each pass with up to the policy's prefill budget of prompt tokens, with no padding; the
baseline pads each batch to its longest text (sorted, so little).
"""
from __future__ import annotations

import argparse
import os
import random

import torch

import harness  # puts the repository root on sys.path
from flexsarathi import LLM
from flexsarathi.machine.cpu_info import cpu_line

# Qwen3-Embedding-0.6B's config.json shape (its weights are not needed: the work is the same)
SHAPE = dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151669, max_position_embeddings=32768,
             rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)


def checkpoint(folder: str, layers: int) -> str:
    """A checkpoint of SHAPE with `layers` layers and random weights (written once; bf16 on disk)."""
    path = os.path.join(folder, f"qwen3-embedding-0.6b-shape-{layers}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.for_model(**{**SHAPE, "num_hidden_layers": layers})
        torch.manual_seed(0)
        AutoModel.from_config(config).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def texts(count: int, shortest: int, longest: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


def hf_embed(model, prompts: list[list[int]], batch: int) -> list[torch.Tensor]:
    """sentence-transformers' route: longest first, each batch right-padded to its longest text."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[torch.Tensor | None] = [None] * len(prompts)
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            chunk = order[start:start + batch]
            width = len(prompts[chunk[0]])
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[row, :len(prompts[i])] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, width, hidden]
            last = hidden[torch.arange(len(chunk)), mask.sum(1) - 1].float()
            for row, i in enumerate(chunk):
                out[i] = torch.nn.functional.normalize(last[row], dim=-1)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--shortest", type=int, default=32)
    p.add_argument("--longest", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--hf-batch", type=int, default=16, help="the baseline's batch (sentence-transformers: 32)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--folder", default="/tmp/fs_bench_embed")
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    from transformers import AutoModel

    path = checkpoint(args.folder, args.layers)
    prompts = texts(args.texts, args.shortest, args.longest, SHAPE["vocab_size"])
    tokens = sum(map(len, prompts))
    dtype = getattr(torch, args.dtype)
    print(f"{cpu_line()}; {torch.get_num_threads()} threads; Qwen3-Embedding-0.6B shape, {args.layers} layers, "
          f"{args.dtype}; {args.texts} texts of {args.shortest}-{args.longest} tokens ({tokens} tokens)")
    hf = AutoModel.from_pretrained(path, dtype=dtype).eval()
    with LLM(path, enable_prefix_caching=False, dtype=args.dtype, task="embed") as llm:
        got = {}
        engines = {"transformers": lambda: got.__setitem__("transformers", hf_embed(hf, prompts, args.hf_batch)),
                   "flexsarathi": lambda: got.__setitem__("flexsarathi", [
                       torch.tensor(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False)])}
        timed = harness.alternate(engines, args.rounds)
    cosine = min(float(a @ b) for a, b in zip(got["transformers"], got["flexsarathi"]))
    rows = [{"engine": name, "seconds": timed.median(name), "prompt_tok_s": tokens / timed.median(name)}
            for name in engines]
    for line in harness.ratio_table(rows, "engine", "prompt_tok_s", "transformers", "tok/s"):
        print(line)
    ratio = timed.median_pair_ratio("transformers", "flexsarathi")
    print(f"transformers / flexsarathi seconds, median of pairs: {ratio:.3f}; smallest cosine between the "
          f"engines' embeddings: {cosine:.6f}")
    harness.write_result(args, rows, {"transformers / flexsarathi seconds": ratio}, dtype=args.dtype,
                         note=f"smallest cosine {cosine:.6f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
