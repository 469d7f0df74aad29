"""`Workload`: prompt and output lengths (fixed, or a distribution of (prompt, output) pairs) and
how many requests. `num_requests=None` means an unbounded stream: the estimate is the steady state.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cached_property

from policy_search.errors import SpecError


def _positive_int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{where} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Workload:
    prompt_len: int | None = None
    gen_len: int | None = None  # generated tokens per request, the first one included
    pairs: tuple[tuple[int, int], ...] | None = None  # (prompt_len, gen_len) samples, equally likely
    num_requests: int | None = None
    # The requests' max_tokens where outputs end early at EOS / stop tokens (gen lengths are then
    # where they stop): what lifetime reservation holds per request. None: outputs run to their
    # gen_len (ignore_eos, lengths known), so a reservation holds exactly what is used.
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        fixed = self.prompt_len is not None or self.gen_len is not None
        if fixed and self.pairs is not None:
            raise SpecError("Workload takes prompt_len and gen_len, or pairs, not both")
        if fixed:
            _positive_int(self.prompt_len, "Workload.prompt_len")
            _positive_int(self.gen_len, "Workload.gen_len")
        elif self.pairs is None:
            raise SpecError("Workload needs prompt_len and gen_len, or pairs of them")
        else:
            try:
                pairs = tuple((int(s), int(n)) for s, n in self.pairs)
            except (TypeError, ValueError):
                raise SpecError("Workload.pairs must be (prompt_len, gen_len) pairs of integers") from None
            if not pairs:
                raise SpecError("Workload.pairs is empty")
            for i, (s, n) in enumerate(pairs):
                if s < 1 or n < 1:
                    raise SpecError(f"Workload.pairs[{i}] = ({s}, {n}): lengths must be positive")
            object.__setattr__(self, "pairs", pairs)
        if self.num_requests is not None:
            _positive_int(self.num_requests, "Workload.num_requests")
        if self.max_tokens is not None:
            _positive_int(self.max_tokens, "Workload.max_tokens")
            if self.max_tokens < max(n for _, n in self.lengths):
                raise SpecError(f"Workload.max_tokens={self.max_tokens} is below the longest output "
                                f"({max(n for _, n in self.lengths)})")

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_pairs(cls, pairs, num_requests: int | None = None) -> "Workload":
        return cls(pairs=tuple(pairs), num_requests=num_requests)

    @classmethod
    def from_file(cls, path: str | os.PathLike, num_requests: int | None = None) -> "Workload":
        """A JSON list of [prompt_len, gen_len] (or of {"prompt_len", "gen_len"} objects), JSON lines
        of such objects, or text lines of two integers ("512 32" or "512,32"; a header is skipped)."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise SpecError(f"workload file {path}: {exc.strerror}") from None
        return cls(pairs=_parse_pairs(text, str(path)), num_requests=num_requests)

    # ---- distribution statistics -------------------------------------------------------------
    @cached_property
    def lengths(self) -> tuple[tuple[int, int], ...]:
        return self.pairs if self.pairs is not None else ((self.prompt_len, self.gen_len),)

    @property
    def is_fixed(self) -> bool:
        return len(set(self.lengths)) == 1

    def _mean(self, fn) -> float:
        return sum(fn(s, n) for s, n in self.lengths) / len(self.lengths)

    @property
    def mean_prompt_len(self) -> float:
        return self._mean(lambda s, n: s)

    @property
    def mean_gen_len(self) -> float:
        return self._mean(lambda s, n: n)

    @property
    def max_prompt_len(self) -> int:
        return max(s for s, _ in self.lengths)

    @property
    def max_gen_len(self) -> int:
        return max(n for _, n in self.lengths)

    @property
    def max_total_len(self) -> int:
        return max(s + n for s, n in self.lengths)

    @property
    def reserved_gen_len(self) -> int:
        """Output tokens a lifetime reservation holds per request."""
        return self.max_tokens if self.max_tokens is not None else self.max_gen_len

    @property
    def mean_decode_steps(self) -> float:
        """Decode passes a request takes after its prefill produced the first token."""
        return self._mean(lambda s, n: n - 1)

    @property
    def mean_decode_context(self) -> float:
        """Mean KV tokens a decode token attends to (itself included), weighted by decode steps.

        Step i (1..n-1) of a request with prompt s attends to s + i tokens."""
        steps = self.mean_decode_steps
        if steps == 0:
            return float(self.mean_prompt_len)
        return self._mean(lambda s, n: (n - 1) * s + (n - 1) * n / 2) / steps

    @property
    def mean_prompt_causal_pairs(self) -> float:
        """Mean (query, key) pairs per prompt token under causal attention: E[s(s+1)/2] / E[s]."""
        return self._mean(lambda s, n: s * (s + 1) / 2) / self.mean_prompt_len

    def expected_block_max(self, block: int) -> tuple[float, float]:
        """Expected longest prompt and longest output among `block` requests drawn at random: what a
        block schedule pads every member to."""
        def expected_max(values: list[int]) -> float:
            values = sorted(values)
            count = len(values)
            total, below = 0.0, 0
            for v in sorted(set(values)):
                at_or_below = below + values.count(v)
                total += v * ((at_or_below / count) ** block - (below / count) ** block)
                below = at_or_below
            return total
        return (expected_max([s for s, _ in self.lengths]), expected_max([n for _, n in self.lengths]))

    def describe(self) -> str:
        count = "steady stream" if self.num_requests is None else f"{self.num_requests} requests"
        if self.is_fixed:
            s, n = self.lengths[0]
            return f"prompt {s}, output {n}, {count}"
        return (f"{len(self.lengths)} length samples: prompt mean {self.mean_prompt_len:.0f} "
                f"(max {self.max_prompt_len}), output mean {self.mean_gen_len:.0f} "
                f"(max {self.max_gen_len}), {count}")

    def to_dict(self) -> dict:
        if self.pairs is None:
            return {"prompt_len": self.prompt_len, "gen_len": self.gen_len,
                    "num_requests": self.num_requests}
        return {"pairs": [list(p) for p in self.pairs], "num_requests": self.num_requests}


def _parse_pairs(text: str, source: str) -> list[tuple[int, int]]:
    stripped = text.strip()
    if not stripped:
        raise SpecError(f"workload file {source} is empty")

    def from_item(item, where: str) -> tuple[int, int]:
        if isinstance(item, dict):
            if "prompt_len" not in item or "gen_len" not in item:
                raise SpecError(f"{where}: needs 'prompt_len' and 'gen_len', got keys {sorted(item)}")
            return item["prompt_len"], item["gen_len"]
        if isinstance(item, (list, tuple)) and len(item) == 2:
            return item[0], item[1]
        raise SpecError(f"{where}: expected [prompt_len, gen_len] or an object, got {item!r}")

    if stripped[0] in "[{":
        try:
            data = json.loads(stripped)
            items = data["pairs"] if isinstance(data, dict) and "pairs" in data else data
            if isinstance(items, dict):
                items = [items]
            return [from_item(x, f"workload file {source} item {i}") for i, x in enumerate(items)]
        except json.JSONDecodeError:
            pass  # maybe JSON lines
        out = []
        for i, line in enumerate(stripped.splitlines()):
            if line.strip():
                try:
                    out.append(from_item(json.loads(line), f"workload file {source} line {i + 1}"))
                except json.JSONDecodeError as exc:
                    raise SpecError(f"workload file {source} line {i + 1}: invalid JSON ({exc})") from None
        return out
    out = []
    for i, line in enumerate(stripped.splitlines()):
        parts = line.replace(",", " ").split()
        if not parts or line.lstrip().startswith("#"):
            continue
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            if i == 0:
                continue  # a header such as "prompt_len,gen_len"
            raise SpecError(f"workload file {source} line {i + 1}: expected two integers, got {line!r}")
        out.append((int(parts[0]), int(parts[1])))
    return out
