"""What `flexsarathi generate` and `flexsarathi bench` share: the model / placement arguments,
building the LLM from them (policy searched, loaded or default), and describing what ran."""
from __future__ import annotations

import argparse
import os
import platform
import sys

from flexsarathi.cli.file_checks import gib, positive_gib
from flexsarathi.errors import FlexSarathiError
from flexsarathi.engine.running_fit import default_policy
from policy_search.hardware import PRESETS
from policy_search.policy import Policy
from policy_search.units import GiB


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint folder (config.json + safetensors), a .gguf "
                   "file (llama.cpp's; its tokenizer included), a Hugging Face repo (org/name[@revision], "
                   "org/name:Q4_K_M for a GGUF in it; HF_HOME's cache, HF_HUB_OFFLINE=1 honoured) or dummy:<name> "
                   "(random weights: measure throughput, not text quality)")
    p.add_argument("--gguf-file", default=None, metavar="FILE", help="with a repo --model: this GGUF file in it")
    p.add_argument("--policy", default=None, help="'auto' (searched for --hardware, or without it for this "
                   "machine, measured once and cached, and this job's "
                   "lengths) or a policy JSON (`flexsarathi policy --json`); default: all on the device, each batch "
                   "running as many requests at once as its memory holds (up to 256)")
    p.add_argument("--hardware", default=None, help=f"a preset ({', '.join(PRESETS)}) or a profile JSON "
                   "(`flexsarathi profile`): its memory limits cap what the engine may use")
    for tier in ("gpu", "cpu"):
        p.add_argument(f"--{tier}-mem", type=positive_gib if tier == "gpu" else gib, default=None, metavar="GIB",
                       help=f"{tier} tier capacity in GiB (overrides --hardware's)")
    p.add_argument("--scheduler", choices=("decode-maximal", "block"), default=None,
                   help="how passes are formed (default: the policy's)")
    p.add_argument("--offload-dir", default=None, help="folder for disk-tier weights / KV / activations "
                   "(default ~/.cache/flexsarathi/offload)")
    p.add_argument("--max-logprobs", type=_logprobs_cap, default=20, metavar="N",
                   help="the most logprobs / prompt_logprobs alternatives a request may ask per token (default "
                   "20, vLLM's and OpenAI's limit); -1: no limit (a request's -1 asks for the whole vocabulary)")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a LoRA adapter (PEFT's save_pretrained folder, or a Hugging Face repo of one) merged into "
                   "the model's weights as they load: the adapted model at the base model's cost per pass")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompts' leading tokens that earlier requests of the job computed "
                   "(a shared system prompt, few-shot examples); on by default, as in vLLM")
    add_compute_args(p)


def add_lora_modules_arg(p: argparse.ArgumentParser) -> None:
    """--lora-modules, for the commands whose requests name a model (generate, serve)."""
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=DIR",
                   help="LoRA adapters served per request (vLLM's flag): a request whose \"model\" is NAME runs "
                   "with the adapter in DIR (PEFT's save_pretrained folder), the others with the base model; "
                   "requests of every adapter share each pass's read of the base weights")


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules: NAME=DIR (argparse names the flag in the error)."""
    name, sep, folder = text.partition("=")
    if not sep or not name or not folder:
        raise argparse.ArgumentTypeError(f"must be NAME=DIR (an adapter's name in requests and its folder), "
                                         f"got {text!r}")
    return name, folder


def lora_modules(args) -> dict[str, str]:
    """--lora-modules as {name: folder}; FlexSarathiError where a name is given twice or --lora is given too."""
    pairs = getattr(args, "lora_modules", None) or []
    modules = dict(pairs)
    if len(modules) != len(pairs):
        twice = next(name for i, (name, _) in enumerate(pairs) if name in dict(pairs[:i]))
        raise FlexSarathiError(f"--lora-modules names {twice!r} twice")
    if modules and getattr(args, "lora", None):
        raise FlexSarathiError("--lora merges one adapter into the weights and --lora-modules serves adapters per "
                               "request: give one of them")
    return modules


def _logprobs_cap(text: str) -> int:
    """--max-logprobs: an integer >= -1 (argparse names the flag in the error)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < -1:
        raise argparse.ArgumentTypeError(f"must be an integer >= -1 (-1: no limit), got {text!r}")
    return value


def add_compute_args(p: argparse.ArgumentParser) -> None:
    """--dtype and --device (every command that builds an engine)."""
    add_dtype_arg(p)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--cpu-matmul", choices=("auto", "int8x2", "int8", "dequantize"), default="auto",
                   help="4-bit weights multiplied on the CPU: int8x2 (x as two int8 planes, ~16 bits, at "
                   "decode row counts), int8 (one plane at every row count: llama.cpp's arithmetic, "
                   "fastest), dequantize (exact to the codes); auto: int8x2 where its AVX2 kernel builds")
    add_compress_head_arg(p)
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every pass eagerly on a GPU (by default decode passes that keep everything on "
                   "the GPU replay a CUDA graph per batch and context bucket)")


def add_compress_head_arg(p: argparse.ArgumentParser) -> None:
    """--compress-head, the one definition (engine commands and `policy`, which prices it)."""
    p.add_argument("--compress-head", action="store_true",
                   help="keep the LM head 4-bit (the weight format) and multiply it as the 4-bit layers: "
                   "1/7 of its fp32 memory; models whose head is their tied input embeddings have none")


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--dtype, the one definition (engine commands and `profile`)."""
    p.add_argument("--dtype", default=None, help="compute dtype: auto (the default: on the CPU the "
                   "fastest here, fp32 unless bf16/fp16 matmuls measure >= 1.3x faster, measured once "
                   "and cached per machine; on a GPU the checkpoint's half dtype), float32, float16, bfloat16")


def hardware_of(args):
    """The HardwareSpec of --hardware with the memory overrides; for --policy auto without one, this
    machine (measured once and cached: flexsarathi/machine/this_machine.py); else None."""
    if args.hardware is None and getattr(args, "policy", None) == "auto":
        from flexsarathi.llm import LLM
        from flexsarathi.machine.this_machine import this_machine_hardware

        spec = this_machine_hardware(LLM, args.dtype, args.device, args.offload_dir,
                                     say=lambda line: print(line, file=sys.stderr, flush=True))
    elif args.hardware is None:
        if args.gpu_mem is not None or args.cpu_mem is not None:
            raise FlexSarathiError("--gpu-mem / --cpu-mem need --hardware or --policy auto (the rest of the "
                                   "machine's figures)")
        return None
    else:
        from policy_search import HardwareSpec

        spec = HardwareSpec.resolve(args.hardware)
    return spec.with_memory(gpu=None if args.gpu_mem is None else args.gpu_mem * GiB,
                            cpu=None if args.cpu_mem is None else args.cpu_mem * GiB)


def resolve_policy(args, hardware, workload) -> Policy:
    from flexsarathi.llm import LLM

    constraints = {"scheduler": args.scheduler} if args.scheduler else {}
    if args.policy == "auto":
        if hardware is None:
            raise FlexSarathiError("--policy auto needs --hardware (a preset such as t4, or a profile "
                                   "written by `flexsarathi profile`)")
        return LLM.search_policy(args.model, hardware, workload, args.dtype,
                                 formats={"compress_head": getattr(args, "compress_head", False)},
                                 task=getattr(args, "task", "generate"), **constraints)
    policy = Policy.load(args.policy) if args.policy else default_policy()  # default: fitted to memory (build_llm)
    return policy.replace(**constraints)


def build_llm(args, workload, seed: int = 0, opened=None):
    """(LLM, policy) for the model arguments; workload: a policy_search.Workload for --policy auto;
    opened: the model the caller already opened (an OpenedModel of args.model)."""
    from flexsarathi.llm import LLM

    hardware = hardware_of(args)
    policy = resolve_policy(args, hardware, workload)
    llm = LLM(opened or args.model, dtype=args.dtype, device=args.device, policy=policy, hardware=hardware,
              offload_dir=args.offload_dir, seed=seed, cpu_matmul=getattr(args, "cpu_matmul", "auto"),
              compress_head=getattr(args, "compress_head", False),
              cuda_graphs=False if getattr(args, "no_cuda_graphs", False) else None,
              max_logprobs=getattr(args, "max_logprobs", 20), fit_running=not args.policy,
              task=getattr(args, "task", "generate"),
              enable_prefix_caching=getattr(args, "enable_prefix_caching", True), lora=getattr(args, "lora", None),
              enable_lora=bool(lora_modules(args)))
    return llm, policy


def describe_policy(p: Policy, fitted: bool = False) -> str:
    """fitted: the engine fits each batch's running set to memory (EngineConfig.fit_running)."""
    def split(a, b, c):
        return f"{a:.0%}/{b:.0%}/{c:.0%}"

    running = (f"up to {p.max_running} running (as many as memory holds)" if fitted
               else f"{p.gpu_batch_size} x {p.num_gpu_batches} running")
    text = (f"{p.scheduler}, {running}, prefill budget "
            f"{p.prefill_budget}; gpu/cpu/disk: weights {split(p.w_gpu, p.w_cpu, p.w_disk)}, KV "
            f"{split(p.kv_gpu, p.kv_cpu, p.kv_disk)}, activations {split(p.act_gpu, p.act_cpu, p.act_disk)}")
    extras = [name for name, on in (("4-bit weights", p.compress_weight), ("4-bit KV", p.compress_kv),
                                    ("CPU attention", p.cpu_attention), ("no overlap", not p.overlap)) if on]
    return text + (f"; {', '.join(extras)}" if extras else "")


def device_name(device) -> str:
    """Which device actually ran (a preset may describe another one)."""
    import torch

    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"cpu: {cpu}, {os.cpu_count()} cores"


def memory_summary(report: dict) -> str:
    from offload.memory import human_bytes

    return ", ".join(f"{tier} {human_bytes(entry['peak'])}" for tier, entry in report.items())
