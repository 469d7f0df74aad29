"""The generation API: bad input gets one clear error; sampling is reproducible."""
from __future__ import annotations

import signal
import sys
import threading
import time

import pytest
import torch

from flexsarathi import LLM, FlexSarathiError, SamplingParams
from flexsarathi.models import attention
from policy_search import Policy
from tests.conftest import on_call, raise_keyboard_interrupt


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    # float32: bf16 CPU matmuls round by batch composition, and a request alone vs in a batch of
    # six (test_seeded_sampling_is_independent_of_batch_composition) is the comparison made here.
    return LLM(tiny_checkpoint("llama_gqa_untied")[0], dtype="float32",
               policy=Policy(gpu_batch_size=4, prefill_budget=8))


@pytest.mark.parametrize("field,value,message", [
    ("max_tokens", 0, r"max_tokens must be None \(until the context ends\) or an integer >= 1"),
    ("temperature", -0.5, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature"),
    ("top_k", -2, r"top_k must be -1 or 0 \(off\) or an integer >= 1"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, "top_p"),
    ("seed", "7", "seed must be None or an integer"),
    ("stop_token_ids", (-1,), "stop_token_ids"),
])
def test_invalid_sampling_values(field, value, message):
    with pytest.raises(FlexSarathiError, match=f"SamplingParams.{message}"):
        SamplingParams(**{field: value})


def test_bad_prompts(llm):
    with pytest.raises(FlexSarathiError, match="prompt 1 is empty"):
        llm.generate([[1, 2], []], use_tqdm=False)
    with pytest.raises(FlexSarathiError, match=r"prompt 0: token id 128 is outside the vocabulary \[0, 128\)"):
        llm.generate([[1, 128]], use_tqdm=False)
    with pytest.raises(FlexSarathiError, match="prompt 0 has 65 tokens, more than the model's context of 64"):
        llm.generate([[1] * 65], use_tqdm=False)
    with pytest.raises(FlexSarathiError, match="no tokenizer.json"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(FlexSarathiError, match="2 prompts but 1 SamplingParams"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)


def test_generation_stops_at_the_context(llm):
    out = llm.generate([[1] * 60], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    full = llm.generate([[1] * 64], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0]
    assert full.token_ids == [] and full.finish_reason == "length"


def test_stop_tokens_end_generation(llm):
    ids = [5, 6, 7, 8]
    free = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    stop = free.token_ids[2]
    first = free.token_ids.index(stop)
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                             stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_is_independent_of_batch_composition(llm):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = llm.generate([[3, 4, 5]], params, use_tqdm=False)[0]
    others = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in range(5)]
    batch = llm.generate([[9, 9], [3, 4, 5], [7] * 11, [1, 2], [4] * 5, [6]],
                         [others[0], params] + others[1:], use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids
    unseeded = llm.generate([[3, 4, 5]] * 2, SamplingParams(max_tokens=10, temperature=1.0), use_tqdm=False)
    assert unseeded[0].token_ids != unseeded[1].token_ids  # each request has its own stream


def test_degenerate_sampling_equals_greedy(llm):
    ids = [[3, 4, 5, 6]]
    greedy = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    for params in (SamplingParams(max_tokens=8, temperature=0.7, top_k=1, ignore_eos=True, seed=0),
                   SamplingParams(max_tokens=8, temperature=0.7, top_p=1e-6, ignore_eos=True, seed=0)):
        assert llm.generate(ids, params, use_tqdm=False)[0].token_ids == greedy[0].token_ids


def test_sampling_follows_the_distribution():
    from flexsarathi.engine.sampling import sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    gen = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=1.0)
    draws = torch.tensor([sample(logits, [p], [gen])[0] for _ in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    # 4000 draws: the standard error of each frequency is <= 0.008; 4 sigma.
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.032, rtol=0)
    top_p = SamplingParams(temperature=1.0, top_p=0.75)  # keeps {0.5, 0.3}: the smallest set >= 0.75
    draws = {sample(logits, [top_p], [gen])[0] for _ in range(500)}
    assert draws == {0, 1}


def test_close_releases_the_engine_and_refuses_new_work(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama_gqa_untied")[0]
    policy = Policy(gpu_batch_size=2, w_gpu=0.0, w_disk=1.0, kv_gpu=0.0, kv_cpu=1.0)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with LLM(path, policy=policy, offload_dir=str(tmp_path)) as llm:
        first = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids
        engine = llm.engine
        assert engine.memory.report()["cpu"]["by_what"]["KV cache"] > 0
    assert not engine.memory.report()["cpu"]["by_what"].get("KV cache")
    assert engine.closed and engine.weights.store._closed and not engine.kv_pools
    assert not attention._HOST_WORKSPACE.buffers  # the reused attention buffers are freed too
    with pytest.raises(FlexSarathiError, match="engine is closed"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)
    llm.close()  # idempotent
    # the store it wrote is complete and reused by the next engine, with the same tokens
    with LLM(path, policy=policy, offload_dir=str(tmp_path)) as again:
        assert again.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids == first


# ---- the engine's one scheduler across calls ---------------------------------------------------
@pytest.mark.parametrize("at_call", [1, 7, 20])
def test_an_interrupted_generate_leaks_no_kv_block_and_the_next_equals_a_fresh_engine(tiny_checkpoint, at_call):
    """The engine keeps its scheduler across calls: an interrupt mid-generate (n=2 forks sharing
    prompt blocks included) drops that call's sequences and frees every block and row."""
    folder = tiny_checkpoint("llama_gqa_untied")[0]
    policy = Policy(gpu_batch_size=3, prefill_budget=6, kv_gpu=0.5, kv_cpu=0.5)
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10] * 11, [5, 2]]
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=11, n=2, ignore_eos=True)
    fresh = [o.outputs for o in LLM(folder, policy=policy).generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, policy=policy)
    engine = llm.engine
    with on_call(engine.model, "post_attention", at_call, raise_keyboard_interrupt), \
            pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=False)
    assert not engine.has_unfinished() and engine.blocks.idle
    assert engine.blocks.num_free == engine.blocks.num_blocks > 0
    again = [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [[c.token_ids for c in o] for o in again] == [[c.token_ids for c in o] for o in fresh]
    assert engine.blocks.idle


def test_a_ctrl_c_as_a_step_ends_first_hands_over_that_steps_finished_requests(tiny_checkpoint, python_sigint):
    """A real SIGINT during the sampling of the step in which request 0 finishes (after the pass's
    last layer): generate_iter yields request 0, as an uninterrupted run gives it, and only then
    raises (raised as the step ended, its finished request was lost: a batch job redid it). The
    engine is left as a fresh one."""
    folder = tiny_checkpoint("opt")[0]
    policy = Policy(gpu_batch_size=2, prefill_budget=4)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (2, 9, 9)]
    llm = LLM(folder, policy=policy)
    with on_call(llm.engine, "step", 10 ** 9, lambda: None) as steps:
        fresh = {i: (o.outputs[0].token_ids, len(steps)) for i, o in llm.generate_iter(prompts, params, use_tqdm=False)}
    first_done = min(step for _, step in fresh.values())  # the step in which a request first finishes
    got = {}
    with on_call(llm.engine, "sample", first_done, lambda: signal.raise_signal(signal.SIGINT)), \
            pytest.raises(KeyboardInterrupt):
        for i, output in llm.generate_iter(prompts, params, use_tqdm=False):
            got[i] = output.outputs[0].token_ids
    assert got and got == {i: ids for i, (ids, step) in fresh.items() if step == first_done}
    assert not llm.engine.has_unfinished() and llm.engine.blocks.idle and not llm.engine.interrupt_held
    # a caller that stops iterating at that yield gets the Ctrl-C from close(), none is left for later
    with on_call(llm.engine, "sample", first_done, lambda: signal.raise_signal(signal.SIGINT)):
        outputs = llm.generate_iter(prompts, params, use_tqdm=False)
        next(outputs)
        with pytest.raises(KeyboardInterrupt):
            outputs.close()
    assert not llm.engine.interrupt_held and not llm.engine.has_unfinished()
    assert {i: o.outputs[0].token_ids for i, o in llm.generate_iter(prompts, params, use_tqdm=False)} == \
        {i: ids for i, (ids, _) in fresh.items()}


def test_a_generate_left_unfinished_by_its_caller_is_dropped(tiny_checkpoint):
    folder = tiny_checkpoint("opt")[0]
    policy = Policy(gpu_batch_size=2, prefill_budget=4)
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (2, 9, 9)]
    fresh = [o.token_ids for o in LLM(folder, policy=policy).generate(prompts, params, use_tqdm=False)]
    llm = LLM(folder, policy=policy)
    outputs = llm.generate_iter(prompts, params, use_tqdm=False)
    next(outputs)  # the first request done; the others still running or waiting
    assert llm.engine.has_unfinished()
    outputs.close()
    assert not llm.engine.has_unfinished() and llm.engine.blocks.idle
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == fresh


def test_generate_from_two_threads_takes_turns(tiny_checkpoint):
    """A second thread's generate while the first's runs (a server's workers sharing one LLM) waits
    for it, and each gets the tokens it gets alone (it used to be refused, and a race between the
    two calls' admissions could drop the running batch)."""
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    first, second = [[3, 4, 5], [6, 7, 8, 9, 10]], [[11, 12], [13, 14, 15]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone = [[o.token_ids for o in llm.generate(p, params, use_tqdm=False)] for p in (first, second)]
    got = {}
    waiter = threading.Thread(target=lambda: got.update(second=llm.generate(second, params, use_tqdm=False)))

    def start_the_other_thread():  # on the first call's second pass: the other waits for its turn
        waiter.start()
        deadline = time.monotonic() + 120  # a guard against a hang, not a budget
        while _top_function(waiter) != "turn":  # BatchTurns.turn: waiting
            assert time.monotonic() < deadline, "the second generate did not wait for the first"
            time.sleep(0.001)

    with on_call(llm.engine, "step", 2, start_the_other_thread):
        got["first"] = llm.generate(first, params, use_tqdm=False)
    waiter.join()
    assert [[o.token_ids for o in got[k]] for k in ("first", "second")] == alone


def _top_function(thread: threading.Thread) -> str | None:
    """The function `thread` runs now (innermost frame of ours: a sleep is C code)."""
    frame = sys._current_frames().get(thread.ident)
    return frame.f_code.co_name if frame is not None else None


def test_a_generate_inside_this_threads_unfinished_generate_iter_is_refused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    prompts, params = [[3, 4, 5], [6, 7, 8, 9, 10], [11, 12]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    outputs = llm.generate_iter(prompts, params, use_tqdm=False)
    done = [next(outputs)]
    with pytest.raises(FlexSarathiError, match="previous generate_iter in this thread is still being iterated"):
        llm.generate([[1, 2]], params, use_tqdm=False)
    done += list(outputs)  # the batch went on untouched
    assert [o.token_ids for _, o in sorted(done, key=lambda d: d[0])] == alone
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == alone


def test_close_from_another_thread_ends_the_running_generate_at_a_pass_boundary(tiny_checkpoint):
    """close() while another thread generates: that pass ends, the generate raises saying so, then
    the engine closes (it used to free the pools under the running pass: KeyError 'gpu' or "cannot
    schedule new futures after shutdown")."""
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    closer = threading.Thread(target=llm.close)

    def close_from_the_other_thread():  # on the second pass: close() waits for the pass to end
        closer.start()
        deadline = time.monotonic() + 120  # a guard against a hang, not a budget
        while _top_function(closer) != "turn":  # close() waiting for the turn
            assert time.monotonic() < deadline, "close() did not wait for the running pass"
            time.sleep(0.001)

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with on_call(llm.engine, "step", 2, close_from_the_other_thread) as steps, \
            pytest.raises(FlexSarathiError, match="closed while generate ran: 2 of its 2 prompts did not finish"):
        llm.generate([[3, 4, 5], [6, 7, 8, 9, 10]], params, use_tqdm=False)
    closer.join()
    assert len(steps) == 2 and llm.engine.closed
    with pytest.raises(FlexSarathiError, match=r"closed \(LLM.close\(\) was called\)"):
        llm.generate([[3, 4]], params, use_tqdm=False)


def test_close_inside_this_threads_generate_iter_ends_it(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 20)]
    outputs = llm.generate_iter([[3, 4, 5], [6, 7, 8, 9, 10]], params, use_tqdm=False)
    index, _ = next(outputs)
    llm.close()  # does not wait for this thread's own batch
    with pytest.raises(FlexSarathiError, match="closed while generate ran: 1 of its 2 prompts"):
        next(outputs)
    assert index == 0 and llm.engine.closed


def test_close_from_another_thread_does_not_wait_for_a_suspended_generate_iter(tiny_checkpoint):
    """A generate_iter its caller holds without resuming (an abandoned iterator something still
    references) held its turn, and close() from another thread waited for it forever. Now the engine
    closes at once; resumed, the iterator waits for that close() to end (it never runs beside it),
    then raises saying what did not finish; a later generate is refused, not left waiting."""
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 20)]
    outputs = llm.generate_iter([[3, 4, 5], [6, 7, 8, 9, 10]], params, use_tqdm=False)
    index, _ = next(outputs)  # suspended at a yield, holding the turn
    entered, release, got = threading.Event(), threading.Event(), {}
    engine_close = llm.engine.close

    def slow_close():  # close() holds the turn until the test releases it
        entered.set()
        release.wait(timeout=120)
        engine_close()

    llm.engine.close = slow_close
    closer = threading.Thread(target=llm.close, daemon=True)  # daemon: a hang fails, never blocks exit
    closer.start()
    assert entered.wait(timeout=60), "close() waited for the suspended generate_iter"

    def resume():
        try:
            next(outputs)
        except FlexSarathiError as exc:
            got["error"] = str(exc)

    resumer = threading.Thread(target=resume, daemon=True)
    resumer.start()
    deadline = time.monotonic() + 120  # a guard against a hang, not a budget
    while _top_function(resumer) != "_resume":  # BatchTurns._resume: waiting for the close to end
        assert resumer.is_alive() and time.monotonic() < deadline, f"resumed beside close(): {got}"
        time.sleep(0.001)
    release.set()
    closer.join(timeout=60)
    resumer.join(timeout=60)
    assert index == 0 and llm.engine.closed and not closer.is_alive()
    assert "closed while generate ran: 1 of its 2 prompts did not finish" in got["error"]
    with pytest.raises(FlexSarathiError, match=r"closed \(LLM.close\(\) was called\)"):
        llm.generate([[3, 4]], params[0], use_tqdm=False)


def test_a_suspended_generate_iter_closed_after_its_engine_is_ended_quietly(tiny_checkpoint):
    """The caller of a taken-over generate_iter closes it instead of resuming it: no error, nothing
    left queued."""
    llm = LLM(tiny_checkpoint("opt")[0], dtype="float32", policy=Policy(gpu_batch_size=2, prefill_budget=4))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 20)]
    outputs = llm.generate_iter([[3, 4, 5], [6, 7, 8, 9, 10]], params, use_tqdm=False)
    next(outputs)
    closer = threading.Thread(target=llm.close, daemon=True)  # daemon: a hang fails, never blocks exit
    closer.start()
    closer.join(timeout=60)
    assert not closer.is_alive() and llm.engine.closed
    outputs.close()
    assert not llm.engine.has_unfinished()


def test_a_batch_runs_alone_and_the_schedule_changes_only_between_batches(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("opt")[0], policy=Policy(gpu_batch_size=2, prefill_budget=4))
    engine = llm.engine
    seqs = [engine.make_sequence([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True)) for _ in range(2)]
    engine.add_requests([[seq] for seq in seqs])
    engine.step()
    with pytest.raises(FlexSarathiError, match="one batch of requests at a time"):
        engine.add_requests([[engine.make_sequence([1, 2], SamplingParams())]])
    with pytest.raises(FlexSarathiError, match="set_schedule while requests run"):
        engine.set_schedule(scheduler="block")
    while engine.has_unfinished():
        engine.step()
    assert all(len(s.output_token_ids) == 4 for s in seqs) and engine.blocks.idle
    engine.set_schedule(scheduler="block")
    assert engine.scheduler.config.mode == "block"
