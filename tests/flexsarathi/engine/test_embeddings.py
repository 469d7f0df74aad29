"""Embeddings (flexsarathi/engine/pooling.py, LLM(task="embed").embed): each prompt's embedding is
transformers' last_hidden_state at its last token, L2-normalized, for every family (OPT's
project_out, LLaMA's GQA, Qwen3's q/k norms, a mixture of experts) and stories260K; every placement
and schedule (chunked prompts, weights on disk, KV on the CPU) gives the all-on-device embeddings;
dimensions cut it before normalizing; a checkpoint's sentence-transformers files choose
normalization or are refused for another pooling; misuse is one error naming it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from flexsarathi import LLM, FlexSarathiError, PoolingParams, SamplingParams
from flexsarathi.errors import CheckpointError
from policy_search import Policy
from tests.conftest import poison_last_hidden

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


def reference(hf, ids: list[int], normalize: bool = True) -> torch.Tensor:
    """transformers' last hidden state at the prompt's last token (the base model's output)."""
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(h, dim=-1) if normalize else h


@pytest.mark.parametrize("kind", ["opt350m", "llama_gqa_untied", "qwen3", "qwen3_moe"])
def test_embeddings_are_transformers_last_hidden_state(tiny_checkpoint, kind):
    folder, hf = tiny_checkpoint(kind)
    with LLM(folder, dtype="float32", task="embed", policy=Policy(gpu_batch_size=3, prefill_budget=64)) as llm:
        outs = llm.embed(PROMPTS, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.error is None and out.prompt_token_ids == ids
        got = torch.tensor(out.outputs.embedding)
        torch.testing.assert_close(got, reference(hf, ids), rtol=1e-5, atol=1e-5)
        assert abs(got.norm().item() - 1) < 1e-5


def test_stories260k_text_prompts(stories_dir, stories_hf):
    texts = ["Once upon a time", "Lily wanted to play with her dog in the park"]
    with LLM(stories_dir, dtype="float32", task="embed") as llm:
        outs = llm.embed(texts, use_tqdm=False)
        assert [o.prompt for o in outs] == texts
        for out in outs:
            assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(stories_hf, out.prompt_token_ids),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", [
    Policy(gpu_batch_size=2, prefill_budget=4),  # every prompt chunked over passes, beside others
    Policy(gpu_batch_size=2, num_gpu_batches=2, w_gpu=0.0, w_cpu=0.5, w_disk=0.5, kv_gpu=0.0, kv_cpu=1.0,
           cpu_attention=True, prefill_budget=5),
    Policy(gpu_batch_size=3, scheduler="block"),
], ids=["chunked", "offloaded", "block"])
def test_every_placement_and_schedule_gives_the_all_on_device_embeddings(tiny_checkpoint, tmp_path, policy):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    with LLM(folder, dtype="float32", task="embed") as llm:
        expected = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    with LLM(folder, dtype="float32", task="embed", policy=policy, offload_dir=str(tmp_path)) as llm:
        got = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def test_dimensions_cut_before_normalizing(tiny_checkpoint):
    folder, hf = tiny_checkpoint("llama_gqa_untied")
    raw = reference(hf, PROMPTS[0], normalize=False)
    with LLM(folder, dtype="float32", task="embed") as llm:
        cut, plain = llm.embed([PROMPTS[0]] * 2, [PoolingParams(dimensions=8), PoolingParams(normalize=False)],
                               use_tqdm=False)
        with pytest.raises(FlexSarathiError, match="dimensions 33 is more than the model's 32-value embeddings"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=33), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), torch.nn.functional.normalize(raw[:8], dim=-1),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(plain.outputs.embedding), raw, rtol=1e-5, atol=1e-5)


def _with_files(folder: str, tmp_path, files: dict) -> str:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    for name, content in files.items():
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_text(json.dumps(content))
    return str(copy)


def test_sentence_transformers_files_choose_normalization_or_are_refused(tiny_checkpoint, tmp_path):
    folder, hf = tiny_checkpoint("llama_gqa_untied")
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    last = {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    unnormalized = _with_files(folder, tmp_path / "a", {"modules.json": [pooling], "1_Pooling/config.json": last})
    with LLM(unnormalized, dtype="float32", task="embed") as llm:
        got = llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    torch.testing.assert_close(torch.tensor(got), reference(hf, PROMPTS[0], normalize=False), rtol=1e-5, atol=1e-5)
    mean = _with_files(folder, tmp_path / "b", {"modules.json": [pooling],
                                                "1_Pooling/config.json": {"pooling_mode_mean_tokens": True}})
    with pytest.raises(CheckpointError, match=r"1_Pooling/config.json asks for mean_tokens: this engine pools the "
                                              r"last token"):
        LLM(mean, dtype="float32", task="embed")


def test_misuse_is_one_error_naming_it(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    with LLM(folder, dtype="float32", task="embed") as llm:
        with pytest.raises(FlexSarathiError, match=r"this LLM embeds \(task=\"embed\"\): call LLM.embed"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(FlexSarathiError, match="must be a PoolingParams or a list of them"):
            llm.embed(PROMPTS[0], {"dimensions": 4}, use_tqdm=False)
        long = llm.embed([PROMPTS[0], list(range(3, 70))], use_tqdm=False, on_error="record")
        assert long[0].error is None and long[1].refused and "more than the model's context of 64" in long[1].error
        assert long[1].outputs is None
    with LLM(folder, dtype="float32") as llm, pytest.raises(FlexSarathiError, match=r"LLM\(model, task=\"embed\"\)"):
        llm.embed(PROMPTS[0], use_tqdm=False)
    with pytest.raises(FlexSarathiError,
                       match="EngineConfig.task must be one of generate, embed, classify, got 'score'"):
        LLM(folder, task="score")
    for bad, message in ((0, "dimensions must be None or an integer >= 1"), ("yes", "normalize must be True")):
        with pytest.raises(FlexSarathiError, match=message):
            PoolingParams(**({"dimensions": bad} if message.startswith("dimensions") else {"normalize": bad}))


def test_a_base_model_saved_without_its_head_embeds_and_refuses_to_generate(tiny_checkpoint, tmp_path):
    """Embedding checkpoints are base models (transformers' LlamaModel: no "model." prefix, no
    lm_head.weight) with an untied config: they load for task "embed", equal to the whole model's
    embeddings, and are refused for generation, saying why."""
    folder, hf = tiny_checkpoint("llama_gqa_untied")
    base = tmp_path / "base"
    hf.model.save_pretrained(base, safe_serialization=True)
    from safetensors import safe_open
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "embed_tokens.weight" in names  # as such checkpoints are saved
    with LLM(str(base), dtype="float32", task="embed") as llm:
        got = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    for ids, embedding in zip(PROMPTS, got):
        torch.testing.assert_close(torch.tensor(embedding), reference(hf, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(CheckpointError, match="holds no lm_head.weight .* embeds, with LLM\\(model, task=\"embed\"\\), "
                                              "but cannot generate"):
        LLM(str(base), dtype="float32")


def test_a_hidden_state_that_is_not_finite_fails_its_request_alone(tiny_checkpoint, monkeypatch):
    """A NaN in one prompt's last hidden state (injected after the pass) fails that request, said so;
    the others in its pass keep their embeddings."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    with LLM(folder, dtype="float32", task="embed") as llm:
        clean = llm.embed(PROMPTS, use_tqdm=False)
        poison_last_hidden(monkeypatch, PROMPTS[1])
        outs = llm.embed(PROMPTS, use_tqdm=False, on_error="record")
        with pytest.raises(FlexSarathiError, match=r"^prompt 1: the model's hidden state for this prompt is not finite"):
            llm.embed(PROMPTS, use_tqdm=False)
    assert outs[1].outputs is None and not outs[1].refused and "not finite (inf or NaN)" in outs[1].error
    assert [o.outputs.embedding for o in (outs[0], outs[2])] == [o.outputs.embedding for o in (clean[0], clean[2])]


def test_a_searched_policy_embeds_as_the_default_one(tiny_checkpoint, tmp_path):
    """policy="auto" for an embedding engine searches for prompts alone (512 -> 1 by default) and
    gives the embeddings of the all-on-device run."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    with LLM(folder, dtype="float32", task="embed") as llm:
        expected = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    with LLM(folder, dtype="float32", task="embed", policy="auto", hardware="t4", offload_dir=str(tmp_path)) as llm:
        got = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_an_embedding_engine_holds_no_head(tiny_checkpoint):
    """The head is never multiplied when embedding: an untied one is not held (the engine's
    "embeddings and head" are the token embeddings and final norm alone), the embeddings unchanged."""
    folder, hf = tiny_checkpoint("llama_gqa_untied")
    with LLM(folder, dtype="float32", task="embed") as llm:
        held = llm.engine.memory.report()["gpu"]["by_what"]["embeddings and head"]
        got = llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    with LLM(folder, dtype="float32") as llm:
        with_head = llm.engine.memory.report()["gpu"]["by_what"]["embeddings and head"]
    kept = sum(p.numel() * 4 for name, p in hf.named_parameters() if name in ("model.embed_tokens.weight",
                                                                                 "model.norm.weight"))
    assert held == kept and with_head == kept + hf.lm_head.weight.numel() * 4
    torch.testing.assert_close(torch.tensor(got), reference(hf, PROMPTS[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_embeddings_on_cuda_equal_the_cpu_ones(tiny_checkpoint):
    """The same prompts embedded on the GPU (the step's rows in one transfer) and on the CPU, fp32,
    chunked and beside each other: equal to float32 rounding."""
    folder, _ = tiny_checkpoint("qwen3")
    got = {}
    for device in ("cpu", "cuda"):
        with LLM(folder, dtype="float32", device=device, task="embed",
                 policy=Policy(gpu_batch_size=2, prefill_budget=5)) as llm:
            got[device] = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)])
    torch.testing.assert_close(got["cuda"], got["cpu"], rtol=1e-4, atol=1e-5)


def test_embed_names_its_own_misused_arguments(tiny_checkpoint):
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    with LLM(folder, dtype="float32", task="embed") as llm:
        with pytest.raises(FlexSarathiError, match=r"^embed\(prompts=...\) must be a string"):
            llm.embed(3.5, use_tqdm=False)
        with pytest.raises(FlexSarathiError, match=r'^embed\(on_error=...\) must be "raise" or "record"'):
            llm.embed(PROMPTS, use_tqdm=False, on_error="skip")
