"""The CPU compute dtype chosen by measurement (flexsarathi/machine/dtype_choice.py): the rule on rate
tables, the per-machine cache (explicit dtype wins, another machine's entry and a corrupt file
are measured again), one real measurement here, and the AVX2 class emulated with torch's ISA
overrides. Nothing here asserts a time: expectations derive from the rates the run measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flexsarathi import LLM
from flexsarathi.machine.dtype_choice import (HALF_SPEEDUP, CACHE_FILE, candidate_dtypes, choose_dtype,
                                      cpu_compute_dtype, machine_key)
from flexsarathi.engine.llm_engine import resolve_dtype
from flexsarathi.machine.cpu_info import cpu_description
from tests.conftest import REPO

T = 1e12
CPU = torch.device("cpu")


@pytest.fixture
def small_probe(monkeypatch):
    """A 16x smaller probe layer (hidden 256, MLP 1024): the tests of the cache's behaviour still
    measure for real, in a fraction of the time; the real-size measurement has its own test."""
    from flexsarathi.machine import dtype_choice
    from flexsarathi.machine.layer_timing import LayerShapes

    h, f = 256, 1024
    monkeypatch.setattr(dtype_choice, "probe_layer",
                        lambda: LayerShapes(((3 * h, h), (h, h), (f, h), (h, f)), heads=4, kv_heads=4, head_dim=64))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXSARATHI_CACHE_DIR", str(tmp_path))
    return tmp_path


def _entries(folder) -> list[dict]:
    return json.loads((folder / CACHE_FILE).read_text())["entries"]


def _write_cache(folder, entries) -> None:
    (folder / CACHE_FILE).write_text(json.dumps({"entries": entries}))


def _measured_entry(folder) -> dict:
    """This machine's entry, checked to be a measurement that the rule turns into its dtype."""
    (entry,) = [e for e in _entries(folder) if e["key"] == machine_key()]
    rates = {getattr(torch, name): tuple(r) for name, r in entry["rates_flops"].items()}
    assert set(rates) == set(candidate_dtypes(entry["key"]["flags"]))
    assert entry["dtype"] == str(choose_dtype(rates)).removeprefix("torch.")
    return entry


def test_slow_bf16_picks_fp32():
    # An AVX2-only CPU (issue 18): bf16 emulated at ~0.02 TFLOP/s against 0.09-0.12 for fp32.
    assert choose_dtype({torch.float32: (0.09 * T, 0.12 * T), torch.bfloat16: (0.02 * T, 0.02 * T)}) == torch.float32


def test_fast_bf16_picks_bf16():
    # AVX-512 BF16 (this machine's class): 0.10 against 0.45 TFLOP/s.
    assert choose_dtype({torch.float32: (0.06 * T, 0.10 * T), torch.bfloat16: (0.20 * T, 0.45 * T)}) == torch.bfloat16


def test_half_must_be_clearly_faster_at_both_row_counts():
    fp32 = (0.1 * T, 0.1 * T)
    just_below = HALF_SPEEDUP * 0.99
    assert choose_dtype({torch.float32: fp32, torch.bfloat16: (0.1 * T * just_below, 0.5 * T)}) == torch.float32
    assert choose_dtype({torch.float32: fp32, torch.bfloat16: (0.5 * T, 0.1 * T * just_below)}) == torch.float32
    both = {torch.float32: fp32, torch.bfloat16: (0.2 * T, 0.3 * T), torch.float16: (0.25 * T, 0.26 * T)}
    assert choose_dtype(both) == torch.float16  # the larger of the two worst-case speed-ups (2.5x > 2x)


def test_fp16_is_a_candidate_only_with_fp16_arithmetic():
    assert torch.float16 not in candidate_dtypes(["avx2", "fma", "f16c", "avx512_bf16"])
    assert torch.float16 in candidate_dtypes(["avx512f", "avx512_fp16"])
    assert torch.float16 in candidate_dtypes(["amx_tile", "amx_fp16"])


def test_explicit_dtype_wins_over_the_cache(cache_dir):
    for cached in (torch.float32, torch.bfloat16):  # either way the default reads the cache ...
        _write_cache(cache_dir, [{"key": machine_key(), "dtype": str(cached).removeprefix("torch.")}])
        assert resolve_dtype(None, torch.float32, CPU) == cached
        assert resolve_dtype("auto", torch.float32, CPU) == cached
        assert resolve_dtype("AUTO", torch.float32, CPU) == cached
        for explicit in (torch.float32, torch.bfloat16, torch.float16):  # ... and a set dtype wins
            assert resolve_dtype(explicit, torch.float32, CPU) == explicit
            assert resolve_dtype(str(explicit).removeprefix("torch."), torch.float32, CPU) == explicit
    assert len(_entries(cache_dir)) == 1  # nothing was measured


def test_llm_auto_follows_the_cached_choice(cache_dir, tiny_checkpoint):
    folder, _ = tiny_checkpoint("opt")
    for cached in ("bfloat16", "float32"):
        _write_cache(cache_dir, [{"key": machine_key(), "dtype": cached}])
        for dtype in (None, "auto"):
            llm = LLM(folder, dtype=dtype, device="cpu")
            assert llm.engine.dtype == getattr(torch, cached)
            llm.close()


def test_cli_and_planner_follow_the_cached_choice(cache_dir, tiny_checkpoint, capsys):
    from flexsarathi.cli.main import main
    from flexsarathi.engine.planner_spec import planner_model_spec

    if torch.cuda.is_available():
        pytest.skip("the default device is a GPU here: the CPU rule is not the one that applies")
    folder, _ = tiny_checkpoint("opt")
    for cached in ("bfloat16", "float32"):
        _write_cache(cache_dir, [{"key": machine_key(), "dtype": cached}])
        assert planner_model_spec(folder, dtype="auto").bytes_per_value == getattr(torch, cached).itemsize
        for extra in ([], ["--dtype", "auto"]):
            argv = ["bench", "--model", folder, "--prompt-len", "4", "--gen-len", "2", "--num-prompts", "2", *extra]
            assert main(argv) == 0
            assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["dtype"] == cached


def test_a_real_measurement_picks_a_candidate_and_caches_it(cache_dir):
    chosen = cpu_compute_dtype()
    assert chosen in candidate_dtypes(cpu_description()["flags"])
    entry = _measured_entry(cache_dir)
    assert entry["dtype"] == str(chosen).removeprefix("torch.")
    assert entry["key"]["threads"] == torch.get_num_threads() and entry["key"]["torch"] == torch.__version__
    assert cpu_compute_dtype() == chosen and _entries(cache_dir) == [entry]  # read back, not re-measured


def test_another_machines_entry_is_not_used(cache_dir, small_probe):
    other = dict(machine_key(), cpu="Some Other CPU", threads=machine_key()["threads"] + 7)
    # Whatever this machine picks, one of these two entries disagrees with it: neither may be used.
    planted = [{"key": dict(other, flags=[]), "dtype": "float32"}, {"key": other, "dtype": "bfloat16"}]
    _write_cache(cache_dir, planted)
    chosen = cpu_compute_dtype()
    entry = _measured_entry(cache_dir)
    assert entry["dtype"] == str(chosen).removeprefix("torch.")
    assert _entries(cache_dir)[:2] == planted  # kept for their machines


@pytest.mark.parametrize("content", [b"\xff{not json", b'{"entries": 3}', None])
def test_a_corrupt_cache_is_measured_again_and_rewritten(cache_dir, content, small_probe):
    path = cache_dir / CACHE_FILE
    if content is None:  # this machine's entry naming no dtype it could compute in
        _write_cache(cache_dir, [{"key": machine_key(), "dtype": "int3"}])
    else:
        path.write_bytes(content)
    chosen = cpu_compute_dtype()
    assert _measured_entry(cache_dir)["dtype"] == str(chosen).removeprefix("torch.")
    assert len(_entries(cache_dir)) == 1


def test_an_unwritable_cache_folder_costs_no_run(tmp_path, monkeypatch, caplog, small_probe):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLEXSARATHI_CACHE_DIR", str(blocker))
    chosen = cpu_compute_dtype()
    assert chosen in candidate_dtypes(cpu_description()["flags"])
    assert "could not write the CPU dtype cache" in caplog.text


AVX2_CLASS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.slow
def test_avx2_class_emulated_picks_what_its_rates_say(tmp_path):
    """torch limited to AVX2 (set before it is imported): the choice follows the rates measured
    there. Where bf16 then runs no faster than the rule asks (as on a real AVX2-only CPU), fp32."""
    env = dict(os.environ, FLEXSARATHI_CACHE_DIR=str(tmp_path), **AVX2_CLASS)
    code = "from flexsarathi.machine.dtype_choice import cpu_compute_dtype; print(cpu_compute_dtype())"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (entry,) = _entries(tmp_path)
    assert entry["key"]["overrides"] == AVX2_CLASS and entry["key"]["torch_cpu_capability"] == "AVX2"
    rates = {getattr(torch, n): r for n, r in entry["rates_flops"].items()}
    fp32, bf16 = rates[torch.float32], rates[torch.bfloat16]
    expected = choose_dtype(rates)
    assert done.stdout.strip() == str(expected) and entry["dtype"] == str(expected).removeprefix("torch.")
    if min(b / f for b, f in zip(bf16, fp32)) < HALF_SPEEDUP and torch.float16 not in rates:
        assert expected == torch.float32
    # The emulated machine's choice is cached under its own key, not this process's.
    assert entry["key"] != machine_key()
