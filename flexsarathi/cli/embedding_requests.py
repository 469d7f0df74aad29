"""OpenAI Batch lines for `/v1/embeddings` (`flexsarathi generate`, `flexsarathi serve`): a body's
`input` (a string, a list of strings, a list of token ids, or a list of those: OpenAI's forms, at
most 2048 per line) becomes one prompt per input for an engine of task "embed", and the line's
record gathers their embeddings back in order, as OpenAI's embeddings API returns them
(`encoding_format` "float" or "base64": the float32 values' little-endian bytes)."""
from __future__ import annotations

import base64
import functools
import struct
from dataclasses import dataclass

from flexsarathi.errors import FlexSarathiError

EMBEDDINGS_URL = "/v1/embeddings"
EMBEDDING_BODY_FIELDS = frozenset(("input", "model", "encoding_format", "dimensions", "user"))
MAX_INPUTS = 2048  # OpenAI's limit of inputs per embeddings request
ENCODINGS = ("float", "base64")


@dataclass
class EmbeddingAsk:
    """What a /v1/embeddings line asks: its inputs (texts or token-id lists), the embeddings'
    dimensions (None: the model's) and how the record writes them."""

    inputs: list
    dimensions: int | None = None
    encoding_format: str = "float"
    normalize: bool | None = None  # a JSONL record's (OpenAI's bodies have no such field)

    def fingerprint_basis(self) -> list:
        return ["embed", self.inputs, self.dimensions, self.encoding_format, self.normalize]


def read_embedding_body(body: dict, where: str = "body.") -> EmbeddingAsk:
    """The body's (or a JSONL record's, where="") ask; FlexSarathiError naming the field that is wrong."""
    inputs = _inputs(body.get("input"), where)
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise FlexSarathiError(f"{where}encoding_format must be \"float\" or \"base64\", got {encoding!r}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1):
        raise FlexSarathiError(f"{where}dimensions must be an integer >= 1, got {dimensions!r}")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise FlexSarathiError(f"{where}normalize must be true or false, got {normalize!r}")
    return EmbeddingAsk(inputs, dimensions, encoding, normalize)


def _inputs(value, where: str) -> list:
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_token(t) for t in value):
        value = [value]  # one input of token ids
    if not isinstance(value, list) or not value:
        raise FlexSarathiError(f"{where}input must be a non-empty string, a list of strings, a list of token ids "
                               f"or a list of those, got {type(value).__name__}")
    if len(value) > MAX_INPUTS:
        raise FlexSarathiError(f"{where}input holds {len(value)} inputs; a request takes at most {MAX_INPUTS}")
    for k, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise FlexSarathiError(f"{where}input[{k}] is empty")
        elif not (isinstance(item, list) and item and all(_is_token(t) for t in item)):
            raise FlexSarathiError(f"{where}input[{k}] must be a non-empty string or list of token ids, "
                                   f"got {item!r:.60}")
    return value


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def embedding_body(outputs: list, model: str, encoding_format: str) -> dict:
    """OpenAI's embeddings response body for a line's finished outputs (EmbeddingRequestOutput, in
    input order)."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    data = [{"object": "embedding", "index": k, "embedding": _encoded(o.outputs.embedding, encoding_format)}
            for k, o in enumerate(outputs)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(values: list[float], encoding_format: str):
    if encoding_format == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


class GenerationLines:
    """EmbeddingLines' counterpart for text requests: one prompt per line, its output its record's."""

    def __init__(self, requests: list):
        self.requests = requests

    def prompts(self) -> list:
        """Each request's token ids, as vLLM's TokensPrompt dict where it carries a cache_salt."""
        return [req.prompt_token_ids if req.cache_salt is None
                else {"prompt_token_ids": req.prompt_token_ids, "cache_salt": req.cache_salt} for req in self.requests]

    def params(self, sampling: dict) -> list:
        return [sampling[req.key] for req in self.requests]

    def lora_requests(self, modules: dict[str, str]) -> list | None:
        """Each request's LoRARequest (None: the base model); None where no request names one."""
        return _lora_requests([req.lora for req in self.requests], modules)

    def add(self, index: int, output):
        return self.requests[index], output


class EmbeddingLines:
    """A job's embedding lines as the engine runs them, one prompt per input, and each line's
    outputs gathered back: `add` returns (line, its outputs in input order) once its last input
    is done."""

    def __init__(self, requests: list):
        self.flat = [(req, k) for req in requests for k in range(len(req.input_token_ids))]
        self._got: dict[str, dict[int, object]] = {req.key: {} for req in requests}

    def prompts(self) -> list[list[int]]:
        return [req.input_token_ids[k] for req, k in self.flat]

    def params(self, pooling: dict) -> list:
        """The PoolingParams of each prompt (`pooling`: request key -> its line's)."""
        return [pooling[req.key] for req, _ in self.flat]

    def lora_requests(self, modules: dict[str, str]) -> list | None:
        """Each input's LoRARequest (its line's; None: the base model); None where no line names one."""
        return _lora_requests([req.lora for req, _ in self.flat], modules)

    def add(self, index: int, output):
        req, k = self.flat[index]
        got = self._got[req.key]
        got[k] = output
        if len(got) < len(req.input_token_ids):
            return None
        return req, [got[i] for i in range(len(got))]


def _lora_requests(names: list[str | None], modules: dict[str, str]) -> list | None:
    """The LoRARequest of each --lora-modules name in `names` (None: the base model); None where all are None."""
    if not any(names):
        return None
    from flexsarathi.engine.lora_requests import module_requests  # noqa: PLC0415 - the CLI's cold start

    named = module_requests(modules)
    return [named[name] if name else None for name in names]


def job_lines(task: str, requests: list):
    """A job's runnable requests as its engine runs them: EmbeddingLines for an "embed" job."""
    return (EmbeddingLines if task == "embed" else GenerationLines)(requests)


def run_lines(llm, lines, params: dict, record, use_tqdm: bool, stop=None, lora_modules: dict | None = None):
    """`lines` run on `llm` (embed_iter for EmbeddingLines, else generate_iter), each request's
    record written once its outputs are all in: yields what `record` returned (1: an error record).
    lora_modules: {name: folder} of the adapters that text requests name (their `lora`)."""
    run = llm.embed_iter if isinstance(lines, EmbeddingLines) else llm.generate_iter
    adapters = lines.lora_requests(lora_modules or {})
    if adapters:
        run = functools.partial(run, lora_request=adapters)
    for index, output in run(lines.prompts(), lines.params(params), use_tqdm=use_tqdm, on_error="record", stop=stop):
        done = lines.add(index, output)
        if done is not None:
            yield record(*done)
