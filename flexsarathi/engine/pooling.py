"""Embeddings and classification (vLLM's pooling runner, `LLM(model, task="embed" | "classify")`): a
request is a prompt, prefilled as every prompt is (chunked, offloaded, beside others), and pooled
from the final hidden state of its last token (transformers' last_hidden_state[-1]: the pooling of
decoder embedding models such as Qwen3-Embedding and e5-mistral, and of *ForSequenceClassification
heads). An embedding is that state cut to `dimensions` (Matryoshka) and L2-normalized unless asked
otherwise; a classification its `score` head's logits through transformers' activation for the
checkpoint's problem type (`class_probs`). Nothing is sampled and no KV outlives the prompt."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flexsarathi.errors import FlexSarathiError

TASKS = ("generate", "embed", "classify")
POOLING_TASKS = ("embed", "classify")  # a request is a prompt whose last token's final hidden state is pooled
BATCH_TASKS = ("generate", "embed")  # what batch files, serve and Ray rows take (classify: LLM.classify)


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams. dimensions: the embedding's first this many values (a Matryoshka
    model's shorter embedding); normalize: L2-normalize it (None: the checkpoint's choice, which
    is normalized unless its sentence-transformers modules.json lists no Normalize)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise FlexSarathiError(f"PoolingParams.dimensions must be None or an integer >= 1, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise FlexSarathiError(f"PoolingParams.normalize must be True, False or None, got {self.normalize!r}")

    def check(self, width: int) -> None:
        """FlexSarathiError where the model's embeddings (`width` values) cannot be cut as asked."""
        if self.dimensions is not None and self.dimensions > width:
            raise FlexSarathiError(f"PoolingParams.dimensions {self.dimensions} is more than the model's "
                                   f"{width}-value embeddings")


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label (a regression head, one label: its value as the head gives it)


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled output (vLLM's PoolingRequestOutput). `error` is set instead where the
    request did not finish (on_error="record"): `refused` where it was turned away before any pass."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | None
    error: str | None = None
    refused: bool = False


class EmbeddingRequestOutput(PoolingRequestOutput):
    """One prompt's embedding (vLLM's EmbeddingRequestOutput): `.outputs.embedding`."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """One prompt's classification (vLLM's ClassificationRequestOutput): `.outputs.probs`."""


def pooled(row: torch.Tensor, params: PoolingParams, normalize_default: bool) -> list[float]:
    """The embedding of a prompt whose last token's final hidden state is `row` [hidden] (fp32)."""
    x = row[:params.dimensions] if params.dimensions is not None else row
    normalize = normalize_default if params.normalize is None else params.normalize
    if normalize:
        x = torch.nn.functional.normalize(x, dim=-1)
    return x.tolist()


def class_probs(logits: torch.Tensor, num_labels: int, problem_type: str | None) -> torch.Tensor:
    """[R, labels] logits through the activation transformers' loss implies (vLLM's rule): one
    label, or problem_type regression, as they are; multi_label_classification a sigmoid each;
    else a softmax over the labels."""
    if problem_type == "regression" or (problem_type is None and num_labels == 1):
        return logits
    if problem_type == "multi_label_classification":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
