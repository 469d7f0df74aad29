"""Mixture-of-experts decode from disk: routed-only reads against whole-layer reads.

A Mixtral-shaped model (scaled down so that it builds on a small machine: the expert shape and E,
k of Mixtral, fewer layers and a narrower hidden size by default) is saved with transformers
(random weights), placed with its 4-bit weights all on the disk tier, and decoded at several batch
sizes with `routed_expert_reads` off and on. Per run: decode tok/s, experts read per layer and
pass against the layer's experts (and uniform routing's 1 - (1 - k/E)^rows), and the bytes read
per pass, as the kernel counted them (/proc/self/io read_bytes: O_DIRECT reads included, the page
cache cannot serve them).

    python scripts/bench_moe.py --batches 1,2,4,16
    python scripts/bench_moe.py --dummy mixtral-8x7b --layers 8 --batches 1,2,4   # real shapes, codes drawn

--dummy NAME runs a registered shape (policy_search/model_registry.py) at its real sizes, truncated
to --layers, with 4-bit codes drawn directly into the store (no checkpoint: a real Mixtral layer is
2.8 GB in bf16), so that a pass's fixed costs (embeddings, the head) weigh what they do in a deep
model.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import harness  # puts the repository root on sys.path
import torch

from harness import disk_read_bytes  # noqa: E402
from flexsarathi import LLM, SamplingParams  # noqa: E402
from flexsarathi.engine.llm_engine import resolve_dtype  # noqa: E402
from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from policy_search import Policy  # noqa: E402
from policy_search.model_registry import KNOWN_MODELS, known_config  # noqa: E402


def build_checkpoint(folder: str, args) -> str:
    """A random-weight Mixtral-architecture checkpoint (bf16, sharded), built once."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                           num_key_value_heads=max(1, args.hidden // 512), num_local_experts=args.experts,
                           num_experts_per_tok=args.top_k, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02) if param.dim() > 1 else param.fill_(1.0)
    model.save_pretrained(folder, max_shard_size="2GB")
    return folder


def dummy_model(args) -> str:
    """`dummy:` name of the registered shape truncated to --layers; args take its sizes."""
    config = {**known_config(args.dummy), "num_hidden_layers": args.layers}
    name = f"{args.dummy}-{args.layers}l"
    KNOWN_MODELS[name] = config
    args.hidden, args.vocab = config["hidden_size"], config["vocab_size"]
    args.ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    args.experts = config.get("num_local_experts") or config["num_experts"]
    args.top_k = config["num_experts_per_tok"]
    return f"dummy:{name}"


def run(folder: str, batch: int, routed: bool, offload: str, args) -> dict:
    policy = Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0, compress_weight=True, gpu_batch_size=batch,
                    num_gpu_batches=1, prefill_budget=batch * args.prompt_len)
    llm = LLM(folder, enable_prefix_caching=False,
              dtype=args.dtype, policy=policy, offload_dir=offload, routed_expert_reads=routed,
              **({"dummy_weight_codes": True} if folder.startswith("dummy:") else {}))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, args.vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=args.gen_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)  # warm
    weights = llm.engine.weights
    before, read_before = dict(weights.stats), disk_read_bytes()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    read = disk_read_bytes() - read_before
    stats = {k: weights.stats[k] - before[k] for k in weights.stats}
    passes = llm.last_stats["passes"]
    config = llm.engine.config
    sparse_layers = config.moe.sparse_layers(config.num_layers)
    llm.close()
    return {"tokens": [o.token_ids for o in outputs], "seconds": seconds, "passes": passes,
            "tok_s": batch * args.gen_len / seconds, "experts_read": stats["experts_read"], "bytes_read": read,
            "layer_loads": stats["expert_loads"] or passes * sparse_layers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=3584)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--gen-len", type=int, default=8)
    parser.add_argument("--batches", default="1,2,4,16")
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "flexsarathi-bench-moe"))
    parser.add_argument("--dtype", default="auto", help="compute dtype (auto: this CPU's measured choice)")
    parser.add_argument("--dummy", default=None, help="a registered MoE shape at its real sizes (e.g. mixtral-8x7b)")
    harness.add_json_option(parser, __file__)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype, torch.bfloat16, torch.device("cpu"))
    print(cpu_line(args.dtype))
    folder = dummy_model(args) if args.dummy else build_checkpoint(os.path.join(args.folder, "model"), args)
    offload = os.path.join(args.folder, "offload")
    e, k = args.experts, args.top_k
    expert_bytes = 3 * args.hidden * args.ffn // 2 * 1.0625  # 4-bit codes + fp16 scale/min per 64
    print(f"model: {args.dummy or 'mixtral-shaped'}, {args.layers} layers, hidden {args.hidden}, {e} experts of ffn {args.ffn}, "
          f"top-{k}; 4-bit weights on disk; an expert {expert_bytes / 2**20:.1f} MiB")
    print("batch  routed  tok/s   s/pass  MB read/pass  experts read/layer/pass  uniform 1-(1-k/E)^B  tokens equal")
    rows, ratios = [], {}
    for batch in (int(b) for b in args.batches.split(",")):
        results = {routed: run(folder, batch, routed, offload, args) for routed in (False, True)}
        for routed, r in results.items():
            per_layer = r["experts_read"] / r["layer_loads"] if routed else e
            print(f"{batch:5d}  {str(routed):6s}  {r['tok_s']:6.2f}  {r['seconds'] / r['passes']:6.3f}  "
                  f"{r['bytes_read'] / r['passes'] / 1e6:12.1f}  "
                  f"{per_layer:6.2f} of {e} ({per_layer / e:4.0%})        {1 - (1 - k / e) ** batch:4.0%}"
                  f"                 {results[True]['tokens'] == results[False]['tokens']}")
            rows.append({"batch": batch, "routed": routed, "tok_s": r["tok_s"], "s_per_pass": r["seconds"] / r["passes"],
                         "mb_read_per_pass": r["bytes_read"] / r["passes"] / 1e6, "experts_read_per_layer": per_layer,
                         "experts": e, "uniform_share": 1 - (1 - k / e) ** batch,
                         "tokens_equal": results[True]["tokens"] == results[False]["tokens"]})
        whole, routed_only = results[False], results[True]
        print(f"       routed / whole: {routed_only['tok_s'] / whole['tok_s']:.2f}x tok/s, "
              f"{routed_only['bytes_read'] / max(1, whole['bytes_read']):.2f}x bytes read")
        ratios[f"batch_{batch}_routed_over_whole_tok_s"] = routed_only["tok_s"] / whole["tok_s"]
        ratios[f"batch_{batch}_routed_over_whole_bytes"] = routed_only["bytes_read"] / max(1, whole["bytes_read"])
    harness.write_result(args, rows, ratios, dtype=args.dtype)


if __name__ == "__main__":
    main()
