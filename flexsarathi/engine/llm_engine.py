"""`LLMEngine`: the step is schedule -> forward (build micro-batches, run the pass) -> sample ->
postprocess (nano-vllm's shape).

The scheduler decides what runs, the executor (offload/) moves and computes, the model is pure
math, and this file only glues them and turns logits into tokens.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import sys
from dataclasses import dataclass, field

import torch

from flexsarathi.models.attention import release_host_buffers
from flexsarathi.engine.micro_batch_builder import build_micro_batch, wants_prompt_logprobs
from flexsarathi.engine.block_manager import BlockManager
from flexsarathi.engine.graph_passes import GraphPasses
from flexsarathi.engine.lora_requests import LoadedAdapter, LoraAdapters, LoRARequest
from flexsarathi.engine.running_fit import FIT_FRACTION, largest_fitting
from flexsarathi.formats.opened_model import OpenedModel, open_model
from flexsarathi.formats.pooling_config import embedding_normalized
from flexsarathi.machine.dtype_choice import cpu_compute_dtype, is_auto
from flexsarathi.errors import CheckpointError, FlexSarathiError
from flexsarathi.models.model_config import parse_dtype
from flexsarathi.engine.logprobs import Logprob, decode_logprobs, prompt_logprobs, top_logprobs
from flexsarathi.engine.sampling import SamplingParams, finite_rows, process_logits, sample, sample_seed
from flexsarathi.engine.structured_output import (GrammarCompiler, GrammarState, advance_matchers,
                                                  fill_grammar_bitmask)
from flexsarathi.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, WorkItem
from flexsarathi.engine.pooling import (POOLING_TASKS, TASKS, ClassificationOutput, ClassificationRequestOutput,
                                        EmbeddingOutput, EmbeddingRequestOutput, PoolingParams, class_probs, pooled)
from flexsarathi.engine.sequence import Sequence, SequenceStatus
from flexsarathi.formats.tokenizer import IncrementalDetokenizer
from offload.activations import ActivationStore
from offload.disk_store import DiskStore
from offload.executor import PassExecutor
from offload.free_memory import free_bytes
from offload.interrupts import DeferredInterrupts
from offload.kv_cache import KVCompression, KVPool, decode_in_pool_tiers
from offload.streams import indexed
from offload.memory import MemoryBudgetError, MemoryTracker, TierBudget, dequant_scratch_bytes, human_bytes
from offload.errors import UnquantizableWeight
from offload.placement import quantized_on_placement, weight_layout_tag
from offload.tiered_weights import TieredWeights
from policy_search.graphs import graphs_refused
from policy_search.policy import TIERS, Policy
from policy_search.model_spec import ModelSpec
from policy_search.quant_format import KV_FORMAT
from policy_search.working_set import (POST_ATTENTION_ROWS, QUERY_BLOCK, PassTokens, gathered_tiers, working_set,
                                       worst_passes)
from quant import QuantConfig, cpu_int8_matmul
from quant.config import ALLOWED_BITS, WEIGHT_QUANT

PLAIN_KV_BLOCK = 16  # tokens per block of an uncompressed KV pool
STORE_FORMAT = 3  # bump whenever what the weight store holds changes (2: 4-bit packed per row; 3: + norms, biases)
GPU_TOKEN_MULTIPLE = 128  # matmul tile: passes on a GPU carry a multiple of it where that is free
SCHEDULE_FIELDS = ("scheduler", "kv_admission", "kv_cache_tokens", "prefill_budget", "gpu_batch_size")
DEFAULT_OFFLOAD_DIR = os.path.join(os.path.expanduser("~"), ".cache", "flexsarathi", "offload")


@dataclass
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput)."""

    index: int
    text: str  # decode(prompt + token_ids) after decode(prompt), cut before a stop string
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token or stop string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string, None for EOS/length
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled + top `logprobs`


@dataclass
class RequestOutput:
    """One request's result (vLLM's RequestOutput). Under `generate(..., on_error="record")`,
    `error` is set instead of outputs where the request did not finish: `refused` where it was
    turned away before any pass (its prompt or sampling values; request_id is then -1), else it
    failed in a pass (non-finite logits)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # vLLM's shape: None for the first prompt token, then {token: Logprob} of the prompt token and
    # the top `prompt_logprobs` candidates
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None
    refused: bool = False
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (vLLM's field)

    @property
    def finished(self) -> bool:
        return self.error is None

    # The first completion's fields, as before `n` existed.
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None


def resolve_device(device, check_available: bool = True) -> torch.device:
    """The compute device: 'cpu' or 'cuda[:N]' (default: cuda when available); anything else, or
    CUDA on a machine without it, is a FlexSarathiError saying so. check_available=False: only the
    name is checked (a Ray driver naming its actors' device, which it may not have itself)."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        hint = " (did you mean 'cuda'?)" if str(device).lower().startswith("gpu") else ""
        raise FlexSarathiError(f"device {device!r} is not one FlexSarathi computes on: use 'cpu' or "
                               f"'cuda' / 'cuda:N'{hint}")
    if resolved.type == "cuda" and check_available:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise FlexSarathiError(f"device {device!r}: CUDA is not available on this machine (torch "
                                   f"{torch.__version__}, no usable GPU); use 'cpu'")
        if resolved.index is not None and resolved.index >= count:
            raise FlexSarathiError(f"device {device!r}: this machine has {count} CUDA device(s), "
                                   f"cuda:0 .. cuda:{count - 1}")
    return resolved


def resolve_dtype(dtype, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Explicit dtype wins; else (None or "auto") a half dtype on a GPU (gpu_auto_dtype) and on the
    CPU the dtype this machine computes fastest, fp32 unless a half dtype is clearly faster
    (measured once per machine and cached: flexsarathi/machine/dtype_choice.py)."""
    if not is_auto(dtype):
        return parse_dtype(dtype, "LLM(dtype=...)")
    if device.type == "cuda":
        return gpu_auto_dtype(checkpoint_dtype, cuda_capability(device))
    return cpu_compute_dtype()


def resolve_cpu_matmul(choice: str, device_type: str = "cpu") -> str:
    """EngineConfig.cpu_matmul -> "int8x2", "int8" or "dequantize" (what the passes run); an int8
    mode where its kernel cannot be had here is one error saying why. On a GPU compute device the
    weights' matmuls run there (quant/fused.py), so "auto" is "dequantize" and an int8 mode, which
    would never run, is refused rather than reported as in use."""
    if choice not in cpu_int8_matmul.MODES:
        raise FlexSarathiError(f"cpu_matmul={choice!r}: use one of {', '.join(cpu_int8_matmul.MODES)}")
    if device_type != "cpu" and choice not in ("auto", "dequantize"):
        raise FlexSarathiError(f"cpu_matmul={choice!r} is for a CPU compute device; this engine computes on "
                               f"{device_type}, where 4-bit weights are multiplied on the GPU: leave cpu_matmul='auto'")
    if choice == "dequantize" or device_type != "cpu" or (choice == "auto" and not cpu_int8_matmul.available()):
        return "dequantize"
    if not cpu_int8_matmul.available():
        raise FlexSarathiError(f"cpu_matmul={choice!r}: the int8 kernel is not available on this machine: "
                               f"{cpu_int8_matmul.unavailable_reason()}; use cpu_matmul='dequantize'")
    return "int8x2" if choice == "auto" else choice


def int8_kernel_preferred(cpu_matmul: str) -> bool:
    """bf16 4-bit weights on the CPU go to quant/cpu_int8_matmul.py's kernel rather than torch's int4
    kernel: where the passes run it (cpu_matmul int8 / int8x2) on a VNNI path. Measured on a Zen 5
    (family 26 model 2), 14336 x 4096 at groups of 32, 2 threads: 16 rows 3.9 ms (int8x2 6.4) against
    torch's int4 kernel's 7.4, 32 rows 6.2 (10.6) against 12.7, 512 rows 74 against 85 (and the
    engine's prompt passes dequantize instead of calling that kernel)."""
    return cpu_matmul in ("int8", "int8x2") and cpu_int8_matmul.KERNEL.isa_name() in ("avx512_vnni", "avx_vnni")


def gpu_auto_dtype(checkpoint_dtype: torch.dtype, capability: tuple[int, int] | None) -> torch.dtype:
    """The checkpoint's half dtype (fp16 for fp32 ones), except bf16 below sm_80: a T4 (sm_75) has
    no bf16 tensor cores (torch emulates it slowly) and Triton's bf16 `tl.dot` does not compile
    there. capability None (unknown: a Ray driver planning for GPUs it does not have) keeps the
    checkpoint's dtype; pass dtype="float16" for a cluster of older GPUs."""
    if checkpoint_dtype == torch.bfloat16 and (capability is None or tuple(capability) >= (8, 0)):
        return torch.bfloat16
    return torch.float16


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of `device`, None where this process cannot see it."""
    if not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuple(torch.cuda.get_device_capability(index)) if index < torch.cuda.device_count() else None


@dataclass(frozen=True)
class EngineConfig:
    """What an LLMEngine is built from (LLM(...) builds it from its keyword arguments)."""

    model: str  # a checkpoint folder or `dummy:<name>`
    dtype: str | torch.dtype | None = None  # None or "auto": resolve_dtype's rule
    device: str | torch.device | None = None  # None: cuda when available
    policy: Policy = field(default_factory=Policy)
    seed: int = 0  # of the requests that give no SamplingParams.seed
    kv_block_size: int | None = None  # None: KVFormat.block_size compressed, PLAIN_KV_BLOCK plain
    budget: TierBudget | None = None  # per-tier memory limits the engine enforces
    offload_dir: str | None = None  # None: DEFAULT_OFFLOAD_DIR
    direct_io: bool = True  # O_DIRECT reads of the disk store where the file system allows
    weight_quant: QuantConfig = WEIGHT_QUANT
    kv_bits: int = KV_FORMAT.bits
    kv_value_group: int = KV_FORMAT.value_group
    # dummy models with 4-bit weights: draw the codes directly instead of quantizing normal draws
    # (other weights, another disk store; checkpoint.DummyWeights), for models too large to quantize
    # quickly on a CPU (scripts/bench_70b.py)
    dummy_weight_codes: bool = False
    # Mixture of experts (None: the policy's field of that name where it has one, else off):
    # read a layer's experts off the gpu tier only once routed; compute experts held on the cpu
    # tier there (offload/tiered_weights.py RowBlockAccess)
    routed_expert_reads: bool | None = None
    cpu_experts: bool | None = None
    # 4-bit weights computed on the CPU (quant/cpu_int8_matmul.py): "int8x2" rounds x to two int8
    # planes per block (~16 bits) and multiplies the codes on the integer units at decode row
    # counts (<= 64 rows; more: dequantize); "int8": one plane at every row count (llama.cpp's
    # arithmetic: fastest, x rounded to 8 bits); "dequantize": F.linear on the dequantized weight
    # (exact to the codes); "auto": int8x2 where its kernel builds on this machine, else dequantize.
    # What x's rounding costs beside the weights' (`flexsarathi perplexity` on stories260K and the
    # held-out stories, 4-bit weights, bf16, Zen 5, 2026-11-28): dequantize 3.7656, int8x2 3.7653,
    # int8 3.7671 (+0.04%), the uncompressed weights 3.3980 (the 4-bit codes: +10.8%).
    cpu_matmul: str = "auto"
    # The LM head (where it is its own tensor, not the tied input embeddings) kept 4-bit in
    # `weight_quant` on the compute device and multiplied as the layers' 4-bit weights are: 1/7 of
    # its fp32 bytes (llama-2-7b: 0.5 GB -> 74 MB; a 150K-word vocabulary's head is 2.4 GB in fp32),
    # and on the CPU the int8 kernel instead of an fp32 GEMM. Logits then come from 4-bit weights.
    compress_head: bool = False
    # Decode passes whose weights, KV cache and activations all stay on a CUDA device replay a CUDA
    # graph captured once per batch and context bucket (offload/decode_graphs.py): the host then
    # launches one graph instead of every kernel. None: on where the compute device is CUDA.
    cuda_graphs: bool | None = None
    # The most alternatives a request's logprobs / prompt_logprobs may ask per token (vLLM's
    # max_logprobs and its default: OpenAI's top_logprobs limit); -1: no limit (what a request's -1,
    # the whole vocabulary, needs). Each alternative is a Python object: ~224 bytes (measured with
    # tracemalloc on stories260K), so one request of a 128K vocabulary at -1 holds ~29 MB per token;
    # a batch file or server refuses it by default.
    max_logprobs: int = 20
    # The policy's max_running is a ceiling: each batch of requests runs as many sequences as the
    # compute device's memory holds (its budget, else what it can still allocate; running_fit.py).
    # LLM(policy=None) sets it with running_fit.default_policy(); it needs everything on the device.
    fit_running: bool = False
    # "generate" (text) or "embed" (vLLM's pooling runner): every request is a prompt whose last
    # token's final hidden state is its embedding (engine/pooling.py); nothing is sampled.
    task: str = "generate"
    # Automatic prefix caching (vLLM's, on by default there too): a request whose leading tokens
    # fill KV blocks that an earlier request of this engine computed (a shared system prompt,
    # few-shot examples, a preempted sequence's own context) takes those blocks instead of
    # computing them again (engine/prefix_cache.py). RequestOutput.num_cached_tokens says how many.
    enable_prefix_caching: bool = True
    # A LoRA adapter folder (PEFT's save_pretrained) merged into the checkpoint's weights as they are
    # read (formats/lora_adapter.py): the adapted model at the base model's cost per pass.
    lora: str | None = None
    # LoRA adapters named per request (vLLM's enable_lora and LoRARequest; engine/lora_requests.py):
    # requests of several adapters share each pass's stream of the base weights.
    enable_lora: bool = False

    def __post_init__(self) -> None:
        _check_engine_fields(self)
        p = self.policy
        if self.fit_running and (p.w_gpu, p.kv_gpu, p.act_gpu) != (1, 1, 1):
            raise FlexSarathiError("EngineConfig.fit_running sizes the running set to the compute device's memory: "
                                   "it needs a policy with weights, KV cache and activations all there "
                                   f"(got w_gpu={p.w_gpu:g}, kv_gpu={p.kv_gpu:g}, act_gpu={p.act_gpu:g})")


def _check_engine_fields(e: EngineConfig) -> None:
    """FlexSarathiError naming an EngineConfig field (an LLM(...) option) of the wrong kind: a string
    for a flag would read as true ("no" turning direct_io on), a kv_bits the format has not."""
    if e.task not in TASKS:
        raise FlexSarathiError(f"EngineConfig.task must be one of {', '.join(TASKS)}, got {e.task!r}")
    for name in ("direct_io", "dummy_weight_codes", "compress_head", "fit_running", "enable_prefix_caching",
                 "enable_lora"):
        if not isinstance(getattr(e, name), bool):
            raise FlexSarathiError(f"EngineConfig.{name} must be True or False, got {getattr(e, name)!r}")
    if e.lora is not None and not isinstance(e.lora, str):
        raise FlexSarathiError(f"EngineConfig.lora must be None or a LoRA adapter folder, got {e.lora!r}")
    if e.lora is not None and e.enable_lora:
        raise FlexSarathiError("lora= merges one adapter into the weights and enable_lora=True serves adapters "
                               "per request (LoRARequest): give one of them")
    for name in ("routed_expert_reads", "cpu_experts", "cuda_graphs"):
        if getattr(e, name) is not None and not isinstance(getattr(e, name), bool):
            raise FlexSarathiError(f"EngineConfig.{name} must be True, False or None, got {getattr(e, name)!r}")
    if not isinstance(e.policy, Policy):
        raise FlexSarathiError(f"EngineConfig.policy must be a Policy, got {type(e.policy).__name__}")
    if e.offload_dir is not None and not isinstance(e.offload_dir, (str, os.PathLike)):
        raise FlexSarathiError(f"EngineConfig.offload_dir must be a folder path or None, got {e.offload_dir!r}")
    if isinstance(e.kv_bits, bool) or e.kv_bits not in ALLOWED_BITS:
        raise FlexSarathiError(f"EngineConfig.kv_bits must be one of {ALLOWED_BITS}, got {e.kv_bits!r}")
    if isinstance(e.kv_value_group, bool) or not isinstance(e.kv_value_group, int) or e.kv_value_group < 1:
        raise FlexSarathiError(f"EngineConfig.kv_value_group must be a positive integer, got {e.kv_value_group!r}")
    if not isinstance(e.weight_quant, QuantConfig):
        raise FlexSarathiError(f"EngineConfig.weight_quant must be a quant.QuantConfig, got {e.weight_quant!r}")


HEAD = "lm_head.weight"


def _formats_key(quant, dtype: torch.dtype, device: torch.device, int4_layout: bool = True) -> str:
    """The weight formats' part of the store key (one format: as before per-tensor formats existed)."""
    def one(q: QuantConfig | None) -> str:
        if q is None:
            return "plain"
        wide = ("m32" if q.minimum_fp32 else "") + ("p" if q.adjacent_pairs else "") + ("h" if q.group_halves else "")
        return f"q{q.bits}g{q.group_size}d{q.group_dim}{wide}|{weight_layout_tag(dtype, device, q, int4_layout)}"

    if quant is None or isinstance(quant, QuantConfig):
        return one(quant)
    return ";".join(f"{name}={one(q)}" for name, q in sorted(quant.items()))


class LLMEngine:
    """Owns the placed weights, the KV pools and ONE scheduler (with its block manager) for its
    lifetime; `add_requests` queues a batch, `step` runs one pass of it."""

    interrupt_held = False  # a Ctrl-C came as the last step ended (step, raise_held_interrupt)

    def __init__(self, config: EngineConfig, opened: OpenedModel | None = None):
        """opened: the model already opened by the caller (open_model(config.model)), else opened here."""
        self.engine_config = e = config
        # "cuda" as "cuda:<index>", as tensors' devices are (a bare "cuda" never equals "cuda:0")
        self.device = indexed(resolve_device(e.device))
        opened = _opened_for(e, opened)
        self.source, self.tokenizer = opened.source, opened.tokenizer
        self.source.use_for(compress_weight=e.policy.compress_weight, weights_on_disk=e.policy.w_disk > 0)
        self.config, self.model = self.source.config, self.source.model
        self.normalize_embeddings = self._embedding_normalized()
        self.dtype = resolve_dtype(e.dtype, self.config.checkpoint_dtype, self.device)
        self._spec: ModelSpec | None = None  # the planner's view of this model and dtype (_working_bytes)
        self.policy = p = e.policy
        # A compressed K is grouped per channel over one block (KVFormat.block_size).
        self.block_size = e.kv_block_size or (KV_FORMAT.block_size if p.compress_kv else PLAIN_KV_BLOCK)
        self.offload_dir = e.offload_dir or DEFAULT_OFFLOAD_DIR
        self.eos_token_ids = _eos_ids(self.config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, list(self.eos_token_ids))
        self.memory = MemoryTracker(_fitted_budget(e.budget, e.fit_running, self.device), self.device)
        adapter = getattr(self.source, "adapter", None)
        if adapter is not None:  # held in host memory beside the weights (a store rebuilt reads it again)
            self.memory.reserve("cpu", adapter.nbytes, "LoRA adapter")
        self.kv_compression = (KVCompression(bits=e.kv_bits, block_size=self.block_size,
                                             value_group=e.kv_value_group) if p.compress_kv else None)
        try:
            self.weights = self._place_weights()
        except UnquantizableWeight as refused:
            raise self._unquantizable(refused) from None
        except MemoryBudgetError as short:
            raise self._weights_do_not_fit(short) from None
        self._reserve_dequant_scratch()
        self.kv_pools: dict[str, KVPool] = {}
        self.activations = ActivationStore(p.act_fractions, self.device, pin_memory=self.device.type == "cuda",
                                           folder=self._offload_folder() if p.act_disk > 0 else None)
        self.cpu_matmul = resolve_cpu_matmul(e.cpu_matmul, self.device.type)
        self.executor = PassExecutor(self.model, self.weights, self.kv_pools, self.activations,
                                     self.device, self.dtype, overlap=p.overlap,
                                     cpu_attention=p.cpu_attention, cpu_matmul=self.cpu_matmul,
                                     head="hidden" if e.task in POOLING_TASKS else "logits")
        self.loras = (LoraAdapters(self.model, self.dtype, self.device, self.memory, self.executor.lora_factors,
                                   self._adapters_in_use) if e.enable_lora else None)
        self.blocks = BlockManager(self.block_size, {}, num_residual=0,  # laid out per batch
                                   prefix_caching=e.enable_prefix_caching)
        self.scheduler = Scheduler(self._scheduler_config(), self.blocks)
        self._rng, self._next_id = random.Random(e.seed), 0
        self.worst_pass_bytes = self.batch_running = 0  # the batch's largest pass and running count (_add_requests)
        self.graph_passes = self._graph_passes()
        self.closed = False
        self.stats = {"graph_passes": 0}  # decode passes replayed from a CUDA graph
        self._closed_because = "LLM.close() was called"

    def _embedding_normalized(self) -> bool:
        """An embedding engine's default for PoolingParams.normalize (the checkpoint's modules.json);
        CheckpointError where a checkpoint without its LM head is asked to generate."""
        e = self.engine_config
        if e.task == "classify" and self.config.classifier is None:
            raise CheckpointError(f'task="classify" needs a sequence-classification checkpoint (config.json\'s '
                                  f"architectures a *ForSequenceClassification, its score head saved); {e.model} "
                                  "is not one")
        if self.source.headless and e.task not in POOLING_TASKS:
            kind = "a classifier: it classifies, with LLM(model, task=\"classify\")" if self.config.classifier else (
                'a base model saved without its head (an embedding model): it embeds, with LLM(model, task="embed")')
            raise CheckpointError(f"{e.model} holds no lm_head.weight and config.json says the head is not tied: "
                                  f"{kind}, but cannot generate")
        return embedding_normalized(e.model) if e.task == "embed" else True

    def _read_globals(self) -> dict:
        """The embeddings, final norm and head to hold; an embedding engine never multiplies by the
        head, so an untied one (150K x 4096 bf16: 1.2 GB) is read once and not kept."""
        weights = self.source.global_weights(self.dtype)
        if self.engine_config.task in POOLING_TASKS:
            weights.pop(HEAD, None)
        if self.engine_config.task != "classify":
            weights.pop(self.model.CLASSIFIER, None)
        return weights

    def _reserve_dequant_scratch(self) -> None:
        """On a GPU, quant/fused.py's one dequantized weight at a time (the largest 4-bit weight)."""
        p, e = self.policy, self.engine_config
        if self.device.type == "cuda" and (p.compress_weight or e.compress_head):
            shapes = {**(self.model.weight_kinds() if p.compress_weight else {}),
                      **({HEAD: self.model.global_shapes()[HEAD]} if e.compress_head else {})}
            self.memory.reserve("gpu", dequant_scratch_bytes(shapes, self.dtype.itemsize, self.model.expert_stacks()),
                                "dequantize scratch")

    def _prompts_grouped_upto(self) -> int:
        """Whole prompts of up to this many tokens are grouped for build_micro_batch: where one causal
        call attends such a group (PassExecutor.one_causal_call: a fused kernel, within the sliding
        window); 0: none."""
        if not (self.executor.causal_calls if self.kv_compression is None else self.executor.masked_causal_calls):
            return 0
        return self.model.config.smallest_window or sys.maxsize

    def _graph_passes(self) -> GraphPasses | None:
        """CUDA graphs for decode passes (EngineConfig.cuda_graphs; None: on CUDA) where the policy
        allows them (graph_passes.graphs_refused). On the CPU, cuda_graphs=True runs the same static
        buffers eagerly (nothing to capture there: what the tests check)."""
        wanted = self.engine_config.cuda_graphs
        if not (self.device.type == "cuda" if wanted is None else wanted):
            return None
        if graphs_refused(self.policy, bool(self.model.expert_stacks())) is not None:
            return None
        return GraphPasses(self.executor, self.blocks, self.memory, self.device, self._working_bytes,
                           lambda: self.worst_pass_bytes)

    def _place_weights(self) -> TieredWeights:
        e, p = self.engine_config, self.policy
        if e.weight_quant.group_dim not in (-1, 1):
            raise FlexSarathiError(f"weight_quant must group along the input dimension (group_dim=-1): "
                                   f"placement streams row ranges; got {e.weight_quant}")
        if e.compress_head and HEAD not in self.model.global_shapes():
            raise FlexSarathiError(f"compress_head: {e.model} has no LM head of its own (tie_word_embeddings: "
                                   f"its head is the input embeddings), so there is nothing to compress")
        if p.weight_prefetch > self.config.num_layers:  # each is a layer buffer: 10**9 of them never end
            raise FlexSarathiError(f"Policy.weight_prefetch={p.weight_prefetch} loads more layers ahead than "
                                   f"{e.model} has ({self.config.num_layers}); use at most {self.config.num_layers}")
        quant = e.weight_quant if p.compress_weight else None
        # A pre-quantized checkpoint's codes are stored in its own formats, whatever the policy says.
        quant = self.source.quantized_formats() or quant
        # The store format version is part of the key: a store written by an engine with another
        # layout (e.g. a different 4-bit packing) has different, equally checksummed bytes.
        cpu_matmul = resolve_cpu_matmul(e.cpu_matmul, self.device.type)
        int4_layout = not int8_kernel_preferred(cpu_matmul)
        store_key = f"fmt{STORE_FORMAT}|{self.source.fingerprint}|{str(self.dtype).removeprefix('torch.')}|" + (
            _formats_key(quant, self.dtype, self.device, int4_layout))
        return TieredWeights(
            num_layers=self.config.num_layers,
            layer_shapes=[self.model.layer_shapes(j) for j in range(self.config.num_layers)],
            row_blocks=self.model.expert_stacks(), resident=self.model.resident_weights(),
            routed_reads=self._moe_flag("routed_expert_reads"), cpu_blocks=self._moe_flag("cpu_experts"),
            read_globals=self._read_globals,
            # skip: weights the store only links (offload/placed_layers.py); only a source with
            # linked_blocks (GGUF) is ever asked to skip any
            read_layer=lambda i, skip=frozenset(): self.source.layer_weights(
                i, self.dtype, self._checked_on_placement(i, quant), **({"skip": skip} if skip else {})),
            linked_extents=self.source.linked_extents,
            linked_blocks=self.source.linked_blocks,
            compressed_globals={HEAD: e.weight_quant} if e.compress_head else None,
            fractions=p.weight_fractions, device=self.device, dtype=self.dtype, quant=quant,
            tracker=self.memory, overlap=p.overlap, prefetch=p.weight_prefetch,
            pin_memory=p.pin_weight and self.device.type == "cuda",
            disk_store=lambda: DiskStore(self._offload_folder(), store_key, direct_io=e.direct_io,
                                         pin_memory=self.device.type == "cuda"), int4_layout=int4_layout,
            load_bytes=self.source.load_bytes(self.dtype, frozenset({HEAD}) if e.compress_head else frozenset()),
            # every pass multiplies 4-bit weights with the int8 kernel ("int8x2" dequantizes prompt-sized
            # ones instead, which would have to undo the panels per call): their resident rows in its panels
            int8_panels=cpu_matmul == "int8" and self.device.type == "cpu", panel_globals=frozenset({HEAD}))

    def _checked_on_placement(self, layer: int, quant) -> frozenset[str]:
        """The layer's weights this engine quantizes from the source's floats: quantize checks their
        values as it makes their group scales (a NaN or inf gives a non-finite scale, which it
        refuses), so the source need not pass over them for that (WeightSource.layer_weights)."""
        if self.source.quantized_formats() is not None:  # its codes are stored as they are
            return frozenset()
        return quantized_on_placement(self.model.layer_shapes(layer), quant, self.model.resident_weights())

    def _unquantizable(self, refused: UnquantizableWeight) -> FlexSarathiError:
        """The error for a weight quantize refused as it was placed: the source's own, naming the
        tensor, its file and its first non-finite entry (the layer read again with every check);
        else its values are finite but beyond the fp16 range of the groups' scales."""
        self.source.layer_weights(refused.layer, self.dtype)
        return CheckpointError(f"{refused}; its values are finite in {str(self.dtype).removeprefix('torch.')}, but "
                               "beyond what 4-bit groups' fp16 scales hold: run it with uncompressed weights")

    def _weights_do_not_fit(self, short: MemoryBudgetError) -> Exception:
        """A policy-less engine (fit_running) whose weights do not fit the compute device: the
        arithmetic and what to do; an explicit policy's shortfall as it is."""
        e = self.engine_config
        if not e.fit_running or short.tier == "disk":
            return short
        where = ("its budget" if e.budget is not None and e.budget.gpu is not None else
                 f"{FIT_FRACTION:.0%} of what the {self.device.type} can still allocate (memory cgroups included)")
        return FlexSarathiError(
            f"{e.model} does not fit on the {self.device.type} without offloading: with everything on the device "
            f"the engine is held to {where} ({short}). Offload part of it with a policy: --policy auto (searched "
            "for this machine, measured once and cached; --hardware names another), or a policy file placing "
            "weights on the cpu or disk tier (w_cpu, w_disk); from Python LLM(model, policy=\"auto\")")

    def _moe_flag(self, name: str) -> bool:
        value = getattr(self.engine_config, name)
        return bool(getattr(self.policy, name, False) if value is None else value)

    def _offload_folder(self) -> str:
        try:
            os.makedirs(self.offload_dir, exist_ok=True)
        except OSError as exc:
            raise FlexSarathiError(f"offload folder {self.offload_dir} cannot be created: {exc.strerror}") from None
        return self.offload_dir

    # ---- requests ------------------------------------------------------------------------
    def make_sequence(self, prompt_token_ids: list[int], params: SamplingParams,
                      prompt: str | None = None, sample_index: int = 0,
                      pooling: PoolingParams | None = None, cache_salt: str | None = None,
                      lora_request: LoRARequest | None = None) -> Sequence:
        """sample_index: which of the request's `n` completions this sequence is (its seed);
        pooling: a pooling request's PoolingParams (an engine of task "embed" or "classify" takes only those);
        cache_salt: its prefix-cache blocks are shared with requests of the same salt only;
        lora_request: the adapter it runs with (an engine of enable_lora=True), read on its first request."""
        task = self.engine_config.task
        if (pooling is not None) != (task in POOLING_TASKS):
            raise FlexSarathiError(f"this engine pools (task={task!r}): LLM.{task} takes its requests"
                                   if pooling is None else "pooled requests need an engine of task=\"embed\" or "
                                   "\"classify\": LLM(model, task=...)")
        if task == "embed":
            pooling.check(self.embedding_width)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        seed = (sample_seed(params.seed, sample_index) if params.seed is not None
                else self._rng.getrandbits(62))
        if any(t >= self.config.vocab_size for t in params.stop_token_ids):
            raise FlexSarathiError(f"SamplingParams.stop_token_ids {list(params.stop_token_ids)} has ids "
                                   f"outside the vocabulary [0, {self.config.vocab_size})")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise FlexSarathiError(f"{'stop strings' if params.stop else 'bad_words'} need a model folder with "
                                   "tokenizer.json (use stop_token_ids / logit_bias with token-id prompts)")
        self._check_token_ids(params)
        self._check_logprobs(params)
        adapter = self._adapter(lora_request)
        seq = Sequence(
            seq_id=self._next_id, prompt_token_ids=list(prompt_token_ids), params=params,
            max_len=min(len(prompt_token_ids) + (params.max_tokens or self.config.max_position_embeddings),
                        self.config.max_position_embeddings),
            stop_ids=frozenset(stop), generator=torch.Generator().manual_seed(seed), prompt=prompt,
            detokenizer=(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
                         if params.stop else None),
            logprobs=[] if params.logprobs is not None else None, bad_word_ids=self._bad_word_ids(params),
            grammar=(GrammarState(self.grammars.compile(params.structured_outputs))
                     if params.structured_outputs is not None else None), pooling=pooling, cache_salt=cache_salt,
            lora_id=0 if adapter is None else adapter.request.lora_int_id,
            lora_fingerprint=None if adapter is None else adapter.fingerprint)
        self._next_id += 1
        return seq

    def _adapter(self, lora_request: LoRARequest | None) -> LoadedAdapter | None:
        if lora_request is None:
            return None
        if self.loras is None:
            raise FlexSarathiError("a lora_request needs an engine serving adapters: LLM(model, enable_lora=True)")
        return self.loras.load(lora_request)

    def _adapters_in_use(self) -> set[int]:
        """LoRA adapter ids of the unfinished sequences (LoraAdapters keeps them)."""
        s = self.scheduler
        return {seq.lora_id for seq in (*s.running, *s.waiting)}

    @property
    def embedding_width(self) -> int:
        """Values in an embedding: the final hidden state's (OPT's project_out narrows it)."""
        return self.config.embed_dim

    def pool(self, outputs: list[tuple[WorkItem, torch.Tensor]]) -> tuple[list[Sequence], list[int | None]]:
        """A pooling engine's step after its pass (in place of sample): each request whose prompt
        prefill ended takes its embedding (or its classification: the score head's logits and
        activation, on the compute device) from its last row's final hidden state and finishes;
        a row that is not finite fails its request. No token is sampled (None each)."""
        done = [(item.seq, hidden[-1]) for item, hidden in outputs if item.samples]
        if not done:
            return [], []
        rows = torch.stack([row for _, row in done])  # [R, width] fp32
        classifier = self.config.classifier if self.engine_config.task == "classify" else None
        if classifier is not None:  # [R, labels]
            score = self.weights.global_weights()[self.model.CLASSIFIER]
            rows = class_probs(rows @ score.float().T, classifier.num_labels, classifier.problem_type)
        rows = rows.cpu()  # one transfer for the step
        finite = torch.isfinite(rows).all(dim=1).tolist()
        for (seq, _), row, ok in zip(done, rows, finite):
            if ok:
                seq.pooled = row.tolist() if classifier is not None else pooled(row, seq.pooling,
                                                                                self.normalize_embeddings)
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                seq.error = "the model's hidden state for this prompt is not finite (inf or NaN)"
        return [seq for seq, _ in done], [None] * len(done)

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = sorted(t for t in ids if t >= vocab)
            if outside:
                raise FlexSarathiError(f"SamplingParams.{name} names token ids {outside[:5]} outside the "
                                       f"vocabulary [0, {vocab})")

    def _check_logprobs(self, params: SamplingParams) -> None:
        cap = self.engine_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if cap == -1 or asked is None:
                continue
            alternatives = self.config.vocab_size if asked == -1 else asked
            if alternatives > cap:
                raise FlexSarathiError(
                    f"SamplingParams.{name}={asked} asks for {alternatives} alternatives per token, more than "
                    f"this engine's max_logprobs={cap} (LLM(max_logprobs=...), --max-logprobs; -1: no limit)")

    def _bad_word_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token ids as it would appear at the start of a text and after a space
        (vLLM's two spellings); the ids outside the model's vocabulary dropped."""
        words = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in words and max(ids) < self.config.vocab_size:
                    words.append(ids)
        return tuple(words)

    def validate_prompt(self, ids: list[int], index: int) -> None:
        if len(ids) == 0:
            raise FlexSarathiError(f"prompt {index} is empty")
        vocab = self.config.vocab_size
        not_ints = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
        if not_ints:
            raise FlexSarathiError(f"prompt {index}: {not_ints[0]!r} ({type(not_ints[0]).__name__}) is not "
                                   "an integer token id")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise FlexSarathiError(f"prompt {index}: token id {bad[0]!r} is outside the vocabulary "
                                   f"[0, {vocab})")
        if len(ids) > self.config.max_position_embeddings:
            raise FlexSarathiError(f"prompt {index} has {len(ids)} tokens, more than the model's "
                                   f"context of {self.config.max_position_embeddings}")

    def add_requests(self, groups: list[list[Sequence]]) -> None:
        """Queue a batch of requests, each the `n` sequences of one prompt (prefilled once for
        all). The KV cache is laid out for the batch: the policy's capacity (or, without one,
        max_running of its longest requests), pools growing only when they hold less; a request
        that cannot fit, or whose largest pass cannot, is refused before any work."""
        self._check_open()
        if self.scheduler.has_unfinished():
            raise FlexSarathiError("the engine runs one batch of requests at a time: step it to the "
                                   "end (or abort_all) before adding the next")
        with DeferredInterrupts():  # pools, blocks and queue change together: Ctrl-C waits for the end
            self._add_requests(groups)

    def _add_requests(self, groups: list[list[Sequence]]) -> None:
        seqs = [seq for group in groups for seq in group]
        if not seqs:
            return
        try:
            self._lay_out_batch(seqs)
        except MemoryBudgetError:
            # LoRA adapters of earlier batches that this one does not use give their room back
            if self.loras is None or not self.loras.drop_idle(keep={seq.lora_id for seq in seqs}):
                raise
            self._lay_out_batch(seqs)
        for group in groups:
            self.scheduler.add_group(group)
        if self.loras is not None:
            self.loras.batch_added()  # the batch's sequences hold their adapters from now on

    def _lay_out_batch(self, seqs: list[Sequence]) -> None:
        """The running set, KV pools and blocks for a batch of `seqs`; MemoryBudgetError where they, or
        its largest pass, do not fit."""
        lengths = _lengths(seqs)
        running = self.fitted_running(*lengths)
        if self.engine_config.fit_running:  # the running set fitted to this batch
            self.scheduler.set_max_running(running)
        blocks = self._kv_blocks(seqs, running)
        made = self._ensure_pools(self._pool_blocks(blocks), running)
        kept = tuple(t for t in self.kv_pools if t not in made)  # their cached prefixes stay
        self.blocks.resize(blocks, num_residual=running, kept=kept)
        self._check_worst_pass(lengths, running, blocks)
        self.batch_running = running

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[Sequence]:
        """Drop the unfinished requests (their KV blocks are free again); returns their sequences."""
        with DeferredInterrupts():
            return self.scheduler.abort_all()

    def _scheduler_config(self) -> SchedulerConfig:
        p = self.policy
        return SchedulerConfig(max_running=p.max_running, num_micro_batches=p.num_gpu_batches,
                               prefill_budget=p.prefill_budget, mode=p.scheduler, kv_admission=p.kv_admission,
                               token_multiple=GPU_TOKEN_MULTIPLE if self.device.type == "cuda" else 1)

    def set_schedule(self, **changes) -> None:
        """Change how passes are formed, not where tensors live (e.g. to run both schedulers on
        one engine): any of SCHEDULE_FIELDS. The scheduler is rebuilt; only while idle."""
        unknown = sorted(set(changes) - set(SCHEDULE_FIELDS))
        if unknown:
            raise FlexSarathiError(f"set_schedule changes only {SCHEDULE_FIELDS}, not {unknown}")
        if self.scheduler.has_unfinished():
            raise FlexSarathiError("set_schedule while requests run: step them to the end first")
        self.policy = self.policy.replace(**changes)
        self.scheduler = Scheduler(self._scheduler_config(), self.blocks)

    def fitted_running(self, prompt_lens: list[int], max_lens: list[int], all_logits: bool = False) -> int:
        """Sequences a batch of requests with these prompt and prompt + max_tokens lengths runs at
        once: the policy's max_running (or fewer requests); with fit_running the most of those
        whose KV pool and largest pass fit the compute tier (_room_for_batch)."""
        ceiling = min(self.policy.max_running, len(max_lens))
        if not self.engine_config.fit_running:
            return ceiling
        lengths = (prompt_lens, max_lens, all_logits)
        return largest_fitting(ceiling, lambda running: self._batch_bytes(lengths, running), self._room_for_batch())

    def _batch_bytes(self, lengths: tuple, running: int) -> int:
        """Compute-tier bytes of a batch (_lengths) at `running`: its KV pool and its largest pass."""
        blocks = _split_by_fractions(self._kv_total_blocks(max(lengths[1]), running), self.policy.kv_fractions)
        c, slots = self.config, self._pool_blocks(blocks).get("gpu", 0) * self.block_size
        pool = KVPool.nbytes_for(c.num_layers, slots, c.num_kv_heads, c.head_dim, self.dtype, self.kv_compression,
                                 running)
        return pool + self._worst_pass_bytes(lengths, running, blocks)

    def _room_for_batch(self) -> int:
        """Compute-tier bytes a batch may take: the tier's budget (given, or _fitted_budget's: what
        the device could allocate as the engine was built) less what is reserved there, plus the KV
        pool there now (a batch reuses or replaces it)."""
        held = self.kv_pools["gpu"].nbytes if "gpu" in self.kv_pools else 0
        return self.memory.available("gpu") + held  # fit_running: a budget (_fitted_budget's at least)

    def _pool_blocks(self, blocks: dict[str, int]) -> dict[str, int]:
        """The KV blocks each tier's pool holds: decode graphs add one gpu block, for padding rows."""
        return {**blocks, "gpu": blocks.get("gpu", 0) + 1} if self.graph_passes else blocks

    def _kv_blocks(self, seqs: list[Sequence], running: int) -> dict[str, int]:
        """KV blocks per tier; every request must fit the cache alone (else it could never run)."""
        p, longest = self.policy, max(s.max_len for s in seqs)
        per_seq, total = math.ceil(longest / self.block_size), self._kv_total_blocks(longest, running)
        if per_seq > total:
            index = next(i for i, s in enumerate(seqs) if s.max_len == longest)
            raise FlexSarathiError(
                f"request {index} needs {longest} tokens of KV cache (prompt + max_tokens) but "
                f"Policy.kv_cache_tokens={p.kv_cache_tokens} holds {total * self.block_size} "
                f"({self.block_size}-token blocks); raise kv_cache_tokens or lower max_tokens")
        return _split_by_fractions(total, p.kv_fractions)

    def _kv_total_blocks(self, longest: int, running: int) -> int:
        """The policy's KV capacity in blocks, or without one every running lifetime of the longest."""
        tokens = self.policy.kv_cache_tokens
        return math.ceil(longest / self.block_size) * running if tokens is None else tokens // self.block_size

    def _ensure_pools(self, blocks_per_tier: dict[str, int], num_residual: int) -> set[str]:
        """Pools that hold `blocks_per_tier` blocks and `num_residual` residual rows, those that
        already do kept; returns the tiers whose pools were made anew (what they held is gone)."""
        c, made = self.config, set()
        for tier, blocks in blocks_per_tier.items():
            pool = self.kv_pools.get(tier)
            if pool is not None and pool.num_slots >= blocks * self.block_size and (
                    pool.compression is None or pool.k_residual.shape[1] >= num_residual):
                continue
            if pool is not None:
                if tier == "gpu" and self.graph_passes:  # the graphs address the pool being replaced
                    self.graph_passes.clear()
                self.memory.release(tier, pool.nbytes, "KV cache")
                del self.kv_pools[tier], pool
            slots = blocks * self.block_size
            nbytes = KVPool.nbytes_for(c.num_layers, slots, c.num_kv_heads, c.head_dim, self.dtype,
                                       self.kv_compression, num_residual)
            self._check_room(tier, nbytes, slots)
            self.memory.reserve(tier, nbytes, "KV cache")
            device = self.device if tier == "gpu" else torch.device("cpu")
            self.kv_pools[tier] = KVPool(
                tier, c.num_layers, slots, c.num_kv_heads, c.head_dim, self.dtype, device,
                block_size=self.block_size, compression=self.kv_compression, num_residual=num_residual,
                pin_memory=tier == "cpu" and self.device.type == "cuda",
                folder=self._offload_folder() if tier == "disk" else None)
            made.add(tier)
        return made

    def _check_room(self, tier: str, nbytes: int, slots: int) -> None:
        """A tier no budget caps (no hardware=) still has the machine's room: a KV pool larger than
        what its memory (or the offload folder's disk) can give now is one MemoryBudgetError saying
        so, not torch's "can't allocate memory" or a kill by the OOM killer as its pages are touched."""
        if self.memory.available(tier) is not None:
            return  # the tracker's budget decides (MemoryTracker.reserve)
        if tier == "disk":
            where, room = f"free disk space in {self.offload_dir}", shutil.disk_usage(self._offload_folder()).free
        else:
            device = self.device if tier == "gpu" else torch.device("cpu")
            where, room = f"what {device} can allocate now", free_bytes(device)
        if nbytes > room:
            raise MemoryBudgetError(
                f"the {tier} tier's KV cache ({slots} token slots of Policy.kv_cache_tokens="
                f"{self.policy.kv_cache_tokens}) needs {human_bytes(nbytes)}, more than {where}: "
                f"{human_bytes(room)}; lower kv_cache_tokens or gpu_batch_size, or give hardware= budgets",
                tier=tier, what="KV cache", requested=nbytes, in_use=0, capacity=room)

    # ---- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the I/O threads, close the disk store's files and free the KV pools (their bytes go
        back to the tracker). Idempotent; the engine refuses new work after."""
        if self.closed:
            return
        self.closed = True
        if self.graph_passes:
            self.graph_passes.clear()
        self.executor.close()
        if self.loras is not None:
            self.loras.close()
        self.weights.close()
        for tier, pool in list(self.kv_pools.items()):
            self.memory.release(tier, pool.nbytes, "KV cache")
        self.kv_pools.clear()
        self.activations.close()
        release_host_buffers()

    def recover(self, forced: bool = False) -> None:
        """Called by step when an exception (KeyboardInterrupt included) escaped a pass: drop the
        interrupted batch's sequences (every KV block is free again), wait for the I/O threads
        and weight prefetches still running, drop parked activations and forget which layer
        sits in which working buffer. The next call then gives a fresh engine's results; if the
        engine cannot get there, it is closed and says why on its next use. forced: a second
        Ctrl-C stopped the pass wherever it stood (not between layers): nothing vouches for the
        state it left (a lock held, a buffer half written), so the engine is closed."""
        if self.closed:
            return
        if forced:  # the reason first: closing may itself be interrupted
            self._closed_because = ("a second Ctrl-C stopped a pass where it stood, not between layers, "
                                    "so its state cannot be vouched for")
            self.close()
            return
        self.scheduler.abort_all()
        self.blocks.release_all()  # and no cached prefix: nothing vouches for a pass cut short
        try:
            self.executor.reset()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except BaseException as exc:  # noqa: BLE001 - the caller re-raises the original error
            self.close()
            self._closed_because = (f"it could not recover from an interrupted pass "
                                    f"({type(exc).__name__}: {exc})")

    def _check_open(self) -> None:
        if self.closed:
            raise FlexSarathiError(f"this engine is closed ({self._closed_because}); create a new LLM")

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One pass; returns the sequences that finished in it. An exception inside it
        (KeyboardInterrupt included) leaves the engine as a fresh one (see recover) and propagates;
        between steps the engine is always consistent (prefetches of the next pass's first layers
        are valid loads), so every loop over step, LLM.generate's among them, is covered. A Ctrl-C
        that came after the pass is held (interrupt_held) and raised by raise_held_interrupt."""
        self.raise_held_interrupt()
        # Ctrl-C is taken between layers (offload/interrupts.py); one noted after the pass's last
        # layer is held: the step's work is done, and raised here its finished sequences would be lost
        with DeferredInterrupts(hold=True) as deferral:
            try:
                plan = self.scheduler.schedule()
                outputs = self.forward(plan)
                pools = self.engine_config.task in POOLING_TASKS
                seqs, token_ids = self.pool(outputs) if pools else self.sample(outputs)
                finished = self.scheduler.postprocess(plan, seqs, token_ids)
            except BaseException:
                self.recover(forced=deferral.forced)
                raise
        self.interrupt_held = deferral.held
        return finished

    def raise_held_interrupt(self) -> None:
        """Raise the Ctrl-C a step held (it came as the step ended; the step returned its finished
        sequences): LLM.generate_iter calls this once it has yielded them, step as it starts."""
        if self.interrupt_held:
            self.interrupt_held = False
            raise KeyboardInterrupt

    def forward(self, plan: SchedulerOutput) -> list[tuple[WorkItem, torch.Tensor]]:
        """Runs the scheduled pass. Returns each item that has logits with its rows [rows, vocab]
        (fp32, compute device): every prompt row for prompt_logprobs, else the last row where it samples."""
        replayed = self.graph_passes.forward(plan) if self.graph_passes else None
        if replayed is not None:
            self.stats["graph_passes"] += 1
            return replayed
        grouped_upto = self._prompts_grouped_upto()
        built = [build_micro_batch(items, self.blocks, grouped_upto) for items in plan.micro_batches]
        batches = [mb for mb, _ in built]
        with self.memory.reservation("gpu", self._pass_working_bytes(batches), "pass activations"):
            logits = self.executor.run(batches)
        for item in plan.items:
            if item.samples and item.seq.forks:  # the parent's prompt is prefilled: forks join
                self._copy_prompt_tail(item.seq)
        outputs = []  # logits stay on the compute device: the sampler works there
        for (_, spans), mb_logits in zip(built, logits):
            outputs += [(span.item, mb_logits[span.offset:span.offset + span.count]) for span in spans]
        for pool in self.kv_pools.values():  # CUDA's deferred inf/NaN check (one host sync)
            pool.check_finite()
        return outputs

    def _pass_working_bytes(self, batches) -> int:
        return self._working_bytes(self._pass_tokens(batches))

    def _pass_tokens(self, batches) -> PassTokens:
        """What this pass holds on the compute device (policy_search/working_set.py): the K/V the
        executor gathers there for each pair of consecutive micro-batches (k computes while k+1
        loads; the last and the next layer's first where it gathers ahead), and its largest decode
        and prompt attention calls."""
        held = []  # per micro-batch: K/V slots gathered onto the compute device
        keys_max = {True: 0, False: 0}  # is_decode -> the largest call's keys, and its score cells
        cells_max = {True: 0, False: 0}
        in_pool = 0  # the largest decode call its pool attends in place: keys indexed, nothing gathered
        for mb in batches:
            slots = 0
            for g in mb.groups:
                on_device = gathered_tiers(self.policy, g.is_decode)
                for p in g.parts:
                    if self.executor.one_causal_call(g, p):  # one fused call: its output only, but a
                        if self.kv_compression is not None:  # compressed pool's keys are held as gathered
                            slots += g.num_seqs * g.num_queries
                        continue
                    if p.new_rows is None and p.tier not in on_device:
                        continue  # attended on the CPU, where it lives
                    if self.kv_pools[p.tier].attends_in_pool(g, p, self.device):
                        in_pool = max(in_pool, p.kv_slots.numel())
                        continue
                    if p.new_rows is None:
                        slots += p.kv_slots.numel()
                    keys = g.num_seqs * (p.new_rows[1] - p.new_rows[0] if p.new_rows else p.kv_slots.shape[1])
                    keys_max[g.is_decode] = max(keys_max[g.is_decode], keys)
                    cells_max[g.is_decode] = max(cells_max[g.is_decode], keys * min(g.num_queries, QUERY_BLOCK))
            held.append(slots)
        ahead = self.executor.gathers_ahead(batches) and self.config.num_layers > 1
        widest = max(mb.num_tokens for mb in batches)
        return PassTokens(total=sum(mb.num_tokens for mb in batches), widest=widest,
                          slice_rows=min(widest, POST_ATTENTION_ROWS),
                          context_slots=max(a + b for a, b in zip(held, held[1:] + [held[0] if ahead else 0])),
                          attention_slots=keys_max[True] + keys_max[False],
                          attention_cells=cells_max[True] + cells_max[False],
                          logit_rows=sum(mb.logit_rows.numel() for mb in batches), in_pool_keys=in_pool)

    def _working_bytes(self, tokens: PassTokens) -> int:
        """Compute-device bytes a pass needs beyond weights and KV pools: the planner's formula
        (policy_search/working_set.py) on this engine's shapes and dtype."""
        if self._spec is None:  # once per engine: every pass asks (its config and dtype never change)
            self._spec = ModelSpec.from_hf(self.config, "engine", self.dtype.itemsize)
        return working_set(self._spec, tokens, self.kv_compression is not None).nbytes(self.policy.act_gpu)

    def _check_worst_pass(self, lengths: tuple, running: int, blocks: dict[str, int]) -> None:
        """Fail before any work when the largest pass this batch of requests can form would not
        fit the gpu tier next to the weights and KV pools."""
        self.worst_pass_bytes = worst = self._worst_pass_bytes(lengths, running, blocks)
        with self.memory.reservation("gpu", worst, "largest pass (activations)"):
            pass

    def _worst_pass_bytes(self, lengths: tuple, running: int, blocks: dict[str, int]) -> int:
        """The largest pass a batch (_lengths) forms at `running` with these KV blocks per tier."""
        prompt_lens, max_lens, all_logits = lengths
        pool_slots = {tier: n * self.block_size for tier, n in blocks.items()}  # what the blocks can hold
        in_pool = decode_in_pool_tiers(self.device, self.dtype, self.config.head_dim, self.kv_compression)
        kinds = worst_passes(self.policy, running, prompt_lens, max_lens, pool_slots, all_logits, in_pool)
        return max(self._working_bytes(tokens) for tokens in kinds)

    def sample(self, outputs: list[tuple[WorkItem, torch.Tensor]]) -> tuple[list[Sequence], list[int | None]]:
        """The sequences that sample after this pass with their tokens (None where the context is
        full): each item ending at its last token, and a parent's forks from the parent's row,
        each with its own generator, all rows processed as one batch on the compute device
        (engine/sampling.py). Records prompt and token logprobs on the way."""
        rows: list[tuple[Sequence, torch.Tensor]] = []
        for item, logits in outputs:
            if wants_prompt_logprobs(item):
                _record_prompt_logprobs(item.seq, item.start, item.end, logits)
            if item.samples:
                rows += [(seq, logits[-1]) for seq in (item.seq, *item.seq.forks)]
        # Before the step's first host sync (_finite_rows): on a GPU the host fills the grammars'
        # bitmask while the pass it launched still runs.
        bitmask = fill_grammar_bitmask([seq for seq, _ in rows], self.config.vocab_size,
                                       pinned=self.device.type == "cuda")
        seqs, logits = self._finite_rows([(seq, row) for seq, row in rows if not seq.context_full])
        tokens: dict[Sequence, int] = {}
        if seqs:
            if bitmask is not None and len(seqs) < len(rows):  # rows dropped: their bitmask rows too
                position = {seq: i for i, (seq, _) in enumerate(rows)}
                bitmask = bitmask[[position[s] for s in seqs]]
            sampled = sample(process_logits(logits, seqs, bitmask), [s.params for s in seqs],
                             [s.generator for s in seqs])
            seqs, sampled, logits = _drop_unsampled(seqs, sampled, logits)
            advance_matchers(seqs, sampled)
            wanted = [i for i, s in enumerate(seqs) if s.logprobs is not None]
            if wanted:  # of the model's distribution, as vLLM's raw logprobs
                steps = top_logprobs(logits[wanted], torch.tensor([sampled[i] for i in wanted]),
                                     [seqs[i].params.logprobs for i in wanted])
                for i, step in zip(wanted, steps):
                    seqs[i].logprobs.append(step)
            tokens = dict(zip(seqs, sampled))
        return [seq for seq, _ in rows], [tokens.get(seq) for seq, _ in rows]

    def _finite_rows(self, rows: list[tuple[Sequence, torch.Tensor]]) -> tuple[list[Sequence], torch.Tensor | None]:
        """The sequences whose logits are all finite and those logits stacked ([R, vocab]; None
        where no row is left). A NaN or inf (a pass that overflowed its dtype) would be sampled as
        some token, silently: its sequence fails instead (Sequence.error), and only its request:
        the other rows of the pass were computed apart from it."""
        if not rows:
            return [], None
        logits = torch.stack([row for _, row in rows])  # [R, vocab]
        finite = finite_rows(logits).tolist()  # [R]
        for (seq, _), ok in zip(rows, finite):
            if not ok:
                dtype = str(self.dtype).removeprefix("torch.")
                hint = "; --dtype float32 may avoid it" if self.dtype != torch.float32 else ""
                seq.error = (f"the model's logits for output token {len(seq.output_token_ids) + 1} are not finite "
                             f"(NaN or inf: the pass overflowed {dtype}){hint}")
        if all(finite):
            return [seq for seq, _ in rows], logits
        keep = [i for i, ok in enumerate(finite) if ok]
        return [rows[i][0] for i in keep], (logits[keep] if keep else None)

    def _copy_prompt_tail(self, parent: Sequence) -> None:
        """Each fork of `parent` gets a copy of the KV of the prompt's last, partial block in its
        own block (any tier: pools share a layout); the complete ones it shares."""
        index, count = divmod(parent.num_prompt_tokens, self.block_size)
        for fork in parent.forks if count else ():
            src, src_slots = self.blocks.local_slots(parent.block_table[index], count)
            dst, dst_slots = self.blocks.local_slots(fork.block_table[index], count)
            self.kv_pools[src].copy_slots(self.kv_pools[dst], src_slots, dst_slots,
                                          parent.residual_id, fork.residual_id)

    def to_output(self, seqs: Sequence | list[Sequence]) -> RequestOutput | EmbeddingRequestOutput:
        """The request's output from its finished sequence(s): one per completion (`n`); an
        embedding request's its embedding."""
        seqs = [seqs] if isinstance(seqs, Sequence) else seqs
        first = seqs[0]
        if first.pooling is not None:
            classifies = self.engine_config.task == "classify"
            kind, output = ((ClassificationRequestOutput, ClassificationOutput) if classifies
                            else (EmbeddingRequestOutput, EmbeddingOutput))
            return kind(request_id=first.seq_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                        outputs=None if first.error is not None else output(first.pooled), error=first.error)
        failed = next((seq.error for seq in seqs if seq.error is not None), None)
        if failed is not None:  # one completion failed: the request did (its others are not what was asked)
            return RequestOutput(request_id=first.seq_id, prompt=first.prompt,
                                 prompt_token_ids=first.prompt_token_ids, outputs=[], error=failed)
        return RequestOutput(
            request_id=first.seq_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(i, seq) for i, seq in enumerate(seqs)],
            prompt_logprobs=self._prompt_logprobs(first), num_cached_tokens=first.num_cached_tokens)

    def _prompt_logprobs(self, seq: Sequence) -> list[dict[int, Logprob] | None] | None:
        if seq.params.prompt_logprobs is None:
            return None
        steps = [None] + list(seq.prompt_logprobs)
        if self.tokenizer is not None:
            decode_logprobs(steps, self._decode_token)
        return steps

    def _decode_token(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def _completion(self, index: int, seq: Sequence) -> CompletionOutput:
        text = (self.tokenizer.completion_text(seq.prompt_token_ids, seq.output_token_ids, seq.params.skip_special_tokens)
                if self.tokenizer else "")
        if seq.stop_text_end is not None:
            text = text[:seq.stop_text_end]
        logprobs = seq.logprobs
        cumulative = (sum(lp[t].logprob for lp, t in zip(logprobs, seq.output_token_ids))
                      if logprobs is not None else None)
        if logprobs is not None and self.tokenizer is not None:
            decode_logprobs(logprobs, self._decode_token)
        stop_reason = seq.stop_reason  # None for EOS, as vLLM
        if isinstance(stop_reason, int) and stop_reason not in seq.params.stop_token_ids:
            stop_reason = None
        return CompletionOutput(index=index, text=text, token_ids=list(seq.output_token_ids),
                                finish_reason=seq.finish_reason, stop_reason=stop_reason,
                                cumulative_logprob=cumulative, logprobs=logprobs)


def _opened_for(e: EngineConfig, opened: OpenedModel | None) -> OpenedModel:
    """The engine's model: the caller's (checked to be the configured one) or opened here."""
    drawn = e.weight_quant if e.dummy_weight_codes and e.policy.compress_weight else None
    if opened is None:
        return open_model(e.model, codes=drawn, lora=e.lora)
    if (opened.name, opened.codes, opened.lora) != (e.model, drawn, e.lora):
        raise FlexSarathiError(f"the opened model ({opened.name}, codes {opened.codes}, LoRA {opened.lora}) is not "
                               f"the one this engine is configured for ({e.model}, codes {drawn}, LoRA {e.lora})")
    return opened


def _fitted_budget(budget: TierBudget | None, fit_running: bool, device: torch.device) -> TierBudget | None:
    """A policy-less engine (fit_running) without a compute-tier budget holds itself to FIT_FRACTION
    of what the device can allocate now: a model that does not fit fails before anything is
    loaded, with the arithmetic, instead of meeting the OOM killer (or CUDA's) halfway through. On
    the CPU the cpu tier (a load's layers in flight) is that same RAM: both held to it together."""
    if not fit_running or (budget is not None and budget.gpu is not None):
        return budget
    room = int(free_bytes(device) * FIT_FRACTION)
    return dataclasses.replace(budget or TierBudget(), gpu=room, host=room if device.type == "cpu" else None)


def _lengths(seqs: list[Sequence]) -> tuple[list[int], list[int], bool]:
    """(prompt lengths, prompt + max_tokens lengths, whether any keeps every row's logits): what
    sizes a batch's KV cache and passes."""
    return ([s.num_prompt_tokens for s in seqs], [s.max_len for s in seqs],
            any(s.params.prompt_logprobs is not None for s in seqs))


def _split_by_fractions(total: int, fractions: tuple[float, float, float]) -> dict[str, int]:
    """Blocks per tier, proportional to the fractions (largest remainder, summing to total)."""
    exact = [f * total for f in fractions]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)[:total - sum(counts)]:
        counts[i] += 1
    return {tier: n for tier, n in zip(TIERS, counts) if n > 0}


def _eos_ids(config, tokenizer) -> frozenset[int]:
    """config.json's EOS ids and every one the tokenizer knows (generation_config.json may list
    several: Llama-3-Instruct's <|end_of_text|> and <|eot_id|>)."""
    return frozenset(config.eos_token_ids) | (set(tokenizer.eos_token_ids) if tokenizer else set())


def _drop_unsampled(seqs: list[Sequence], sampled: list[int | None],
                    logits: torch.Tensor) -> tuple[list[Sequence], list[int], torch.Tensor]:
    """The rows that sampled a token (seqs, tokens, their logits rows); a sequence whose processed
    row allowed no token fails (Sequence.error), and only its request, rather than take a token
    none of its rules allow."""
    if all(token is not None for token in sampled):
        return seqs, sampled, logits
    for seq, token in zip(seqs, sampled):
        if token is None:
            seq.error = (f"no token may follow output token {len(seq.output_token_ids)}: its structured output, "
                         "bad_words, stop rules (before min_tokens), allowed_token_ids and logit_bias "
                         "leave none")
    keep = [i for i, token in enumerate(sampled) if token is not None]
    return [seqs[i] for i in keep], [sampled[i] for i in keep], logits[keep]


def _record_prompt_logprobs(seq: Sequence, start: int, end: int, rows: torch.Tensor) -> None:
    """rows[i] predicts position start + i + 1; keep those that land inside the prompt."""
    stop = min(end, seq.num_prompt_tokens - 1)
    if seq.params.prompt_logprobs is None or stop <= start:
        return
    seq.prompt_logprobs += prompt_logprobs(rows[:stop - start], seq.prompt_token_ids[start + 1:stop + 1],
                                           seq.params.prompt_logprobs)
