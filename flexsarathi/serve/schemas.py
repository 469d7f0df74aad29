"""The server's request and response bodies, in the shapes of OpenAI's API reference (what the
official `openai` client sends and parses)."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # what a batch's requests may call
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
# A batch in one of these has reached its end: the runner never picks it again.
FINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
# A UTF-16 surrogate in a str: what a JSON \ud800-\udfff escape that is not half of a pair becomes
# (json.loads keeps it); UTF-8 cannot encode it, so no record or answer could be written with it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None  # files are kept until deleted
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0  # succeeded
    failed: int = 0  # error records


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None  # a batch here runs until it ends: it never expires
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None


class BatchCreate(BaseModel):
    """POST /v1/batches. Unknown fields are refused, not ignored (a typo is not silently dropped)."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]  # the one window OpenAI accepts
    metadata: dict[str, str] | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: object) -> object:
        """Every field is stored or echoed: a lone surrogate in one (a string, or a key or value of
        metadata) is refused before anything is saved. (It was a 500 with the batch saved anyway, and
        every later listing of batches a 500.)"""
        if isinstance(value, dict):
            for key, text in value.items():
                _refuse_lone_surrogate(key, f"key {_shown(key)}")
                _refuse_lone_surrogate(text, f"the value of key {_shown(key)}")
        else:
            _refuse_lone_surrogate(value, "the value")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY or len(text) > MAX_METADATA_VALUE:
                raise ValueError(f"key {key[:20]!r}...: keys are at most {MAX_METADATA_KEY} characters, "
                                 f"values at most {MAX_METADATA_VALUE}")
        return value


def _refuse_lone_surrogate(text: object, what: str) -> None:
    found = LONE_SURROGATE.search(text) if isinstance(text, str) else None
    if found:
        raise ValueError(f"{what} holds a lone surrogate ({ascii(found[0])} at character {found.start()}): "
                         "text must be valid Unicode (in JSON, a \\ud800-\\udfff escape only as half of a pair)")


def _shown(text: object) -> str:
    """A client's string in an error message: quoted, escaped (a lone surrogate as \\udc00), at most 40
    characters of it."""
    shown = repr(text[:40] if isinstance(text, str) else text)
    return shown + "..." if isinstance(text, str) and len(text) > 40 else shown


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flexsarathi"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
