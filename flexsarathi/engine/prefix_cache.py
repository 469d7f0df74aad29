"""Automatic prefix caching (vLLM's): KV blocks found by the tokens they hold. No tensors.

A complete block of a sequence is named by a digest of every token up to its end: block k's digest
is sha256(digest of block k-1 || the k-th block_size token ids), so two sequences' k-th blocks
have one digest exactly when their first (k + 1) * block_size tokens agree, and a block's K/V is a
function of those tokens and their positions alone (one model, dtype and KV format per engine).
A cryptographic digest, not Python's hash: a collision would hand one request another's context,
silently.

Once a sequence's block is computed (every token of it stored by a pass that ended), it is
registered under its digest; while any table holds it, a sequence admitted with the same leading
tokens takes it by reference (as forks share their parent's prompt blocks); once free, it stays
findable until the block manager hands it out again (least recently freed first, blocks holding
nothing before any that hold a prefix, a sequence's tail before its head). Nothing is written to
a registered block again: positions before a sequence's num_computed never are.
"""
from __future__ import annotations

import hashlib
import json
from array import array

from flexsarathi.engine.sequence import Sequence

_ROOT = b""  # the digest "before" block 0


def chain_root(cache_salt: str | None, lora_fingerprint: str | None = None) -> bytes:
    """The digest "before" block 0: empty, or for a salted request (vLLM's cache_salt: one tenant's
    requests share cached blocks with each other only) or one run with a LoRA adapter (whose K/V
    differ from the base model's) a digest of both, so no block of another salt or adapter, or of
    none, has its digests."""
    if cache_salt is None and lora_fingerprint is None:
        return _ROOT
    return hashlib.sha256(json.dumps({"cache_salt": cache_salt, "lora": lora_fingerprint}).encode("utf-8")).digest()


def block_digests(seq: Sequence, num_blocks: int, block_size: int) -> list[bytes]:
    """The digests of `seq`'s first `num_blocks` complete blocks (of its prompt, then outputs),
    kept on the sequence and extended as it needs more: its tokens before a digest's end never change."""
    digests = seq.block_digests
    while len(digests) < num_blocks:
        k = len(digests)
        tokens = array("q", seq.token_ids(k * block_size, (k + 1) * block_size)).tobytes()
        before = digests[-1] if digests else chain_root(seq.cache_salt, seq.lora_fingerprint)
        digests.append(hashlib.sha256(before + tokens).digest())
    return digests[:num_blocks]


class PrefixCache:
    """digest -> block of the registered complete blocks, and the way back (for eviction)."""

    def __init__(self) -> None:
        self.block_of: dict[bytes, int] = {}
        self.digest_of: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self.block_of)

    def holds(self, block: int) -> bool:
        return block in self.digest_of

    def chain(self, digests: list[bytes]) -> list[int]:
        """The blocks of the longest run of `digests`, from the first, that are registered."""
        blocks = []
        for digest in digests:
            block = self.block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def register(self, block: int, digest: bytes) -> None:
        """`block` now holds the K/V of `digest`'s tokens. A digest already registered keeps its
        block (this one stays unnamed and is reused first once free)."""
        if digest not in self.block_of and block not in self.digest_of:
            self.block_of[digest] = block
            self.digest_of[block] = digest

    def forget(self, block: int) -> None:
        """`block` is handed out to hold other tokens: it no longer names its digest."""
        digest = self.digest_of.pop(block, None)
        if digest is not None:
            del self.block_of[digest]

    def clear(self) -> None:
        self.block_of.clear()
        self.digest_of.clear()
