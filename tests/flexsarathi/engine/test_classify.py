"""Sequence classification (`LLM(model, task="classify").classify`): *ForSequenceClassification
checkpoints from transformers, their probabilities against transformers' logits through the
activation of each problem type, every placement and schedule against the all-on-device run, and
the misuses refused."""
from __future__ import annotations

import json

import pytest
import torch

from flexsarathi import LLM, ClassificationRequestOutput, FlexSarathiError
from flexsarathi.errors import CheckpointError
from policy_search import Policy
from policy_search.errors import SpecError
from policy_search.hf_config import HFConfig
from tests.conftest import TINY_CONFIGS, poison_last_hidden

PROMPTS = [[3, 17, 42, 9, 77, 5, 23], [11, 12, 13, 14], [8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def build_classifier(kind: str, num_labels: int, problem_type: str | None = None, seed: int = 0):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    cfg = dict(TINY_CONFIGS[kind])
    config = AutoConfig.for_model(cfg.pop("model_type"), num_labels=num_labels, problem_type=problem_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():  # larger-than-init weights, as tests/conftest.py's models
        for name, param in model.named_parameters():
            norm = "norm" in name and name.endswith("weight")
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if norm else 0.1 * torch.randn_like(param))
    return model


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """classifier(kind, num_labels, problem_type) -> (folder, transformers model), saved once."""
    made = {}

    def make(kind: str, num_labels: int, problem_type: str | None = None):
        key = (kind, num_labels, problem_type)
        if key not in made:
            model = build_classifier(kind, num_labels, problem_type)
            folder = tmp_path_factory.mktemp(f"{kind}-cls")
            model.save_pretrained(folder, safe_serialization=True)
            made[key] = (str(folder), model)
        return made[key]

    return make


def reference(model, prompt: list[int], activation) -> torch.Tensor:
    with torch.no_grad():
        return activation(model(torch.tensor([prompt])).logits[0])


CASES = {  # kind, labels, problem type, transformers' activation for them
    "llama_softmax": ("llama_gqa_untied", 3, None, lambda x: torch.softmax(x, -1)),
    "qwen3_softmax": ("qwen3", 2, "single_label_classification", lambda x: torch.softmax(x, -1)),
    "opt_reward": ("opt", 1, None, lambda x: x),  # one label: a reward model's score, as the head gives it
    "opt350m_project_out": ("opt350m", 2, None, lambda x: torch.softmax(x, -1)),  # the head reads project_out's
    "mistral_multi_label": ("mistral", 4, "multi_label_classification", torch.sigmoid),
    "qwen2_regression": ("qwen2", 2, "regression", lambda x: x),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_probs_are_transformers_logits_through_the_problem_types_activation(classifier, case):
    kind, labels, problem, activation = CASES[case]
    folder, model = classifier(kind, labels, problem)
    with LLM(folder, dtype="float32", task="classify") as llm:
        outs = llm.classify(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert isinstance(out, ClassificationRequestOutput) and out.prompt_token_ids == prompt
        torch.testing.assert_close(torch.tensor(out.outputs.probs), reference(model, prompt, activation),
                                   rtol=1e-5, atol=1e-6)


PLACEMENTS = {
    "disk_weights_kv_split": dict(w_gpu=0.3, w_cpu=0.3, w_disk=0.4, kv_gpu=0.5, kv_cpu=0.5),
    "chunked_micro_batches": dict(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=3),
    "block_cpu_attention": dict(scheduler="block", kv_admission="reserve", kv_gpu=0.0, kv_cpu=1.0,
                                cpu_attention=True),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_placement_and_schedule_gives_the_all_on_device_probs(classifier, tmp_path, placement):
    folder, _ = classifier("llama_gqa_untied", 3)
    with LLM(folder, dtype="float32", task="classify") as llm:
        want = [o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)]
    with LLM(folder, dtype="float32", task="classify", policy=Policy(**PLACEMENTS[placement]),
             offload_dir=str(tmp_path)) as llm:
        got = [o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def test_misuses_are_refused_saying_what(classifier, tiny_checkpoint):
    folder, _ = classifier("llama_gqa_untied", 3)
    with pytest.raises(CheckpointError, match='it classifies, with LLM\\(model, task="classify"\\), but cannot '
                                              "generate"):
        LLM(folder, dtype="float32")
    causal = tiny_checkpoint("llama_gqa_untied")[0]
    with pytest.raises(CheckpointError, match="needs a sequence-classification checkpoint"):
        LLM(causal, dtype="float32", task="classify")
    with LLM(folder, dtype="float32", task="classify") as llm:
        with pytest.raises(FlexSarathiError, match='LLM.embed needs an LLM built to embed'):
            llm.embed(PROMPTS)
        with pytest.raises(FlexSarathiError, match='this LLM classifies \\(task="classify"\\): call LLM.classify'):
            llm.generate(PROMPTS)
        too_long = [1] * (llm.engine.config.max_position_embeddings + 1)
        outs = llm.classify([PROMPTS[0], too_long], use_tqdm=False, on_error="record")
        assert outs[0].error is None and outs[1].refused and outs[1].outputs is None
        assert isinstance(outs[1], ClassificationRequestOutput) and "context" in outs[1].error
    with LLM(folder, dtype="float32", task="embed") as llm:  # its hidden states embed too
        assert len(llm.embed(PROMPTS[:1], use_tqdm=False)[0].outputs.embedding) == 32


def test_labels_come_from_id2label_and_a_bad_one_is_refused(classifier):
    folder, _ = classifier("llama_gqa_untied", 3)
    cfg = json.loads(open(f"{folder}/config.json").read())
    assert HFConfig.parse(cfg).classifier.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    named = {**cfg, "id2label": {"0": "negative", "1": "neutral", "2": "positive"}}
    assert HFConfig.parse(named).classifier.labels == ("negative", "neutral", "positive")
    assert HFConfig.parse({k: v for k, v in cfg.items() if k != "id2label"}).classifier.num_labels == 2
    assert HFConfig.parse({**cfg, "architectures": ["LlamaForCausalLM"]}).classifier is None
    for bad, message in (({"0": "a", "2": "b"}, "number its labels 0..1"), ({}, "non-empty object"),
                         ({"x": "a"}, "keys must be label indices")):
        with pytest.raises(SpecError, match=message):
            HFConfig.parse({**cfg, "id2label": bad})
    with pytest.raises(SpecError, match="problem_type 'ranking' is not one of"):
        HFConfig.parse({**cfg, "problem_type": "ranking"})


def test_a_hidden_state_that_is_not_finite_fails_its_request_alone(classifier, monkeypatch):
    """A NaN in one prompt's last hidden state (injected after the pass) reaches the head's output:
    that request fails, said so; the others in its pass keep their probabilities."""
    folder, _ = classifier("llama_gqa_untied", 3)
    with LLM(folder, dtype="float32", task="classify") as llm:
        clean = llm.classify(PROMPTS, use_tqdm=False)
        poison_last_hidden(monkeypatch, PROMPTS[1])
        outs = llm.classify(PROMPTS, use_tqdm=False, on_error="record")
    assert outs[1].outputs is None and not outs[1].refused and "not finite (inf or NaN)" in outs[1].error
    assert [o.outputs.probs for o in (outs[0], outs[2])] == [o.outputs.probs for o in (clean[0], clean[2])]
