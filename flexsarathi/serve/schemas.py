"""The server's request and response bodies, in the shapes of OpenAI's API reference (what the
official `openai` client sends and parses)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")  # what a batch's requests may call
BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]
# A batch in one of these has reached its end: the runner never picks it again.
FINAL_STATUSES = ("failed", "completed", "expired", "cancelled")
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


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
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]  # the one window OpenAI accepts
    metadata: dict[str, str] | None = None

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
