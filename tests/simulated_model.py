"""A simulated model for scheduler tests: the token sampled after position p of sequence i is a
fixed function of (i, p), as greedy decoding of a real model is a function of the tokens so far.
So every uninterrupted run gives each sequence the same tokens, and a preempted or forked one must too."""
from __future__ import annotations

from flexsarathi.engine.sequence import Sequence


def sampled_token(seq_id: int, position: int) -> int:
    return 10 + (seq_id * 31 + position * 7) % 50


def expected_tokens(seq: Sequence) -> list[int]:
    """What running the sequence alone gives: tokens until a stop token or max_len."""
    out = []
    while seq.num_prompt_tokens + len(out) < seq.max_len:
        out.append(sampled_token(seq.seq_id, seq.num_prompt_tokens + len(out)))
        if out[-1] in seq.stop_ids:
            break
    return out
