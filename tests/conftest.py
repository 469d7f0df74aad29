"""Shared fixtures: tiny random-weight HF models saved as safetensors, and ../shared data."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
TINYSTORIES_TEXT = SHARED / "data" / "tinystories_valid_head.txt"

# `python -c KILLED_AFTER_RECORDS N ARGS...` runs `flexsarathi ARGS...` and SIGKILLs itself right after
# its N-th record is written and flushed: kill -9 at a named point of the job, never on a timer.
KILLED_AFTER_RECORDS = """
import os, signal, sys
from flexsarathi.cli import result_file
from flexsarathi.cli.main import main
after, append, written = int(sys.argv[1]), result_file.ResultFile.append, []

def append_then_die(self, record):
    append(self, record)
    written.append(record)
    if len(written) == after:
        os.kill(os.getpid(), signal.SIGKILL)

result_file.ResultFile.append = append_then_die
sys.exit(main(sys.argv[2:]))
"""

# Small configs of every supported family and variant. Each is built with transformers (the
# reference implementation), given random weights and saved with save_pretrained (safetensors).
TINY_CONFIGS = {
    "opt": dict(model_type="opt", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                word_embed_proj_dim=32, do_layer_norm_before=True),
    # opt-350m style: post-norm, embeddings narrower than the hidden size (project_in/out).
    "opt350m": dict(model_type="opt", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                    word_embed_proj_dim=16, do_layer_norm_before=False),
    "llama_gqa_untied": dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=48,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10000.0),
    "llama_tied_headdim": dict(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16}),
    "qwen2": dict(model_type="qwen2", vocab_size=128, hidden_size=32, intermediate_size=48,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", vocab_size=128, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, sliding_window=None, tie_word_embeddings=False),
}
# Qwen3 and the mixture-of-experts families: head_dim independent of hidden / heads, several expert
# counts and top-k, renormalised or not, a shared expert, dense layers among sparse ones.
_QWEN3_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
TINY_CONFIGS.update({
    "qwen3": dict(_QWEN3_BASE, model_type="qwen3", tie_word_embeddings=False),
    "qwen3_tied": dict(_QWEN3_BASE, model_type="qwen3", head_dim=12, num_key_value_heads=1,
                       tie_word_embeddings=True, rope_theta=1000000.0),
    # YaRN (Qwen3's long-context recipe): pretrained on 8 positions, run past them; the second with
    # its options away from the defaults (an mscale pair, another ramp, no truncation)
    "qwen3_yarn": dict(_QWEN3_BASE, model_type="qwen3", tie_word_embeddings=False,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
    # (head_dim 16, base 100: the ramp spans fractional dimensions, so truncating it would show)
    "llama_yarn_mscale": dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=48,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64, tie_word_embeddings=False, rope_theta=100.0,
                              rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                                            "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 4.0, "beta_slow": 0.5,
                                            "truncate": False}),
    "qwen3_moe": dict(_QWEN3_BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24, norm_topk_prob=True, tie_word_embeddings=False),
    # 8 experts, top-3, not renormalised, layer 1 dense (mlp_only_layers), tied head
    "qwen3_moe_dense_layer": dict(_QWEN3_BASE, model_type="qwen3_moe", num_hidden_layers=3, num_experts=8,
                                  num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=False,
                                  mlp_only_layers=[1], tie_word_embeddings=True),
    "mixtral": dict(model_type="mixtral", vocab_size=128, hidden_size=32, intermediate_size=40,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
    "mixtral_top1_tied": dict(model_type="mixtral", vocab_size=128, hidden_size=32, intermediate_size=24,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              max_position_embeddings=64, num_local_experts=3, num_experts_per_tok=1,
                              tie_word_embeddings=True),
    # shared expert with its sigmoid gate; decoder_sparse_step=2: layers 1, 3 sparse, 0, 2 dense
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=128, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
                      tie_word_embeddings=False),
    "qwen2_moe_norm_tied": dict(model_type="qwen2_moe", vocab_size=128, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=64, num_experts=5, num_experts_per_tok=3,
                                moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                norm_topk_prob=True, tie_word_embeddings=True),
})
# Gemma 3: sliding layers (window 5, RoPE base 10k) among full ones (a global base, linear scaling),
# scores scaled by query_pre_attn_scalar ** -0.5, (1 + w) norms; one with soft-capped logits
_GEMMA3_BASE = dict(model_type="gemma3_text", vocab_size=128, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=64, query_pre_attn_scalar=20, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
# Phi-3 / Phi-4: q/k/v and gate/up fused in the checkpoint; one with mistral's sliding window
TINY_CONFIGS.update({
    "phi3": dict(model_type="phi3", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=250000.0,
                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "phi3_partial_rotary": dict(model_type="phi3", vocab_size=128, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=64, partial_rotary_factor=0.5, tie_word_embeddings=False,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "phi3_window": dict(model_type="phi3", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, sliding_window=6,
                        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2),
})
# Granite: its multipliers away from 1 (embedding, scores, residual branches, logits), tied or not
TINY_CONFIGS.update({
    "granite": dict(model_type="granite", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                    embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                    logits_scaling=8.0),
    "granite_untied": dict(model_type="granite", vocab_size=128, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           max_position_embeddings=64, tie_word_embeddings=False, embedding_multiplier=3.0,
                           attention_multiplier=0.5, residual_multiplier=0.5, logits_scaling=0.25),
})
# OLMo 2 / 3: post-norms, q/k normalised whole; OLMo 3's sliding layers (window 5; every 4th full) with
# YaRN on the full ones only
_OLMO_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
TINY_CONFIGS.update({
    "olmo2": dict(_OLMO_BASE, model_type="olmo2", rope_theta=500000.0),
    "olmo3": dict(_OLMO_BASE, model_type="olmo3", sliding_window=5,
                  rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500000.0,
                                                      "original_max_position_embeddings": 8},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
})
TINY_CONFIGS.update({
    "gemma3": _GEMMA3_BASE,
    "gemma3_softcap": dict(_GEMMA3_BASE, num_key_value_heads=1, final_logit_softcapping=3.0, sliding_window=3,
                           layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"]),
})
# gpt-oss: sinks, alternating windows (4), YaRN; 4 experts of width 64 (MXFP4 rows: multiples of 32), the GLU's
# clamp low enough to bite on these weights
_GPT_OSS_BASE = dict(model_type="gpt_oss", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64, swiglu_limit=0.5,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 16,
                                      "rope_theta": 150000.0},
                     tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_CONFIGS.update({"gpt_oss": _GPT_OSS_BASE})
# GLM-4.5 / 4.7: RoPE over half of each head, biased q/k/v (not o), a dense first layer, sigmoid routing
# with a correction bias within the best of two groups, scaled, a shared expert; the Air's plain variant
_GLM_BASE = dict(model_type="glm4_moe", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=24,
                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=64, rope_theta=10000.0,
                 tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_CONFIGS.update({
    "glm4_moe": dict(_GLM_BASE, use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    "glm4_moe_air": dict(_GLM_BASE, use_qk_norm=False, n_shared_experts=2, norm_topk_prob=False),
})
# MiniMax-M2: q/k normalised over the whole projection, RoPE over 8 of 16 dims (its rotary_dim), sigmoid routing
TINY_CONFIGS["minimax_m2"] = dict(model_type="minimax_m2", vocab_size=128, hidden_size=32, intermediate_size=24,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_local_experts=8, num_experts_per_tok=2, rotary_dim=8, max_position_embeddings=64,
                                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE_KINDS = ["qwen3_moe", "qwen3_moe_dense_layer", "mixtral", "mixtral_top1_tied", "qwen2_moe",
             "qwen2_moe_norm_tied"]
# Deeper variants for placement tests: with 6 layers, two working buffers are a third of the layers.
TINY_CONFIGS["opt_deep"] = dict(TINY_CONFIGS["opt"], num_hidden_layers=6)
TINY_CONFIGS["llama_deep"] = dict(TINY_CONFIGS["llama_gqa_untied"], num_hidden_layers=6)
TINY_CONFIGS["mixtral_deep"] = dict(TINY_CONFIGS["mixtral"], num_hidden_layers=6)
TINY_CONFIGS["qwen2_moe_deep"] = dict(TINY_CONFIGS["qwen2_moe"], num_hidden_layers=6)
TINY_CONFIGS["gpt_oss_deep"] = dict(TINY_CONFIGS["gpt_oss"], num_hidden_layers=6)
TINY_CONFIGS["glm4_moe_deep"] = dict(TINY_CONFIGS["glm4_moe"], num_hidden_layers=6, first_k_dense_replace=2)
TINY_CONFIGS["gemma3_deep"] = dict(TINY_CONFIGS["gemma3"], num_hidden_layers=6,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
# Every weight a whole number of 64-row blocks and 64-value groups: what the CPU int4 kernel covers.
TINY_CONFIGS["opt_blocks64"] = dict(TINY_CONFIGS["opt"], hidden_size=128, ffn_dim=256, word_embed_proj_dim=128,
                                    num_hidden_layers=4, max_position_embeddings=128)
TINY_CONFIGS["llama_blocks64"] = dict(TINY_CONFIGS["llama_gqa_untied"], hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, max_position_embeddings=128)


# The CPU compute dtype's cache (flexsarathi/machine/dtype_choice.py) in a folder of this run, set when
# this file is imported (before test modules copy os.environ for their subprocesses and Ray actors):
# the suite neither reads nor writes the user's ~/.cache choice. Removed at exit.
TEST_CACHE_DIR = tempfile.mkdtemp(prefix="flexsarathi-test-cache-")
os.environ["FLEXSARATHI_CACHE_DIR"] = TEST_CACHE_DIR
atexit.register(shutil.rmtree, TEST_CACHE_DIR, ignore_errors=True)


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler while the test runs (a test run earlier in this process may have
    left another; interrupt_main and raise_signal do nothing where SIGINT is ignored): the handler
    the engine defers (offload/interrupts.py). Restored after."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


@contextlib.contextmanager
def on_call(owner, name: str, at_call: int, action):
    """owner.name (a method or function attribute) runs `action()` on its at_call-th call, then
    itself as before (unless action raised); restored on exit. Yields the list of calls so far."""
    real, calls, own = getattr(owner, name), [], name in vars(owner)

    def wrapped(*args, **kwargs):
        calls.append(args)
        if len(calls) == at_call:
            action()
        return real(*args, **kwargs)

    setattr(owner, name, wrapped)
    try:
        yield calls
    finally:
        setattr(owner, name, real) if own else delattr(owner, name)


def poison_last_hidden(monkeypatch, prompt: list[int]) -> None:
    """From now on, LLMEngine.forward puts a NaN in the last hidden state of `prompt`'s request when its
    prefill ends (after the pass, as a pass that overflowed would leave it): a pooling engine's fault."""
    from flexsarathi.engine.llm_engine import LLMEngine

    forward = LLMEngine.forward

    def poisoned(self, plan):
        outputs = forward(self, plan)
        for item, hidden in outputs:
            if item.seq.prompt_token_ids == prompt and item.samples:
                with torch.inference_mode():
                    hidden[-1, 3] = float("nan")
        return outputs

    monkeypatch.setattr(LLMEngine, "forward", poisoned)


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, options: str, why: str):
    """A tmpfs mounted at `mount` (created) with mount `options` (e.g. "size=256k,ro"); skips the
    test, saying `why` it needs one, where mounting is not permitted (it needs root; CI runs as
    root). Unmounted on exit."""
    mount.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'not root'}): {why}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def build_hf_model(kind: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS[kind])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger-than-init weights so that mistakes show in the logits
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # a router's learned bias kept as a buffer (glm4_moe)
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(kind) -> (folder, transformers model) saved once per session."""
    cache: dict[str, tuple[str, object]] = {}

    def make(kind: str):
        if kind not in cache:
            model = build_hf_model(kind)
            folder = tmp_path_factory.mktemp(kind)
            model.save_pretrained(folder, safe_serialization=True)
            cache[kind] = (str(folder), model)
        return cache[kind]

    return make


def checkpoint_to_rewrite(tiny_checkpoint, kind: str, folder: Path):
    """The tiny `kind` checkpoint copied to `folder` (for a test to store some tensors otherwise), its
    tensors, and a copy of transformers' model to give the values the rewritten ones stand for."""
    from safetensors.torch import load_file

    source, model = tiny_checkpoint(kind)
    shutil.copytree(source, folder)
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    return folder, load_file(folder / "model.safetensors"), reference


def with_chat_template(stories_dir: str, folder: Path, template: str) -> str:
    """stories260K copied to `folder` with `template` as its chat template (it ships none)."""
    shutil.copytree(stories_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return str(folder)


@pytest.fixture(scope="session")
def stories_dir() -> str:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"{STORIES} is absent: the shared stories260K checkpoint is needed")
    return str(STORIES)


@pytest.fixture(scope="session")
def stories_hf(stories_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(stories_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tinystories_text() -> str:
    if not TINYSTORIES_TEXT.is_file():
        pytest.skip(f"{TINYSTORIES_TEXT} is absent")
    return TINYSTORIES_TEXT.read_text()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
