#!/usr/bin/env python
"""A batch job whose requests use several LoRA adapters of one base model: what serving them per
request in one engine (`LLM(enable_lora=True)`, each request's LoRARequest, requests of every
adapter in the same passes) saves over what a user ran before, one job per adapter merged into the
weights (`LLM(lora=...)`, each job streaming every weight once per pass for its own requests only),
and against transformers + PEFT's own mixed-adapter batch (`generate(..., adapter_names=[...])`,
every adapter loaded in one PeftModel; `--skip-peft` leaves it out). Side by side in one process,
rounds alternated (A B C, B C A, ...); end-to-end seconds, passes and the ratios (prints; asserts
nothing).

    .venv/bin/python scripts/bench_lora.py                    # 4 adapters x 8 requests, 32 -> 64
    .venv/bin/python scripts/bench_lora.py --adapters 8 --policy disk   # weights read from the disk store

The base checkpoint is a LLaMA of random weights (`--hidden`, `--layers`; transformers writes it
once into a temporary folder) and the adapters PEFT-format files of random factors of rank `--rank`
on every attention and MLP projection: the arithmetic of a real job at a size this machine runs in
minutes. Weights stay in RAM (`--policy ram`, the default) or are read from the engine's disk store
every pass (`--policy disk`). Greedy, ignore_eos; the count of requests whose tokens agree between
the engines is printed (merging rounds W + BA into the compute dtype, the per-request path adds
x A B to x W: near-ties on random weights can flip a token in bf16).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile

import harness  # puts the repository root on sys.path
import torch
from safetensors.torch import save_file

from flexsarathi import LLM, LoRARequest, SamplingParams
from flexsarathi.machine.cpu_info import cpu_line
from policy_search import Policy

ENGINES = ("one job per adapter", "per-request adapters", "transformers + PEFT (adapter_names)")
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def write_base(args, folder: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=args.hidden // 256, vocab_size=32000, max_position_embeddings=2048,
                         torch_dtype="bfloat16")
    torch.manual_seed(args.seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)


def write_adapter(args, base: str, folder: str, seed: int) -> None:
    """PEFT's save_pretrained layout: adapter_config.json + adapter_model.safetensors."""
    config = json.load(open(os.path.join(base, "config.json")))
    h = config["hidden_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (config["intermediate_size"], h),
              "mlp.up_proj": (config["intermediate_size"], h), "mlp.down_proj": (h, config["intermediate_size"])}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out_features, in_features) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(args.rank, in_features, generator=gen) / in_features ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features, args.rank, generator=gen) * 0.02
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank,
                   "target_modules": [t.split(".")[-1] for t in TARGETS]}, f)


def peft_model(base: str, folders: list[str], dtype: torch.dtype):
    """transformers' model of `base` with every adapter loaded into one PeftModel (names a0, a1, ...)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    model = PeftModel.from_pretrained(model, folders[0], adapter_name="a0")
    for i, folder in enumerate(folders[1:], 1):
        model.load_adapter(folder, adapter_name=f"a{i}")
    return model.eval()


def peft_tokens(model, prompts: list[list[int]], owner: list[int], max_tokens: int) -> list[list[int]]:
    """Greedy, exactly max_tokens each (EOS ignored), one mixed batch (prompts of one length: no padding)."""
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]),
                             dtype=torch.long), adapter_names=[f"a{i}" for i in owner], do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
    return out[:, len(prompts[0]):].tolist()


def policy_of(args) -> Policy:
    placed = dict(w_gpu=0.0, w_cpu=0.0, w_disk=1.0) if args.policy == "disk" else {}
    return Policy(gpu_batch_size=args.adapters * args.requests, **placed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8, help="requests per adapter")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--policy", choices=("ram", "disk"), default="ram")
    ap.add_argument("--dtype", default=None, help="default: the engine's auto (measured per machine on a CPU)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-peft", action="store_true", help="leave transformers + PEFT out")
    harness.add_json_option(ap, __file__)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        base = os.path.join(tmp, "base")
        write_base(args, base)
        folders = [os.path.join(tmp, f"adapter{i}") for i in range(args.adapters)]
        for i, folder in enumerate(folders):
            write_adapter(args, base, folder, args.seed + 1 + i)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(4, 32000) for _ in range(args.prompt_len)]
                   for _ in range(args.adapters * args.requests)]
        owner = [i % args.adapters for i in range(len(prompts))]  # requests of the adapters interleaved
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        offload = os.path.join(tmp, "offload")
        common = dict(dtype=args.dtype, policy=policy_of(args), offload_dir=offload)
        merged = [LLM(base, lora=folder, **common) for folder in folders]
        served = LLM(base, enable_lora=True, **common)
        loras = [LoRARequest(f"a{i}", i + 1, folder) for i, folder in enumerate(folders)]
        runs = {name: [] for name in ENGINES}

        def per_adapter() -> None:
            tokens, passes = [None] * len(prompts), 0
            for i, llm in enumerate(merged):
                mine = [k for k in range(len(prompts)) if owner[k] == i]
                for k, out in zip(mine, llm.generate([prompts[k] for k in mine], params, use_tqdm=False)):
                    tokens[k] = out.outputs[0].token_ids
                passes += llm.last_stats["passes"]
            runs[ENGINES[0]].append({"tokens": tokens, "passes": passes})

        def per_request() -> None:
            outs = served.generate(prompts, params, use_tqdm=False, lora_request=[loras[i] for i in owner])
            runs[ENGINES[1]].append({"tokens": [o.outputs[0].token_ids for o in outs],
                                     "passes": served.last_stats["passes"]})

        engines = {ENGINES[0]: per_adapter, ENGINES[1]: per_request}
        if not args.skip_peft:
            reference = peft_model(base, folders, served.engine.dtype)
            engines[ENGINES[2]] = lambda: runs[ENGINES[2]].append(
                {"tokens": peft_tokens(reference, prompts, owner, args.max_tokens), "passes": args.max_tokens})
        side = harness.alternate(engines, rounds=args.rounds)
        dtype = str(served.engine.dtype).removeprefix("torch.")
        for llm in [*merged, served]:
            llm.close()
    names = list(engines)
    rows = [{"engine": name, "seconds": min(side.seconds[name]), "passes": runs[name][-1]["passes"],
             "tok_per_s": len(prompts) * args.max_tokens / min(side.seconds[name])} for name in names]
    same = {name: sum(a == b for a, b in zip(runs[name][0]["tokens"], runs[ENGINES[1]][0]["tokens"]))
            for name in names if name != ENGINES[1]}
    pairs = [a / b for a, b in zip(side.seconds[ENGINES[0]], side.seconds[ENGINES[1]])]
    speedup = rows[0]["seconds"] / rows[1]["seconds"]
    print(f"random LLaMA hidden {args.hidden}, {args.layers} layers, {dtype}, weights {args.policy}; "
          f"{args.adapters} adapters (rank {args.rank}, every projection) x {args.requests} requests, "
          f"{args.prompt_len} -> {args.max_tokens}; best of {args.rounds} rounds (alternated)")
    for line in harness.ratio_table(rows, "engine", "tok_per_s", ENGINES[0], "tok/s"):
        print(line)
    print("passes: " + ", ".join(f"{r['engine']} {r['passes']}" for r in rows))
    print(f"per-request / one job per adapter, end to end: {speedup:.2f}x faster (best against best; per round "
          f"{', '.join(f'{p:.2f}' for p in pairs)}, median {statistics.median(pairs):.2f})")
    ratios = {"per_request_speedup": speedup}
    if ENGINES[2] in side.seconds:
        ratios["per_request_over_peft"] = rows[2]["seconds"] / rows[1]["seconds"]
        print(f"per-request / transformers + PEFT: {ratios['per_request_over_peft']:.2f}x faster")
    print("requests with the per-request engine's tokens: "
          + ", ".join(f"{name} {n} of {len(prompts)}" for name, n in same.items()))
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {cpu_line()}")
    harness.write_result(args, rows, ratios, extra={"median_round_speedup": statistics.median(pairs),
                                                    "same_tokens": same})


if __name__ == "__main__":
    main()
