"""Loading a 4-bit checkpoint of the llama-2-7b shape (issue 25's "Numbers to reach"):

    .venv/bin/python scripts/bench_load_quantized.py                          # GPTQ, 4-bit, groups of 128
    .venv/bin/python scripts/bench_load_quantized.py --format compressed-tensors
    .venv/bin/python scripts/bench_load_quantized.py --format gguf            # Q4_0 (llama.cpp's), groups of 32
    .venv/bin/python scripts/bench_load_quantized.py --layers 4               # the same shapes, 4 layers
    .venv/bin/python scripts/bench_load_quantized.py --quick                  # smoke test: 2 layers

1. Writes (once, untimed: the "download") an HF folder of the llama-2-7b config whose Linear weights
   are random codes drawn directly in the format's packed layout (GPTQ: qweight/qzeros/scales/g_idx,
   symmetric; compressed-tensors pack-quantized: weight_packed/weight_scale/weight_shape), 4 bits in
   groups of 128, fp16 embeddings and norms, sharded like a real release. GGUF: one Q4_0 file of the
   same shape (scripts/workloads.py's writer: random codes, llama.cpp's tensor names).
2. The baseline: the folder's files read once from a cold page cache (posix_fadvise DONTNEED).
3. Ours, in a child process (for its peak RSS): `LLM(folder, policy=everything on disk)` from a cold
   cache and without a store: reads the checkpoint layer by layer, keeps its codes, writes the
   engine's checksummed disk store. Then one prefill pass, whose bytes read from the store are
   counted (/proc/self/io read_bytes: O_DIRECT reads, so every byte is a disk byte).

Prints: store-write time / one read of the file (target < 2), peak RSS (target < 2 GB), and bytes
streamed per pass / the file's bytes of those tensors (target <= 1 + group parameters).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import harness  # puts the repository root on sys.path
import torch
from safetensors.torch import save_file

from flexsarathi.machine.cpu_info import cpu_line  # noqa: E402
from harness import disk_read_bytes, drop_cache_of, say  # noqa: E402
from policy_search.model_registry import known_config  # noqa: E402

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GROUP = 128
LAYERS_PER_SHARD = 4


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (h // cfg["num_attention_heads"])
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}


def packed_module(fmt: str, out_features: int, in_features: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random 4-bit codes in the format's packed int32 layout; fp16 scales; symmetric zero points."""
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int32)  # noqa: E731
    groups = in_features // GROUP
    scale = (0.002 + 0.004 * torch.rand(groups, out_features, generator=gen)).half()
    if fmt == "gptq":  # qweight packed along the input, qzeros along the output; v1 stores zero - 1 = 7
        return {"qweight": words(in_features // 8, out_features),
                "qzeros": torch.full((groups, out_features // 8), 0x77777777, dtype=torch.int32),
                "scales": scale, "g_idx": (torch.arange(in_features) // GROUP).to(torch.int32)}
    return {"weight_packed": words(out_features, in_features // 8), "weight_scale": scale.t().contiguous(),
            "weight_shape": torch.tensor([out_features, in_features])}


def quantization_config(fmt: str) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def write_checkpoint(folder: str, cfg: dict, fmt: str) -> None:
    os.makedirs(folder, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shapes, weight_map = module_shapes(cfg), {}
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    shards = [range(i, min(layers, i + LAYERS_PER_SHARD)) for i in range(0, layers, LAYERS_PER_SHARD)]
    for n, shard in enumerate(shards):
        tensors = {}
        if n == 0:
            embed = torch.empty(cfg["vocab_size"], h).normal_(0, 0.02, generator=gen).half()
            tensors.update({"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone(),
                            "model.norm.weight": torch.ones(h, dtype=torch.float16)})
        for i in shard:
            for lin in LINEARS:
                for k, v in packed_module(fmt, *shapes[lin], gen).items():
                    tensors[f"model.layers.{i}.{lin}.{k}"] = v
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(h, dtype=torch.float16)
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(folder, name))
        weight_map.update({k: name for k in tensors})
        say(f"  wrote {name}")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(cfg, torch_dtype="float16", quantization_config=quantization_config(fmt)), f)


GGUF_FILE = "model.gguf"


def write_gguf(folder: str, layers: int) -> None:
    from workloads import write_model

    os.makedirs(folder, exist_ok=True)
    write_model(os.path.join(folder, GGUF_FILE), "Q4_0", layers)


def model_path(folder: str) -> str:
    """What LLM() is given: the folder, or its GGUF file."""
    gguf = os.path.join(folder, GGUF_FILE)
    return gguf if os.path.isfile(gguf) else folder


def shard_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith((".safetensors", ".gguf")))


def read_once(folder: str) -> float:
    """Seconds to read every shard once from a cold page cache."""
    files = shard_files(folder)
    drop_cache_of(files)
    buffer = bytearray(16 << 20)
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - t0


def layer_file_bytes(folder: str) -> int:
    """Bytes the files hold for the layers' quantized tensors (headers only)."""
    from safetensors import safe_open

    if model_path(folder) != folder:
        from gguf import GGUFReader

        return sum(int(t.n_bytes) for t in GGUFReader(model_path(folder)).tensors
                   if t.name.startswith("blk.") and not t.name.endswith("norm.weight"))
    total = 0
    for path in shard_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if ".layers." in name and "layernorm" not in name:
                    sl = f.get_slice(name)
                    total += torch.Size(sl.get_shape()).numel() * {"I32": 4, "F16": 2, "I64": 8}[sl.get_dtype()]
    return total


def peak_rss() -> int:
    """This process's own peak resident set (VmHWM). Not getrusage's ru_maxrss: Linux carries the
    forking parent's high-water mark across exec into it, so a child started right after the
    parent wrote a 4 GB checkpoint reported the parent's 3.6 GiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def child(folder: str, offload_dir: str) -> None:
    """Place the model on disk (writes the store), run one prefill pass; print one JSON line."""
    from flexsarathi import LLM, SamplingParams
    from flexsarathi.engine.planner_spec import planner_model_spec
    from policy_search.policy import Policy

    t0 = time.perf_counter()
    llm = LLM(model_path(folder), dtype="bfloat16", device="cpu", offload_dir=offload_dir,
              policy=Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0, gpu_batch_size=1, overlap=False))
    write_s = time.perf_counter() - t0
    plan = llm.engine.weights.plan
    # what the planner prices the disk tier's reads at (a linked GGUF's blocks hold no minimum)
    streamed = (sum(p.bytes_on("disk") for p in plan.tensors) * plan.num_layers
                * planner_model_spec(model_path(folder), dtype="bfloat16").disk_read_ratio(True))
    before = disk_read_bytes()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    pass_read = disk_read_bytes() - before
    llm.close()
    rss = peak_rss()
    print(json.dumps({"write_s": write_s, "streamed_per_pass": streamed, "pass_read": pass_read, "peak_rss": rss}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", choices=("gptq", "compressed-tensors", "gguf"), default="gptq")
    p.add_argument("--layers", type=int, default=None, help="truncate llama-2-7b to this many layers")
    p.add_argument("--quick", action="store_true", help="2 layers")
    p.add_argument("--folder", default=None, help="where the checkpoint is written (kept for reruns)")
    p.add_argument("--offload-dir", default="/tmp/fs_bench_load_quantized_store")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    harness.add_json_option(p, __file__)
    args = p.parse_args()
    if args.child:
        child(args.child, args.offload_dir)
        return 0
    cfg = known_config("llama-2-7b")
    cfg["num_hidden_layers"] = 2 if args.quick else (args.layers or cfg["num_hidden_layers"])
    folder = args.folder or f"/tmp/fs_bench_{args.format}_7b_{cfg['num_hidden_layers']}l"
    say(f"bench_load_quantized: {cpu_line(torch.bfloat16)}")
    if not os.path.isfile(os.path.join(folder, GGUF_FILE if args.format == "gguf" else "config.json")):
        say(f"writing a 4-bit {args.format} checkpoint of llama-2-7b's shape ({cfg['num_hidden_layers']} layers) "
            f"to {folder} (untimed)")
        if args.format == "gguf":
            write_gguf(folder, cfg["num_hidden_layers"])
        else:
            write_checkpoint(folder, cfg, args.format)
    file_bytes = sum(os.path.getsize(f) for f in shard_files(folder))
    read_s = read_once(folder)
    say(f"baseline: reading the {file_bytes / 2**30:.2f} GiB of files once (cold cache): {read_s:.1f} s")
    shutil.rmtree(args.offload_dir, ignore_errors=True)
    drop_cache_of(shard_files(folder))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", folder,
                           "--offload-dir", args.offload_dir], capture_output=True, text=True)
    if done.returncode != 0:
        say(done.stderr)
        return 1
    r = json.loads(done.stdout.strip().splitlines()[-1])
    layer_bytes = layer_file_bytes(folder)
    say(f"ours: store written in {r['write_s']:.1f} s = {r['write_s'] / read_s:.2f}x one read of the file "
        f"(target < 2)")
    say(f"ours: peak RSS {r['peak_rss'] / 2**30:.2f} GiB (target < 2 GB)")
    say(f"ours: {r['streamed_per_pass'] / 2**30:.3f} GiB of layer weights streamed per pass (planned), "
        f"{r['pass_read'] / 2**30:.3f} GiB read from the store in one prefill pass; the file holds "
        f"{layer_bytes / 2**30:.3f} GiB for those tensors: {r['streamed_per_pass'] / layer_bytes:.3f}x "
        f"planned, {r['pass_read'] / layer_bytes:.3f}x read (target <= 1 + group parameters)")
    shutil.rmtree(args.offload_dir, ignore_errors=True)
    row = {"format": args.format, "layers": cfg["num_hidden_layers"], "file_bytes": file_bytes, "read_s": read_s,
           "layer_file_bytes": layer_bytes, **r}
    harness.write_result(args, [row], {"write_over_read": r["write_s"] / read_s,
                                       "streamed_over_file": r["streamed_per_pass"] / layer_bytes,
                                       "read_over_file": r["pass_read"] / layer_bytes}, dtype=torch.bfloat16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
