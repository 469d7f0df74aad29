"""Structured outputs with xgrammar (the grammar engine vLLM and SGLang ship): a request's
StructuredOutputsParams compiled once per distinct grammar per engine (cached), one matcher per
sequence, each step a token bitmask per constrained row applied to the logits on the compute
device, and the matcher advanced with the sampled token. EOS is in the mask only where the
grammar is complete. The scheduler and executor know nothing of it: it is part of sampling."""
from __future__ import annotations

import importlib.util
import json
import re

import torch

from flexsarathi.engine.sampling_params import StructuredOutputsParams
from flexsarathi.errors import FlexSarathiError
from offload.streams import device_guard

# Whitespace characters in a row that JSON output may hold where its grammar allows whitespace:
# enough for pretty-printed JSON a few levels deep, and a bound on a model that would otherwise
# spend its whole max_tokens on blanks inside an object (a small model at temperature 0 does).
MAX_WHITESPACE_RUN = 16
INSTALL_HINT = "structured outputs need xgrammar: pip install 'flexsarathi[structured]' (or pip install xgrammar)"


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise FlexSarathiError(INSTALL_HINT) from None
    return xgrammar


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and vocabulary (the model's: its LM head
    may be wider than the tokenizer); each distinct grammar once (`compiled` counts them)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._compiler = None
        self._cache: dict[tuple, object] = {}
        self.compiled = 0

    def _xgr_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers

            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; FlexSarathiError saying why when it cannot compile."""
        key = params.key
        if key not in self._cache:
            if self.tokenizer is None:
                raise FlexSarathiError("structured_outputs needs the model's tokenizer (a folder with "
                                       "tokenizer.json, or a GGUF file)")
            if not self.stop_token_ids:
                raise FlexSarathiError("structured_outputs needs an EOS token to end the output, and this "
                                       "model names none (config.json / generation_config.json eos_token_id)")
            compiler = self._xgr_compiler()
            try:
                self._cache[key] = _compile(compiler, *key)
            except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse and schema errors
                raise FlexSarathiError(f"structured_outputs.{key[0]} cannot be compiled: {_first_line(exc)}") from None
            self.compiled += 1
        return self._cache[key]


def _compile(compiler, kind: str, text: str, compact: bool):
    if kind == "json":
        json.loads(text)  # a schema that is not JSON: the json module's message is the clearer one
        return compiler.compile_json_schema(text, any_whitespace=not compact,
                                            max_whitespace_cnt=None if compact else MAX_WHITESPACE_RUN)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":  # one GBNF alternative per literal (json.dumps escapes as GBNF reads it)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                 for c in json.loads(text)))
    return compiler.compile_grammar(text)


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix (`[hh:mm:ss] file.cc:line: `)."""
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(exc).strip()) or type(exc).__name__
    return text.splitlines()[0] if len(text) < 400 else text[:400] + "..."


class GrammarState:
    """One sequence's matcher, made on first use and fed the outputs the sequence already has,
    so a sequence that keeps a prefix (a recompute after preemption, a resumed request) matches
    from where its text is, not from the start."""

    def __init__(self, compiled):
        self.compiled = compiled
        self._matcher = None

    def matcher(self, kept_outputs: list[int]):
        if self._matcher is None:
            self._matcher = _xgrammar().GrammarMatcher(self.compiled)
            for token in kept_outputs:
                self._accept(token)
        return self._matcher

    def advance(self, token: int, kept_outputs: list[int]) -> None:
        """The matcher (made and fed `kept_outputs` if new) takes `token`."""
        self.matcher(kept_outputs)
        self._accept(token)

    @property
    def complete(self) -> bool:
        """The matcher took the grammar's end (EOS): no token may follow."""
        return self._matcher is not None and self._matcher.is_terminated()

    def _accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise RuntimeError(f"token {token} is outside the grammar the mask allowed: a sampler bug")


def apply_grammar_masks(logits: torch.Tensor, seqs: list, bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, vocab] with -inf where row i's grammar forbids the token (rows whose sequence
    has no grammar untouched); a new tensor: the model's logits stay as they are (raw logprobs).
    bitmask: these rows' fill_grammar_bitmask, made earlier (the engine fills it while a GPU still
    runs the pass); None: filled here."""
    if bitmask is None:
        bitmask = fill_grammar_bitmask(seqs, logits.shape[1], pinned=logits.device.type == "cuda")
    if bitmask is None:
        return logits
    logits = logits.clone()
    apply_grammar_bitmask(logits, bitmask)
    return logits


def fill_grammar_bitmask(seqs: list, vocab: int, pinned: bool = False) -> torch.Tensor | None:
    """The step's token bitmask [R, ceil(vocab / 32)] int32 on the host, row i from seqs[i]'s
    matcher (bit set: allowed), all bits set in rows without a grammar; None when no row has one.
    pinned: page-locked, so that its one copy to a GPU is asynchronous (torch's pinned-block cache
    keeps the block from reuse until that copy is done, so a buffer per step costs no allocation)."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return None
    bitmask = torch.full((len(seqs), (vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=pinned)
    for i in rows:
        seqs[i].grammar.matcher(seqs[i].output_token_ids).fill_next_token_bitmask(bitmask, i)
    return bitmask


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """-inf, in place, where `bitmask` [R, ceil(vocab / 32)] (host) clears a token of logits
    [R, vocab] (any device): one copy of the bitmask to the logits' device, then xgrammar's kernel
    there (its C++ loop on a CPU, its Triton kernel on CUDA) over every row: a row with all bits
    set is unchanged, so mixed batches need no row indices (which would be a second copy)."""
    xgr = _xgrammar()
    on_device = bitmask.to(logits.device, non_blocking=bitmask.is_pinned())
    backend = "auto" if logits.device.type != "cuda" or importlib.util.find_spec("triton") else "torch_native"
    with device_guard(logits.device):  # a Triton launch goes to the current device: the logits'
        xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=logits.shape[1], backend=backend)


def advance_matchers(seqs: list, tokens: list[int]) -> None:
    """Each constrained sequence's matcher takes its sampled token (before it is appended)."""
    for seq, token in zip(seqs, tokens):
        if seq.grammar is not None:
            seq.grammar.advance(token, seq.output_token_ids)
