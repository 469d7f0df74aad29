"""A pass holds no more than the engine charges for it (policy_search/working_set.py, the planner's
formula): every tensor a pass creates, live at once as a caching allocator holds them
(tests/live_bytes.py), stays within the engine's charge for that pass, for each family's layer (OPT
pre- and post-norm, a gated MLP with rotary tables, mixtures of experts), with the layer after
attention in one call and in slices (offload/executor.py _post_attention); and the slices give the
tokens of one call. A gated MLP's charge used to leave out its activated gate and the rotated q and
k: a LLaMA prompt pass held 1.49x its charge."""
from __future__ import annotations

import pytest

from flexsarathi.engine import llm_engine as engine_module
from flexsarathi.engine.llm_engine import EngineConfig, LLMEngine
from flexsarathi.engine.sampling import SamplingParams
from offload import executor as executor_module
from policy_search.policy import Policy
from tests.live_bytes import LiveBytes, storages_alive

KINDS = ["opt_blocks64", "opt350m", "llama_blocks64", "qwen3_moe", "mixtral", "qwen2_moe"]
PROMPTS, PROMPT_LEN, MAX_TOKENS = 16, 40, 3  # a 640-row prompt pass


def _slice_rows(monkeypatch, rows: int) -> None:
    """The executor's slice of the layer after attention, and the engine's charge, at `rows`."""
    monkeypatch.setattr(executor_module, "POST_ATTENTION_ROWS", rows)
    monkeypatch.setattr(engine_module, "POST_ATTENTION_ROWS", rows)


def _measured_passes(folder: str, tmp_path, monkeypatch, scheduler: str, compress_kv: bool = False,
                     prompt_len: int = PROMPT_LEN):
    """Per pass: (live bytes at its peak, the engine's charge for it), and the generated tokens."""
    policy = Policy(gpu_batch_size=PROMPTS, scheduler=scheduler, prefill_budget=PROMPTS * prompt_len,
                    compress_kv=compress_kv)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path), dtype="float32"))
    charges, charge = [], engine._pass_working_bytes
    monkeypatch.setattr(engine, "_pass_working_bytes", lambda batches: charges.append(charge(batches)) or charges[-1])
    seqs = [engine.make_sequence([1 + (7 * i + j) % 100 for j in range(prompt_len)],
                                 SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for i in range(PROMPTS)]
    passes = []
    try:
        engine.add_requests([[seq] for seq in seqs])
        while engine.has_unfinished():
            live = LiveBytes(storages_alive())
            with live:
                engine.step()
            passes.append((live.peak, charges[-1]))
    finally:
        engine.close()
    return passes, [list(seq.output_token_ids) for seq in seqs]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("slice_rows", [4096, 64])
def test_a_pass_holds_at_most_its_charge(tiny_checkpoint, tmp_path, monkeypatch, kind, slice_rows):
    folder, _ = tiny_checkpoint(kind)
    _slice_rows(monkeypatch, slice_rows)
    passes, _ = _measured_passes(folder, tmp_path, monkeypatch, "block")
    prefill_peak, prefill_charge = passes[0]
    assert len(passes) == MAX_TOKENS
    assert all(peak <= charged for peak, charged in passes), passes
    # what the charge leaves unused in the prompt pass: the next micro-batch's input and the parked
    # copy of this one's (one micro-batch here), the sliced call's output where there is one slice
    assert prefill_peak > 0.6 * prefill_charge, passes


@pytest.mark.parametrize("kind", ["opt_blocks64", "llama_blocks64"])
def test_a_pass_over_a_compressed_cache_holds_at_most_its_charge(tiny_checkpoint, tmp_path, monkeypatch, kind):
    """16 whole prompts of 100 tokens (two 4-bit KV blocks) in one group, attended block by block
    (attend_own_rows_by_block): the keys as stored, V as stored and one call's keys are charged as a
    gather's three K/V-sized tensors per key (without that charge OPT's prompt pass held 1.04x)."""
    folder, _ = tiny_checkpoint(kind)
    _slice_rows(monkeypatch, 64)  # the MLP's slices small: the attention's tensors make the peak
    passes, _ = _measured_passes(folder, tmp_path, monkeypatch, "block", compress_kv=True, prompt_len=100)
    assert all(peak <= charged for peak, charged in passes), passes


def test_slices_after_attention_give_one_calls_tokens(tiny_checkpoint, tmp_path, monkeypatch):
    """Decode-maximal (prompts in chunks beside decodes) and the block schedule, sliced by 64 rows
    and in one call: the same greedy tokens (every op after attention is row-wise)."""
    folder, _ = tiny_checkpoint("llama_blocks64")
    for scheduler in ("block", "decode-maximal"):
        tokens = []
        for rows in (4096, 64, 7):
            with monkeypatch.context() as patch:
                _slice_rows(patch, rows)
                tokens.append(_measured_passes(folder, tmp_path, patch, scheduler)[1])
        assert tokens[0] == tokens[1] == tokens[2]


@pytest.mark.parametrize("kind", ["opt_blocks64", "llama_blocks64"])
def test_a_decode_attended_in_its_pool_is_charged_its_indices(tiny_checkpoint, tmp_path, monkeypatch, kind):
    """Decodes over 120-token contexts attended in their plain pool on the CPU (the kernel reads the
    slots: nothing gathered) are charged the keys' slot indices and a score row per head, not a
    gathered K/V and its fp32 copies; with the gather forced (gathered_plain_decodes, a GPU's
    route) the same passes are charged the gather. Both hold at most their charge."""
    from offload.kv_cache import gathered_plain_decodes

    folder, _ = tiny_checkpoint(kind)
    in_place, tokens = _measured_passes(folder, tmp_path, monkeypatch, "block", prompt_len=120)
    with gathered_plain_decodes():
        gathered, gathered_tokens = _measured_passes(folder, tmp_path, monkeypatch, "block", prompt_len=120)
    assert tokens == gathered_tokens
    assert all(peak <= charged for peak, charged in in_place + gathered), (in_place, gathered)
    assert in_place[0] == gathered[0]  # the prompt pass: its keys are its own rows either way
    for (peak, charged), (_, gathered_charge) in zip(in_place[1:], gathered[1:]):
        assert charged < 0.1 * gathered_charge and peak > 0.5 * charged, (in_place, gathered)
