"""One working-set formula (policy_search/working_set.py) for the planner and the engine: the
planner's gpu working set of a pass equals the engine's reservation for the same pass, and the
K/V context the executor really gathers onto the compute device stays within what is charged."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsarathi.engine.llm_engine import EngineConfig, LLMEngine
from flexsarathi.engine.planner_spec import planner_model_spec
from flexsarathi.engine.sampling import SamplingParams
from offload import executor as executor_module
from offload.executor import PassExecutor
from offload.kv_cache import gathered_plain_decodes
from policy_search.cost_model import working_bytes
from policy_search.linear import FRACTIONS, evaluate
from policy_search.pass_shape import PassShape, RunShape
from policy_search.policy import Policy
from policy_search.working_set import SCORE_BYTES

KIND = "llama_gqa_untied"
KV_CPU = dict(kv_gpu=0.0, kv_cpu=1.0, kv_disk=0.0)


def _generate(engine, prompts, max_tokens):
    engine.add_requests([[engine.make_sequence(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))] for p in prompts])
    while engine.has_unfinished():
        engine.step()


def _pass_reservations(engine, monkeypatch) -> list[int]:
    """Bytes of every per-pass reservation, observed (the tracker still makes them)."""
    seen, original = [], engine.memory.reservation

    def reservation(tier, nbytes, what):
        if what == "pass activations":
            seen.append(nbytes)
        return original(tier, nbytes, what)

    monkeypatch.setattr(engine.memory, "reservation", reservation)
    return seen


def _shape(kind, decode, prompt, context, rows_per_seq, sampled, k):
    return PassShape(kind=kind, count=1, decode_tokens=decode, prompt_tokens=prompt, context=context,
                     max_context=context, prior_kv_tokens=0.0, prompt_pairs=0.0, sampled=sampled,
                     prompt_rows_per_sequence=rows_per_seq, micro_batches=k)


@pytest.mark.parametrize("placement", [{}, dict(compress_kv=True), dict(cpu_attention=True, **KV_CPU),
                                       dict(act_gpu=0.0, act_cpu=1.0, **KV_CPU)])
def test_planner_working_set_equals_the_engines_reservation(tiny_checkpoint, tmp_path, monkeypatch, placement):
    """Block schedule, 4 prompts of 6 tokens in 2 micro-batches: the prefill pass and the first
    decode pass (every context 7 tokens) reserve exactly what the planner charges for those shapes
    (a 4-bit pool's prompt keys, held as gathered ones while its K is quantized by block, included),
    but for the prompts' attention: the engine attends whole prompts of a plain pool in one causal
    call and charges it nothing (PassExecutor.one_causal_call); the planner, which does not know
    the device's kernels, keeps one 6-key prompt call's fp32 K/V copies and scores."""
    folder, _ = tiny_checkpoint(KIND)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, scheduler="block", **placement)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    try:
        reserved = _pass_reservations(engine, monkeypatch)
        _generate(engine, [[1 + i] * 6 for i in range(4)], max_tokens=3)
    finally:
        engine.close()
    spec = planner_model_spec(folder)
    fractions = {name: getattr(policy, name) for name in FRACTIONS}
    run = RunShape(passes=(), generated_tokens=12, requests=4, kv_tokens=4 * 16, running=4, steady_state=False)
    prefill = _shape("prefill", 0.0, 24.0, 6.0, 6.0, 4.0, 2)
    decode = _shape("decode", 4.0, 0.0, 7.0, 0.0, 4.0, 2)
    planned = [evaluate(working_bytes(s, run, policy, spec), fractions) for s in (prefill, decode)]
    prompt_call = (6 * 2 * spec.kv_dim + 6 * 6 * 2 * spec.num_heads) * SCORE_BYTES  # K/V copies, scores, probs
    assert reserved[:2] == pytest.approx([planned[0] - prompt_call, planned[1]], rel=0, abs=0.5)
    if policy.compress_kv:  # its prompts' new keys held as gathered: charged alike (the pass above)
        return
    # decode context attended where it lives is not charged as a gather: on the CPU under
    # cpu_attention, else read in its pool by the CPU kernel (plain pools in memory, on the CPU)
    assert spec.in_pool_tiers(False) == ("gpu", "cpu")
    assert reserved[1] < planned_uncharged(spec, policy, run, decode)


def _record_charges(monkeypatch, engine, gathered: list) -> list:
    """engine._pass_tokens observed: per pass, (how many gathers `gathered` held when it was charged,
    its micro-batches' token ids, the charged tokens), appended to the list returned."""
    charged, pass_tokens = [], engine._pass_tokens

    def observed_tokens(batches):
        tokens = pass_tokens(batches)
        charged.append((len(gathered), [id(mb.token_ids) for mb in batches], tokens))
        return tokens

    monkeypatch.setattr(engine, "_pass_tokens", observed_tokens)
    return charged


def planned_uncharged(spec, policy, run, shape):
    """What the same decode pass would charge were its context gathered onto the compute device."""
    on_device, gathered = policy.replace(cpu_attention=False), dataclasses.replace(spec, decode_in_pool=((), ()))
    return evaluate(working_bytes(shape, run, on_device, gathered), {n: getattr(policy, n) for n in FRACTIONS})


@pytest.mark.parametrize("compress_kv", [False, True])
@pytest.mark.parametrize("placement", [dict(kv_gpu=0.5, kv_cpu=0.5, kv_disk=0.0),
                                       dict(kv_gpu=0.5, kv_cpu=0.5, kv_disk=0.0, cpu_attention=True),
                                       dict(cpu_attention=True, **KV_CPU)])
def test_charged_context_bounds_what_the_executor_gathers(tiny_checkpoint, tmp_path, monkeypatch,
                                                          placement, compress_kv):
    """Decode-maximal, 3 micro-batches, prompts cut into chunks, KV split across tiers: in every
    pass and layer, the K/V the executor gathers onto the compute device for two consecutive
    micro-batches (k computes while k+1 loads) is at most the engine's charged context, and exactly
    it for uncompressed pools (the charge counts the gathered slots themselves). Decodes gather
    plain pools here (gathered_plain_decodes): attended in place they gather nothing, under the
    same charge."""
    folder, _ = tiny_checkpoint(KIND)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=3, prefill_budget=8, compress_kv=compress_kv,
                    kv_admission="reserve", **placement)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    # per micro-batch and layer: bytes of the contexts kept on the compute device (gathered ahead by
    # the I/O step, or after the new K/V are written where the micro-batch writes first)
    gathered: list[list[int]] = []
    gather, charged = PassExecutor._contexts, _record_charges(monkeypatch, engine, gathered)

    def observed_contexts(self, layer, mb):
        contexts = gather(self, layer, mb)
        nbytes = sum(t.nbytes for group, group_contexts in zip(mb.groups, contexts)
                     for part, context in zip(group.parts, group_contexts)
                     # None: the part's keys are the pass's new rows; IN_POOL: attended in the pool
                     if context is not None and context is not executor_module.IN_POOL
                     # the executor's own choice: executor.CPU is returned only for CPU attention
                     if self.attention_device(part.tier, group) is not executor_module.CPU
                     for t in context)
        gathered.append((layer, id(mb.token_ids), nbytes))  # moved to the compute device (the CPU): the same tensor
        return contexts

    monkeypatch.setattr(PassExecutor, "_contexts", observed_contexts)
    try:
        with gathered_plain_decodes():
            _generate(engine, [[1 + i] * n for i, n in enumerate((5, 9, 3, 12, 7, 10))], max_tokens=5)
        kv_dim, item = engine.config.num_kv_heads * engine.config.head_dim, engine.dtype.itemsize
    finally:
        engine.close()
    assert len(charged) > 3 and len(gathered) > 0
    ends = [start for start, _, _ in charged[1:]] + [len(gathered)]
    exact = seen_any = 0
    for (start, k, tokens), end in zip(charged, ends):
        loads = gathered[start:end]
        by_layer: dict[int, list[int]] = {}
        for layer, mb, nbytes in sorted(loads, key=lambda load: (load[0], k.index(load[1]))):  # micro-batch order
            by_layer.setdefault(layer, []).append(nbytes)
        held = max(a + b for per_mb in by_layer.values() for a, b in zip(per_mb, per_mb[1:] + [0]))
        charge = 2 * tokens.context_slots * kv_dim * item  # K and V (the formula adds a K when compressed)
        assert held <= charge
        exact += held == charge
        seen_any += held > 0
    assert seen_any  # passes did gather context onto the compute device
    if not compress_kv:
        assert exact == len(charged)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_next_layers_context_gathered_ahead_is_charged(tiny_checkpoint, tmp_path, monkeypatch, micro_batches):
    """KV on disk (its loads run on the I/O thread, on the CPU too): layer j + 1's first micro-batch
    context is gathered while layer j's last micro-batch computes (FlexGen's order; with one
    micro-batch as with several), once per layer after the first of every pass; the compute device
    then holds that context beside the last one, and the engine's charge covers the pair, exactly
    (plain pools: the charge counts the gathered slots themselves)."""
    folder, _ = tiny_checkpoint(KIND)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=micro_batches, prefill_budget=8, kv_admission="reserve",
                    kv_gpu=0.0, kv_cpu=0.0, kv_disk=1.0)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    gathered: list[tuple[int, int, int]] = []  # (layer, id of the micro-batch's tokens, bytes), in order
    ahead: list[int] = []
    gather, gather_ahead = PassExecutor._contexts, PassExecutor._gather_ahead
    charged = _record_charges(monkeypatch, engine, gathered)

    def observed_contexts(self, layer, mb):
        contexts = gather(self, layer, mb)
        gathered.append((layer, id(mb.token_ids), sum(t.nbytes for group in contexts for kv in group
                                                      if kv is not None and kv is not executor_module.IN_POOL
                                                      for t in kv)))
        return contexts

    def observed_ahead(self, layer, mb):
        ahead.append(layer)
        return gather_ahead(self, layer, mb)

    monkeypatch.setattr(PassExecutor, "_contexts", observed_contexts)
    monkeypatch.setattr(PassExecutor, "_gather_ahead", observed_ahead)
    try:
        _generate(engine, [[1 + i] * n for i, n in enumerate((5, 9, 3, 12))], max_tokens=5)
        kv_dim, item, layers = engine.config.num_kv_heads * engine.config.head_dim, engine.dtype.itemsize, \
            engine.config.num_layers
    finally:
        engine.close()
    assert layers > 1 and len(charged) > 3
    assert sorted(ahead) == sorted(list(range(1, layers)) * len(charged))
    ends = [start for start, _, _ in charged[1:]] + [len(gathered)]
    for (start, order, tokens), end in zip(charged, ends):
        # in the order they are computed: layer by layer, micro-batches in order
        loads = sorted(gathered[start:end], key=lambda load: (load[0], order.index(load[1])))
        sizes = [nbytes for _, _, nbytes in loads]
        held = max(a + b for a, b in zip(sizes, sizes[1:] + [0]))  # each context and the next one's
        assert held == 2 * tokens.context_slots * kv_dim * item


@pytest.mark.parametrize("policy", [
    Policy(gpu_batch_size=2, num_gpu_batches=3, scheduler="block", kv_gpu=0.5, kv_cpu=0.5, kv_disk=0.0),
    Policy(gpu_batch_size=3, num_gpu_batches=2, scheduler="block", act_gpu=0.5, act_cpu=0.5),
    Policy(gpu_batch_size=2, num_gpu_batches=3, prefill_budget=8, kv_gpu=0.5, kv_cpu=0.5, kv_disk=0.0),
    Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=16, kv_admission="reserve", compress_kv=True),
    Policy(gpu_batch_size=4, prefill_budget=8, kv_gpu=0.3, kv_cpu=0.7, kv_disk=0.0),
    Policy(gpu_batch_size=1, num_gpu_batches=6, prefill_budget=10, kv_gpu=0.5, kv_cpu=0.5, kv_disk=0.0),
    # one micro-batch whose next layer's context is gathered ahead (KV on disk: loads on the I/O thread)
    Policy(gpu_batch_size=3, prefill_budget=8, kv_gpu=0.0, kv_cpu=0.0, kv_disk=1.0),
])
def test_every_pass_is_within_the_largest_pass_of_its_kind(tiny_checkpoint, tmp_path, monkeypatch, policy):
    """The fail-early check (working_set.worst_passes: the largest pass of each kind the scheduler
    forms) bounds every pass the engine then runs: each pass's shape is within one kind's in every
    field the working set adds up, so no pass reserves more activations than was checked."""
    from dataclasses import astuple

    from flexsarathi.engine import llm_engine

    folder, _ = tiny_checkpoint(KIND)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path),
                                    kv_block_size=4))
    seen, kinds, pass_tokens, worst_passes = [], [], engine._pass_tokens, llm_engine.worst_passes

    def observed_tokens(batches):
        seen.append(pass_tokens(batches))
        return seen[-1]

    def checked_kinds(*args, **kwargs):  # what the fail-early check reserved for
        kinds.extend(worst_passes(*args, **kwargs))
        return kinds

    monkeypatch.setattr(engine, "_pass_tokens", observed_tokens)
    monkeypatch.setattr(llm_engine, "worst_passes", checked_kinds)
    try:
        _generate(engine, [[1 + i] * n for i, n in enumerate((5, 9, 3, 12, 7, 10, 4))], max_tokens=6)
    finally:
        engine.close()
    assert len(seen) > 6 and len(kinds) == (2 if policy.scheduler == "block" else 1)
    for tokens in seen:
        assert any(all(a <= b for a, b in zip(astuple(tokens), astuple(kind))) for kind in kinds), (tokens, kinds)


@given(decodes=st.integers(0, 60), chunks=st.lists(st.integers(1, 40), max_size=12), k=st.integers(2, 12))
@settings(max_examples=300, deadline=None)
def test_sequences_per_micro_batch_bounds_the_schedulers_split(decodes, chunks, k):
    """working_set's bound on the sequences of one micro-batch holds for the scheduler's own split
    (largest items first, each to the lightest micro-batch) of any prompt chunks beside decodes."""
    from types import SimpleNamespace

    from flexsarathi.engine.scheduler import Scheduler
    from policy_search.working_set import _sequences_per_micro_batch

    items = [SimpleNamespace(num_tokens=n) for n in chunks] + [SimpleNamespace(num_tokens=1)] * decodes
    if not items:
        return
    batches = Scheduler._split(SimpleNamespace(config=SimpleNamespace(num_micro_batches=k)), items)
    bound = _sequences_per_micro_batch(decodes, sum(chunks), len(chunks), k)
    assert max(len(b) for b in batches) <= bound
