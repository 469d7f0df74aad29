"""The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built as a `tokenizers` Tokenizer.

Two kinds, as llama.cpp names them in `tokenizer.ggml.model`:
- `llama`: SentencePiece BPE. The vocabulary with a score per token; the merges are the file's, or
  (usually) recovered from the scores: every split of a token into two tokens is a merge, ranked by
  the merged token's score (SentencePiece merges the highest-scoring pair first). `▁` marks spaces
  (prefixed to the text unless `add_space_prefix` is false) and unknown bytes fall back to `<0xNN>`.
- `gpt2`: byte-level BPE with the file's merges, split first by the pre-tokenizer regex that
  `tokenizer.ggml.pre` names (qwen2, llama-bpe, ...; GPT-2's own by default).
Tokens typed CONTROL (3) are special tokens and USER_DEFINED (4) added tokens, both matched whole.
BOS/EOS and whether to add them, and the chat template, come from the metadata too.
"""
from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from flexsarathi.errors import CheckpointError

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's llama-vocab.cpp)
# (glm4 / chatglm-bpe: llama.cpp's CHATGLM4 split, llama 3's with the contractions' case folded by hand)
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                        "deepseek-r1-qwen": _QWEN2_SPLIT, "glm4": _LLAMA3_SPLIT, "chatglm-bpe": _LLAMA3_SPLIT}
NO_BOS_PRE = ("glm4", "chatglm-bpe")  # llama.cpp adds no BOS for these, whatever add_bos_token says
# names under which llama.cpp splits by GPT-2's own regex (the ByteLevel pre-tokenizer's); a file without
# the key gets it too, as in llama.cpp
GPT2_SPLIT_NAMES = ("default", "gpt-2", "gpt2")
SUPPORTED_MODELS = ("llama", "gpt2")


def load_gguf_tokenizer(path: str):
    """The tokenizer of a GGUF file (None when it carries no vocabulary)."""
    from flexsarathi.formats.gguf_file import open_gguf
    from flexsarathi.formats.tokenizer import check_vocab_fits

    gguf = open_gguf(path)
    tokenizer = build_gguf_tokenizer(gguf.metadata, path)
    if tokenizer is not None and "token_embd.weight" in gguf.tensors:
        check_vocab_fits(tokenizer, gguf.tensor("token_embd.weight").shape[0], f"{path}: tokenizer.ggml.tokens",
                         "token_embd.weight rows")
    return tokenizer


def build_gguf_tokenizer(meta: dict, where: str):
    """A flexsarathi Tokenizer from GGUF metadata; None when the file carries no vocabulary."""
    from flexsarathi.formats.tokenizer import Tokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind in (None, "none"):  # llama.cpp's "none": a model without a vocabulary
        return None
    if not meta.get("tokenizer.ggml.tokens"):
        raise CheckpointError(f"{where}: tokenizer.ggml.model is {kind!r} but tokenizer.ggml.tokens is missing or "
                              f"empty (a GGUF vocabulary needs at least one token)")
    if kind not in SUPPORTED_MODELS:
        raise CheckpointError(f"{where}: tokenizer.ggml.model {kind!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_MODELS)}")
    tokens = _checked_vocabulary(meta, where)
    build = _spm_backend if kind == "llama" else _byte_level_backend
    backend = build(meta, tokens, where)
    _add_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])

    def token(key: str):
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    specials = {name: token(key) for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                   ("unk_token", "unknown_token_id"),
                                                   ("pad_token", "padding_token_id")) if token(key) is not None}
    add_bos = _flag(meta, "tokenizer.ggml.add_bos_token", kind == "llama", where)  # llama.cpp's defaults
    add_bos = add_bos and meta.get("tokenizer.ggml.pre") not in NO_BOS_PRE
    return Tokenizer(backend, add_bos, _flag(meta, "tokenizer.ggml.add_eos_token", False, where),
                     meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id"),
                     meta.get("tokenizer.chat_template") or None, specials)


_TOKEN_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "cls", "mask")


def _checked_vocabulary(meta: dict, where: str) -> list[str]:
    """tokenizer.ggml.tokens (distinct strings), its per-token arrays and token ids, checked; CheckpointError
    naming the key otherwise."""
    key = "tokenizer.ggml.tokens"
    tokens = meta[key]
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise CheckpointError(f"{where}: {key} is empty (a GGUF vocabulary needs at least one token)")
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not isinstance(t, str):
            raise CheckpointError(f"{where}: {key}[{i}] must be a string, got {t!r}")
        if seen.setdefault(t, i) != i:
            raise CheckpointError(f"{where}: {key} has {t!r} twice (ids {seen[t]} and {i})")
    for name, kind in (("token_type", int), ("scores", (int, float))):
        values = meta.get(f"tokenizer.ggml.{name}")
        if values is None:
            continue
        if not isinstance(values, (list, tuple)) or len(values) != len(tokens) or not all(
                isinstance(v, kind) and not isinstance(v, bool) for v in values):
            raise CheckpointError(f"{where}: tokenizer.ggml.{name} must list one {kind_name(kind)} per token "
                                  f"({len(tokens)})")
    for name in _TOKEN_ID_KEYS:
        index = meta.get(f"tokenizer.ggml.{name}_token_id")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)
                                  or not 0 <= index < len(tokens)):
            raise CheckpointError(f"{where}: tokenizer.ggml.{name}_token_id must be a token id in "
                                  f"[0, {len(tokens)}), got {index!r}")
    return list(tokens)


def _flag(meta: dict, key: str, default: bool, where: str) -> bool:
    """Metadata `key` as a bool (absent: `default`); one CheckpointError naming it where it is not one
    (bool("false") would be True)."""
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_)):
        raise CheckpointError(f"{where}: metadata {key} is {value!r} ({type(value).__name__}), not true or false")
    return bool(value)


def kind_name(kind) -> str:
    return "integer" if kind is int else "number"


def _check_merges(meta: dict, vocab: dict, where: str) -> None:
    """Each of tokenizer.ggml.merges is "left right" with left, right and left+right in the vocabulary."""
    for i, merge in enumerate(meta.get("tokenizer.ggml.merges") or []):
        parts = merge.split(" ", 1) if isinstance(merge, str) else []
        if len(parts) != 2:
            raise CheckpointError(f"{where}: tokenizer.ggml.merges[{i}] must be two tokens separated by a space, "
                                  f"got {merge!r}")
        unknown = [t for t in (*parts, "".join(parts)) if t not in vocab]
        if unknown:
            raise CheckpointError(f"{where}: tokenizer.ggml.merges[{i}] {merge!r} names {unknown[0]!r}, "
                                  f"which is not in tokenizer.ggml.tokens")


def _spm_backend(meta: dict, tokens: list[str], where: str) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    merges = _file_merges(meta, vocab, where) or spm_merges(tokens, scores)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                     unk_token=tokens[unk] if unk is not None else None))
    prefix = _flag(meta, "tokenizer.ggml.add_space_prefix", True, where)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a scored vocabulary: every split of a token into two
    vocabulary tokens, best merged score first; ties by the pieces' lengths (longer first), then
    by the pieces' ids."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merged, score in zip(tokens, scores):
        pairs = [(merged[:k], merged[k:]) for k in range(1, len(merged))
                 if merged[:k] in vocab and merged[k:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((score, left, right) for left, right in pairs)
    # a stable sort: equal keys keep the vocabulary order above
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def _byte_level_backend(meta: dict, tokens: list[str], where: str) -> HFTokenizer:
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    # Tokens the file writes as plain text (some added tokens) get the byte-level spelling the
    # merges and the pre-tokenizer produce.
    vocab = {t if set(t) <= alphabet else "".join(p for p, _ in spell.pre_tokenize_str(t)): i
             for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=_file_merges(meta, vocab, where) or [], fuse_unk=False,
                                     continuing_subword_prefix="", end_of_word_suffix=""))
    pre = meta.get("tokenizer.ggml.pre")
    if pre is not None and pre not in PRE_TOKENIZER_SPLITS and pre not in GPT2_SPLIT_NAMES:
        # another split regex would encode every prompt into other tokens than the model learned
        raise CheckpointError(f"{where}: tokenizer.ggml.pre {pre!r} (the split its merges were learned with) is not "
                              f"known here; known: {', '.join([*PRE_TOKENIZER_SPLITS, *GPT2_SPLIT_NAMES])}")
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _file_merges(meta: dict, vocab: dict, where: str) -> list[tuple[str, str]]:
    _check_merges(meta, vocab, where)
    return [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]


def _add_special_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens as special tokens (skipped when decoding), USER_DEFINED ones as added tokens."""
    byte_level = isinstance(backend.pre_tokenizer, (pre_tokenizers.ByteLevel, pre_tokenizers.Sequence))
    alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
            if kind == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)
