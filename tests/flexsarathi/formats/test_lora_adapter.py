"""LoRA adapters merged at load, against PEFT's own adapted model (the library that trains and saves
them, run unmerged): logits per family, every placement's tokens equal to the all-on-device ones, the
offload store never reused across adapters, and every adapter this merge would get wrong refused."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexsarathi import LLM, SamplingParams
from flexsarathi.errors import CheckpointError
from flexsarathi.formats.opened_model import open_model
from policy_search import Policy
from tests.prompt_logits import prompt_logits

peft = pytest.importorskip("peft")

TARGETS = {
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "llama_gqa_untied": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    "qwen3": ["q_proj", "v_proj", "down_proj"],
    "gemma3": ["k_proj", "o_proj", "up_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj"],  # its checkpoint's own fused modules
}
PROMPTS = [[3, 17, 42, 9, 77, 5, 23], [11, 12, 13, 14]]


def save_adapter(base_folder: str, folder, targets: list[str], seed: int = 1, r: int = 4, **config) -> torch.nn.Module:
    """A PEFT adapter of random, non-trivial weights saved to `folder`; returns PEFT's adapted model."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, torch_dtype=torch.float32, attn_implementation="eager")
    return adapt(base, folder, targets, seed, r, **config)


def adapt(base: torch.nn.Module, folder, targets: list[str], seed: int = 1, r: int = 4, **config) -> torch.nn.Module:
    """`base` (a transformers model, wrapped in place) with a PEFT adapter of random, non-trivial
    weights, saved to `folder`; returns PEFT's adapted model."""
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **config)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # PEFT's random init is small: make the update show in the logits
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return model.eval()


def peft_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_the_merged_model_gives_pefts_logits(tiny_checkpoint, tmp_path, kind):
    folder, base = tiny_checkpoint(kind)
    adapted = save_adapter(folder, tmp_path / "adapter", TARGETS[kind])
    with LLM(folder, dtype="float32", lora=str(tmp_path / "adapter")) as llm:
        ours = prompt_logits(llm, PROMPTS)
    for prompt, got in zip(PROMPTS, ours):
        want = peft_logits(adapted, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():  # the adapter changes the model: this comparison could fail
            assert (want - base(torch.tensor([prompt])).logits[0]).abs().max() > 0.1


def test_rslora_scales_by_the_root_of_the_rank(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    adapted = save_adapter(folder, tmp_path / "adapter", ["q_proj", "down_proj"], use_rslora=True)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["use_rslora"] is True
    with LLM(folder, dtype="float32", lora=str(tmp_path / "adapter")) as llm:
        got = prompt_logits(llm, PROMPTS[:1])[0]
        held = sum(p.numel() * 4 for n, p in adapted.named_parameters() if "lora_" in n)  # fp32 as saved
        assert llm.engine.memory.report()["cpu"]["by_what"]["LoRA adapter"] == held
    torch.testing.assert_close(got, peft_logits(adapted, PROMPTS[0]), rtol=1e-4, atol=1e-4)
    assert math.isclose(open_model(folder, lora=str(tmp_path / "adapter")).source.adapter.scale, 8 / 2)


PLACEMENTS = {
    "cpu_weights": dict(w_gpu=0.0, w_cpu=1.0),
    "disk_weights": dict(w_gpu=0.3, w_cpu=0.0, w_disk=0.7),
    "disk_4bit": dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5, compress_weight=True),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_placement_with_an_adapter_gives_the_all_on_device_tokens(tiny_checkpoint, tmp_path, placement):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "adapter", TARGETS["llama_gqa_untied"])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    compress = PLACEMENTS[placement].get("compress_weight", False)
    with LLM(folder, dtype="float32", lora=str(tmp_path / "adapter"), policy=Policy(compress_weight=compress)) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(folder, dtype="float32", lora=str(tmp_path / "adapter"), policy=Policy(**PLACEMENTS[placement]),
             offload_dir=str(tmp_path / "offload")) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference


def test_an_offload_store_is_never_read_for_another_adapter(tiny_checkpoint, tmp_path):
    """One offload folder, runs with adapter A, adapter B, none, and A again: each gives its own
    all-on-device tokens (the store is keyed by the adapter's fingerprint too)."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    adapters = {"a": tmp_path / "a", "b": tmp_path / "b", None: None}
    save_adapter(folder, adapters["a"], TARGETS["llama_gqa_untied"], seed=1)
    save_adapter(folder, adapters["b"], TARGETS["llama_gqa_untied"], seed=2)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    on_disk = Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0)
    tokens = {}
    for name in ("a", "b", None, "a"):
        lora = None if adapters[name] is None else str(adapters[name])
        with LLM(folder, dtype="float32", lora=lora) as llm:
            reference = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        with LLM(folder, dtype="float32", lora=lora, policy=on_disk, offload_dir=str(tmp_path / "offload")) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
        tokens[name] = reference
    assert len({json.dumps(t) for t in tokens.values()}) == 3  # three different models


# ---- adapters this merge would get wrong, refused ------------------------------------------------
def edit_config(folder, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder, edit) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def truncate(path) -> None:
    """A download cut short: the file's second half gone."""
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def first_a(tensors: dict) -> str:
    return next(k for k in sorted(tensors) if ".lora_A." in k)


BAD = {
    "no_config": (lambda f: (f / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no_weights": (lambda f: (f / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    "truncated": (lambda f: truncate(f / "adapter_model.safetensors"), "cannot read LoRA weights"),
    "bad_json": (lambda f: (f / "adapter_config.json").write_text("{r: 4"), "cannot read .*adapter_config.json"),
    "dora": (lambda f: edit_config(f, use_dora=True), "use_dora = True is not supported"),
    "fan_in_fan_out": (lambda f: edit_config(f, fan_in_fan_out=True), "fan_in_fan_out = True is not supported"),
    "trained_bias": (lambda f: edit_config(f, bias="all"), "bias = 'all' is not supported"),
    "modules_to_save": (lambda f: edit_config(f, modules_to_save=["lm_head"]), "modules_to_save"),
    "rank_pattern": (lambda f: edit_config(f, rank_pattern={"q_proj": 8}), "rank_pattern"),
    "prompt_tuning": (lambda f: edit_config(f, peft_type="PROMPT_TUNING"), "is not a LoRA adapter"),
    "zero_rank": (lambda f: edit_config(f, r=0), "r must be a positive number"),
    "rank_mismatch": (lambda f: edit_config(f, r=8), "but adapter_config.json says r = 8"),
    "nan": (lambda f: edit_weights(f, lambda t: t[first_a(t)].__setitem__((0, 0), float("nan"))),
            "must be a finite 2-D float matrix"),
    "half_pair": (lambda f: edit_weights(f, lambda t: t.pop(first_a(t))), "but not its other half"),
    "stray_tensor": (lambda f: edit_weights(f, lambda t: t.__setitem__("base_model.model.lm_head.weight",
                                                                      torch.zeros(2, 2))), "is not a lora_A"),
    "not_in_model": (lambda f: edit_weights(f, lambda t: t.update(
        {k.replace("layers.0.", "layers.7."): v.clone() for k, v in t.items() if "layers.0." in k})), "does not have"),
    "wrong_shape": (lambda f: edit_weights(f, lambda t: t.update(
        {k: torch.zeros(4, 5) for k in t if ".lora_A." in k and "q_proj" in k})), "an adapter of another model"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_an_adapter_the_merge_would_get_wrong_is_refused_saying_what(tiny_checkpoint, tmp_path, case):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "adapter", ["q_proj", "o_proj"])
    damage, message = BAD[case]
    damage(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(folder, dtype="float32", lora=str(tmp_path / "adapter"))


def test_an_adapter_needs_full_precision_weights(tiny_checkpoint, tmp_path):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "adapter", ["q_proj"])
    with pytest.raises(CheckpointError, match="a dummy model's quantized or drawn ones"):
        LLM("dummy:opt-125m", lora=str(tmp_path / "adapter"))
    with pytest.raises(CheckpointError, match="is not a folder"):
        LLM(folder, lora=str(tmp_path / "adapter" / "adapter_config.json"))


def test_generate_with_lora_equals_the_api_and_a_resume_with_another_adapter_is_refused(tiny_checkpoint, tmp_path,
                                                                                        capsys):
    from flexsarathi.cli.main import main

    folder, _ = tiny_checkpoint("opt")
    save_adapter(folder, tmp_path / "a", TARGETS["opt"], seed=1)
    save_adapter(folder, tmp_path / "b", TARGETS["opt"], seed=2)
    job = tmp_path / "in.jsonl"
    job.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    args = ["generate", "--model", folder, "--input", str(job), "--output", str(out), "--temperature", "0",
            "--max-tokens", "6", "--dtype", "float32", "--quiet"]
    assert main([*args, "--lora", str(tmp_path / "a")]) == 0
    with LLM(folder, dtype="float32", lora=str(tmp_path / "a")) as llm:
        want = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0),
                                                  use_tqdm=False)]
    got = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert got == want
    capsys.readouterr()
    assert main([*args, "--lora", str(tmp_path / "b")]) == 2
    assert "was written with another configuration (weights: " in capsys.readouterr().err


def test_a_saved_base_weight_that_is_not_the_checkpoints_is_refused(tiny_checkpoint, tmp_path):
    """PEFT saves an adapted head's base weight beside the pair (save_embedding_layers): it must be the
    checkpoint's own, or the adapter was trained on another (a resized vocabulary)."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "adapter", ["q_proj", "lm_head"])
    name = "base_model.model.lm_head.base_layer.weight"
    assert name in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with LLM(folder, dtype="float32", lora=str(tmp_path / "adapter")):
        pass  # as saved: accepted
    edit_weights(tmp_path / "adapter", lambda t: t[name].add_(1.0))
    with pytest.raises(CheckpointError, match="saved lm_head's base weight, and it is not this checkpoint's"):
        LLM(folder, dtype="float32", lora=str(tmp_path / "adapter"))
