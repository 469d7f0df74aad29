"""flexsarathi/batch_turns.py: one batch at a time on an LLM's engine, and no turn left taken by a
generate that ended without giving it back (a Ctrl-C can land anywhere in its Python code)."""
from __future__ import annotations

import threading

import pytest

from flexsarathi import LLM, FlexSarathiError, SamplingParams
from flexsarathi.batch_turns import BatchTurns
from policy_search import Policy
from tests.conftest import raise_keyboard_interrupt


def test_a_turn_never_given_back_is_free_once_its_generate_has_ended(tiny_checkpoint, monkeypatch):
    """A Ctrl-C that lands as a generate ends, before its turn is given back
    (tests/offload/ctrl_c_at_lines.py drew such a line: every later generate was refused as
    "still being iterated"): the next generate runs, from this thread and from another."""
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    prompts, params = [[3, 4, 5], [6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    fresh = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with monkeypatch.context() as patched:
        patched.setattr(BatchTurns, "_give_back", lambda self, ticket: raise_keyboard_interrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == fresh
    with monkeypatch.context() as patched:
        patched.setattr(BatchTurns, "_give_back", lambda self, ticket: raise_keyboard_interrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts, params, use_tqdm=False)
    got = []
    other = threading.Thread(target=lambda: got.append([o.token_ids for o in llm.generate(prompts, params,
                                                                                          use_tqdm=False)]))
    other.start()
    other.join(timeout=120)
    assert got == [fresh]


def test_a_turn_held_by_a_live_generate_iter_is_refused_to_its_own_thread():
    turns = BatchTurns()
    with turns.turn():
        assert turns.held_here()
        with pytest.raises(FlexSarathiError, match="still being iterated"):
            with turns.turn():
                pass
    assert not turns.held_here()
    with turns.turn():  # given back: taken again
        assert turns.held_here()
