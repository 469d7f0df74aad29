"""GGUF files for tests, written with the `gguf` package's writer the way llama.cpp's
convert_hf_to_gguf.py writes them: llama.cpp's tensor names, llama's (and Mixtral's) q/k rows
permuted into the interleaved RoPE layout, norms and routers in F32, matrices in the asked type
(`gguf.quants.quantize` where the package has it; for K-quants, random codes drawn directly with
small fp16 scales). Mixture-of-experts models: each layer's experts as llama.cpp stacks them, one
3-D tensor per kind (ffn_gate_exps, ffn_up_exps [E, F, H], ffn_down_exps [E, H, F]), from
transformers' fused `experts.gate_up_proj` [E, 2F, H] (gate rows first) and `experts.down_proj`;
Mixtral as architecture `llama` with `llama.expert_count`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Byte offsets of each block's fp16 scale fields, to draw them small (random bytes would make
# weights of any size, NaNs included).
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
               "IQ2_XXS": (0,)}
# fp16 scale fields of drawn codes: weights up to about 0.1, as a trained model's (the largest
# code times the largest sub-block scale times this)
DRAWN_SCALE = {"Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 2.5e-5, "Q2_K": 2e-3, "Q3_K": 1e-3, "IQ4_NL": 1e-3,
               "IQ4_XS": 1e-3}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "BF16")
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# transformers' model_type -> llama.cpp's general.architecture
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
             "mixtral": "llama", "gemma3_text": "gemma3", "phi3": "phi3",
             "granite": "granite", "glm4_moe": "glm4moe"}
# glm4moe (llama.cpp's Glm4MoeModel): its MLP norm's name, the shared experts'; the router's correction bias
GLM4_MOE_NAMES = {"post_attention_layernorm": "post_attention_norm", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                  "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# gemma3 (llama.cpp's Gemma3Model): its sandwich norms' names, every norm stored as 1 + w
GEMMA3_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
PERMUTED_QK = ("llama", "mixtral", "granite")  # llama.cpp's LlamaModel permutes q/k rows (Mixtral, Granite are)
ALWAYS_F32 = ("ffn_gate_inp",)  # routers: llama.cpp's converter and quantizer keep them F32


# Every matrix a whole number of 256-value super-blocks (K-quants) and 32-value blocks.
GGUF_CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True, rope_theta=1e6),
}
GGUF_CONFIGS["llama_deep"] = dict(GGUF_CONFIGS["llama"], num_hidden_layers=4)
# Every matrix row a whole number of 32-value blocks. qwen3: head_dim 64, not hidden / heads.
_SMALL = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6)
GGUF_CONFIGS.update({
    "qwen3": dict(_SMALL, model_type="qwen3", head_dim=64, tie_word_embeddings=True),
    "qwen3_moe": dict(_SMALL, model_type="qwen3_moe", head_dim=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, norm_topk_prob=True, tie_word_embeddings=False),
    # layer 0 dense (mlp_only_layers): llama.cpp's own qwen2moe graph needs experts in every layer,
    # the file is one it would not load; its tensors are what convert_hf_to_gguf.py writes per layer
    "qwen2_moe": dict(_SMALL, model_type="qwen2_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, shared_expert_intermediate_size=96, norm_topk_prob=False,
                      mlp_only_layers=[0], tie_word_embeddings=False),
    "mixtral": dict(_SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    tie_word_embeddings=False),
    # every matrix, experts included, a whole number of 256-value super-blocks per row (K-quants)
    "qwen3_moe_k": dict(_SMALL, model_type="qwen3_moe", hidden_size=256, intermediate_size=512, head_dim=64,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True,
                        tie_word_embeddings=False),
    # what llama.cpp's gemma3 graph assumes of the files it reads: every 6th layer full, local RoPE base
    # 10k, scores scaled by 1/sqrt(head_dim) (not the 27B); window 5 binds within the tests' prompts
    # Granite (GraniteModel's file: a llama one, q/k permuted, with its four scales)
    "granite": dict(_SMALL, model_type="granite", tie_word_embeddings=False, embedding_multiplier=12.0,
                    attention_multiplier=0.015625, residual_multiplier=0.22, logits_scaling=8.0),
    # Phi-3 (Phi3MiniModel's file): attn_qkv and ffn_up (gate and up) fused as in the checkpoint; a window
    "phi3": dict(_SMALL, model_type="phi3", sliding_window=6, tie_word_embeddings=False, pad_token_id=0),
    # GLM-4.5 (Glm4MoeModel's file): RoPE over half of each head, a dense first layer, sigmoid routing with its
    # correction bias (exp_probs_b), scaled, a shared expert, q/k/v biased
    "glm4_moe": dict(_SMALL, model_type="glm4_moe", num_hidden_layers=3, head_dim=64, moe_intermediate_size=64,
                     n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, routed_scaling_factor=2.5,
                     norm_topk_prob=True, tie_word_embeddings=False),
    "gemma3": dict(_SMALL, model_type="gemma3_text", num_hidden_layers=6, head_dim=64, query_pre_attn_scalar=64,
                   sliding_window=5, rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True),
})


def build_model(kind: str, seed: int = 0):
    """A transformers model of GGUF_CONFIGS[kind] with random weights of a realistic size."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(GGUF_CONFIGS[kind])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if "norm" in name else 0.05 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # glm4_moe's router correction bias
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1e-4) -> np.ndarray:
    """uint8 [rows, bytes per row]: random codes, every fp16 scale field |N(0, 1)| * `scale`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[type_name]:
        d = (np.abs(rng.standard_normal(raw.shape[0])) * scale).astype(np.float16)
        raw[:, offset:offset + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's rotate-half row order -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_tensor(values: np.ndarray, type_name: str, rng: np.random.Generator):
    """(array, raw_dtype) for GGUFWriter.add_tensor: F32/F16 as values, others quantized."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    qtype = GGMLQuantizationType[type_name]
    if values.shape[-1] % GGML_QUANT_SIZES[qtype][0]:  # llama.cpp's fallback for rows not whole blocks
        return values.astype(np.float16), None
    if type_name in QUANTIZABLE:
        return quants.quantize(values.astype(np.float32), qtype), qtype
    rows = random_blocks(type_name, int(np.prod(values.shape[:-1])), values.shape[-1], rng,
                         scale=DRAWN_SCALE.get(type_name, 1e-4))
    return rows.reshape(*values.shape[:-1], -1), qtype


def write_gguf(model, path: Path, weight_type: str = "F32", embed_type: str = "F32", tokenizer: dict | None = None,
               split_max_tensors: int = 0, seed: int = 0, type_of=None, extra: dict | None = None,
               per_expert: bool = False) -> list[Path]:
    """Write an HF llama/qwen2/qwen3/MoE model; returns the file(s) written. type_of(gguf name)
    overrides weight_type per tensor (mixed files like Q4_K_M); extra: more F32 tensors by name;
    per_expert: experts as one 2-D tensor each (llama.cpp's files before April 2024)."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, cfg)
    for key, value in (tokenizer or {}).items():
        _add_value(writer, key, value)
    rng = np.random.default_rng(seed)
    for name, values in _tensors(model, per_expert=per_expert):
        kind = embed_type if name in ("token_embd.weight", "output.weight") else weight_type
        kind = type_of(name) if type_of and values.ndim >= 2 and type_of(name) else kind
        matrix = values.ndim >= 2 and name.split(".")[-2] not in ALWAYS_F32
        array, raw_dtype = encode_tensor(values, kind if matrix else "F32", rng)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    names = writer.format_shard_names(Path(path)) if split_max_tensors else [Path(path)]
    return [Path(p) for p in names]


def _write_metadata(writer, cfg) -> None:
    writer.add_name("tiny-test")
    if cfg.model_type == "granite":  # convert_hf_to_gguf.py's GraniteModel: the multipliers as scales
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
        writer.add_attention_scale(cfg.attention_multiplier)
    if cfg.model_type == "phi3":  # convert_hf_to_gguf.py's Phi3MiniModel
        writer.add_sliding_window(cfg.sliding_window or 0)
    if cfg.model_type == "gemma3_text":  # convert_hf_to_gguf.py's Gemma3Model
        writer.add_sliding_window(cfg.sliding_window)
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_scaling_type(gguf_rope_scaling(full["rope_type"]))
        writer.add_rope_scaling_factor(full.get("factor", 1.0))
        cfg = _with_theta(cfg, full["rope_theta"])
    # glm4moe: block_count counts the MTP layer(s) stored after the model's own (Glm4MoeModel)
    nextn = (getattr(cfg, "num_nextn_predict_layers", 0) or 0) if cfg.model_type == "glm4_moe" else 0
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    writer.add_block_count(cfg.num_hidden_layers + nextn)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    partial = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    _write_moe_metadata(writer, cfg)


def gguf_rope_scaling(kind: str):
    import gguf

    return {"linear": gguf.RopeScalingType.LINEAR, "default": gguf.RopeScalingType.NONE}[kind]


def _with_theta(cfg, theta: float):
    """cfg whose rope_parameters name `theta` (what _write_metadata writes as rope.freq_base)."""
    import copy

    cfg = copy.deepcopy(cfg)
    cfg.rope_parameters = {"rope_theta": theta}
    return cfg


def _write_moe_metadata(writer, cfg) -> None:
    """What convert_hf_to_gguf.py writes for experts: count and top-k (TextModel), the qwen MoE
    models' expert widths (Qwen2MoeModel, which Qwen3MoeModel extends)."""
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not experts:
        return
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if cfg.model_type == "glm4_moe":  # Glm4MoeModel's
        import gguf

        writer.add_expert_shared_count(cfg.n_shared_experts)
        writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _add_value(writer, key: str, value) -> None:
    import gguf

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif value and isinstance(value[0], str):
        writer.add_array(key, value)
    elif value and isinstance(value[0], float):
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
    else:
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)


def dequantized_model(model, path: Path):
    """`model` with every weight replaced by gguf's own dequantization (`quants.dequantize`) of the
    file's values of it: the reference where transformers cannot load the file. Each HF value is
    found in the file by pushing its index through the writer's layout (`_tensors`: row
    permutations, splits and reshapes only)."""
    import torch
    from gguf import GGUFReader, quants

    gemma = model.config.model_type == "gemma3_text"
    stored = {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
              - (1.0 if gemma and t.name.endswith("norm.weight") else 0.0)  # llama.cpp's 1 + w, undone
              for t in GGUFReader(str(path)).tensors}
    state, offsets, total = model.state_dict(), {}, 0
    for key, value in state.items():
        offsets[key], total = total, total + value.numel()
    index = {k: np.arange(offsets[k], offsets[k] + v.numel()).reshape(tuple(v.shape)) for k, v in state.items()}
    flat = np.full(total, np.nan, dtype=np.float32)
    for name, where in _tensors(model, index):
        flat[where.reshape(-1)] = stored[name]
    with torch.no_grad():
        for key, value in state.items():
            found = flat[offsets[key]:offsets[key] + value.numel()]
            if not np.isnan(found).all():  # all NaN: a tied lm_head, not in the file
                value.copy_(torch.from_numpy(found).reshape(value.shape))
    return model


def _tensors(model, state: dict | None = None, per_expert: bool = False):
    """(GGUF name, fp32 numpy array) in llama.cpp's order and layout (of `state`'s arrays if given;
    else the model's values: gemma3's norms then stored as 1 + w, as llama.cpp's converter does)."""
    cfg = model.config
    gemma = cfg.model_type == "gemma3_text"
    if state is None:
        state = {k: v.detach().float().numpy() + (1.0 if gemma and k.endswith("norm.weight") else 0.0)
                 for k, v in model.state_dict().items()}
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]
    own = {"gemma3_text": GEMMA3_NAMES, "glm4_moe": GLM4_MOE_NAMES}.get(cfg.model_type, {})
    for i in range(cfg.num_hidden_layers):
        correction = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        if correction in state:
            yield f"blk.{i}.exp_probs_b.bias", state[correction]
        for hf, short in {**LAYER_NAMES, **own}.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf}.{kind}"
                if key not in state:
                    continue
                values = state[key]
                if cfg.model_type in PERMUTED_QK and short in ("attn_q", "attn_k"):
                    heads = cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads
                    values = permute_qk(values, heads)
                if short == "ffn_gate_inp_shexp":  # HF's [1, hidden]; llama.cpp's {n_embd}
                    values = values.reshape(-1)
                yield f"blk.{i}.{short}.{kind}", values
        yield from _expert_tensors(state, i, per_expert)


def _expert_tensors(state: dict, layer: int, per_expert: bool = False):
    """A sparse layer's experts as llama.cpp's three 3-D stacks (none for a dense layer); per_expert:
    as its files before April 2024 hold them, one 2-D tensor per expert (blk.N.ffn_gate.E.weight)."""
    p = f"model.layers.{layer}.mlp.experts."
    if p + "gate_up_proj" not in state:
        return
    gate_up, down = state[p + "gate_up_proj"], state[p + "down_proj"]  # [E, 2F, H], [E, H, F]
    width = gate_up.shape[1] // 2
    stacks = {"ffn_gate": gate_up[:, :width], "ffn_up": gate_up[:, width:], "ffn_down": down}
    for name, stack in stacks.items():
        if per_expert:
            for e in range(stack.shape[0]):
                yield f"blk.{layer}.{name}.{e}.weight", np.ascontiguousarray(stack[e])
        else:
            yield f"blk.{layer}.{name}_exps.weight", np.ascontiguousarray(stack)


def spm_tokenizer_metadata(tokenizer_json: Path) -> dict:
    """A SentencePiece-BPE tokenizer.json (stories260K's) as llama.cpp writes it: tokenizer model
    `llama`, scores (here the negated merge rank of each merged token, so merges follow from the
    scores as in a real SentencePiece vocabulary), token types (control, byte, normal)."""
    spec = json.loads(Path(tokenizer_json).read_text())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    ranks = {}
    for rank, merge in enumerate(spec["model"]["merges"]):
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(left + right, rank)
    scores = [-float(ranks.get(t, 0)) if t in ranks else 0.0 for t in tokens]
    special = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    types = [3 if t in special else 6 if t.startswith("<0x") and t.endswith(">") else 1 for t in tokens]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": vocab.get("<s>", 1),
            "tokenizer.ggml.eos_token_id": vocab.get("</s>", 2), "tokenizer.ggml.unknown_token_id": vocab.get("<unk>", 0),
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False}


def bpe_tokenizer_metadata(text: str, vocab_size: int = 400) -> dict:
    """A byte-level BPE trained on `text` with the `tokenizers` library, written as llama.cpp writes
    a Qwen2 tokenizer: model `gpt2`, pre `qwen2`, merges, control tokens, a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    spec = json.loads(tok.to_str())
    tokens = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    template = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                "{% endif %}")
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
            "tokenizer.ggml.padding_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": template}
