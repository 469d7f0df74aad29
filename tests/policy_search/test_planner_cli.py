"""`flexsarathi policy`: the table, the JSON file LLM(policy=...) loads, and clean errors."""
import argparse
import json

import pytest

from flexsarathi.cli.policy import add_policy_parser
from policy_search import HardwareSpec, ModelSpec, Policy, Workload, estimate, search
from policy_search.units import GiB


def run(argv, capsys):
    parser = argparse.ArgumentParser()
    add_policy_parser(parser.add_subparsers())
    args = parser.parse_args(["policy", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_search_prints_the_table_and_writes_a_loadable_policy(tmp_path, capsys):
    out_path = tmp_path / "policy.json"
    rc, out, err = run(["--model", "opt-1.3b", "--hardware", "t4", "--gpu-mem", "2", "--prompt-len", "128",
                        "--gen-len", "16", "--json", str(out_path)], capsys)
    assert rc == 0 and not err
    for heading in ("Placement", "weights", "KV cache", "activations", "peak memory", "budget",
                    "Throughput", "Bound by", "Passes", "best block", "best decode-maximal"):
        assert heading in out
    loaded = Policy.load(out_path)
    from flexsarathi.engine.planner_spec import planner_model_spec

    # the spec the CLI plans with: a GPU engine's (which KV pools its kernels attend in place)
    model, hw = planner_model_spec("opt-1.3b", device="cuda"), HardwareSpec.preset("t4").with_memory(gpu=2 * GiB)
    workload = Workload(prompt_len=128, gen_len=16)
    expected, est = search(model, hw, workload)
    assert loaded == expected
    data = json.loads(out_path.read_text())
    assert data["estimate"]["throughput_tokens_per_s"] == pytest.approx(est.throughput)
    assert data["estimate"]["peak_memory_bytes"]["gpu"] <= 0.8 * 2 * GiB
    assert f"{est.throughput:.3f} generated tokens/s" in out

    # --policy estimates a given file instead of searching
    rc, out, _ = run(["--model", "opt-1.3b", "--gpu-mem", "2", "--prompt-len", "128", "--gen-len", "16",
                      "--policy", str(out_path)], capsys)
    assert rc == 0 and "Estimate of" in out and f"{est.throughput:.3f} generated tokens/s" in out


def test_profile_workload_file_and_fixed_knobs(tmp_path, capsys):
    profile = tmp_path / "machine.json"
    HardwareSpec.preset("a100-40g").with_memory(gpu=20 * GiB).save(profile)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100 20\n400 60\n")
    rc, out, _ = run(["--model", "llama-2-7b", "--hardware", str(profile), "--workload", str(lengths),
                      "--num-requests", "50", "--scheduler", "block", "--no-compress-weight",
                      "--gpu-batch-size", "8"], capsys)
    assert rc == 0
    assert "block: 8 sequences" in out and "4-bit weights off" in out and "50 requests" in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "opt-175b", "--cpu-mem", "10", "--disk-mem", "0"], "no policy fits opt-175b"),
    (["--model", "opt-9b"], "unknown model 'opt-9b'"),
    (["--model", "opt-125m", "--hardware", "v100"], "neither a preset"),
    (["--model", "opt-125m", "--prompt-len", "0"], "prompt_len"),
    (["--model", "opt-125m", "--dtype", "int3"], "--dtype: unsupported dtype 'int3'"),
])
def test_errors_exit_2_with_a_message(argv, message, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and err.startswith("error: ") and message in err


def test_registered_in_the_engine_cli(tmp_path, capsys):
    from flexsarathi.cli.main import main
    assert main(["policy", "--model", "opt-125m", "--prompt-len", "64", "--gen-len", "8",
                 "--json", str(tmp_path / "p.json")]) == 0
    policy = Policy.load(tmp_path / "p.json")
    est = estimate(policy, ModelSpec.from_name("opt-125m"), HardwareSpec.preset("t4"),
                   Workload(prompt_len=64, gen_len=8))
    assert est.fits and f"{est.throughput:.3f}" in capsys.readouterr().out


def test_dtype_sets_the_bytes_per_value(tmp_path, capsys):
    """--dtype: the bytes the planner charges per weight, KV and activation value. auto: a half
    dtype on a GPU preset; on a CPU profile (compute_on_host) this machine's measured choice (fp32
    where bf16 is slow: AVX2-only CPUs). Reference: the planner's estimate at those bytes."""
    import dataclasses

    import torch

    from flexsarathi.machine.dtype_choice import cpu_compute_dtype
    from offload.kv_cache import KVCompression, decode_in_pool_tiers

    def in_pool_tiers(device, dtype):  # opt-125m's head size, the default 4-bit KV format
        return tuple(decode_in_pool_tiers(device, dtype, 64, c) for c in (None, KVCompression()))

    fixed = tmp_path / "fixed.json"
    Policy(gpu_batch_size=4).save(fixed)
    cpu_profile = tmp_path / "cpu.json"
    host = dataclasses.replace(HardwareSpec.preset("t4"), compute_on_host=True)
    host.save(cpu_profile)
    workload = Workload(prompt_len=64, gen_len=8)
    here = cpu_compute_dtype().itemsize
    for hardware, spec, dtype, nbytes in (("t4", HardwareSpec.preset("t4"), None, 2),
                                          ("t4", HardwareSpec.preset("t4"), "float32", 4),
                                          (str(cpu_profile), host, None, here),
                                          (str(cpu_profile), host, "bfloat16", 2)):
        out_path = tmp_path / "est.json"
        rc, _, err = run(["--model", "opt-125m", "--hardware", hardware, "--prompt-len", "64", "--gen-len", "8",
                          "--policy", str(fixed), "--json", str(out_path)] + (["--dtype", dtype] if dtype else []),
                         capsys)
        assert rc == 0, err
        # as the engine runs it there: on the CPU, decodes over a plain pool attend it in place
        in_pool = (in_pool_tiers(torch.device("cpu"), {2: torch.bfloat16, 4: torch.float32}[nbytes])
                   if spec.compute_on_host else ((), ()))
        model = dataclasses.replace(ModelSpec.from_name("opt-125m", bytes_per_value=nbytes), decode_in_pool=in_pool)
        expected = estimate(Policy.load(fixed), model, spec, workload)
        got = json.loads(out_path.read_text())["estimate"]["peak_memory_bytes"]
        assert got["gpu"] == pytest.approx(expected.peak_memory["gpu"]), (hardware, dtype)
        out_path.unlink()
    fp32 = estimate(Policy.load(fixed), ModelSpec.from_name("opt-125m", bytes_per_value=4), host, workload)
    half = estimate(Policy.load(fixed), ModelSpec.from_name("opt-125m", bytes_per_value=2), host, workload)
    assert fp32.peak_memory["gpu"] > 1.5 * half.peak_memory["gpu"]  # the choice is visible in the plan


def test_compress_head_is_priced_as_the_engine_holds_it(tmp_path, capsys):
    """--compress-head: llama-2-7b's untied head priced in the weight format, as `generate --policy auto
    --compress-head` plans it (planned_model(compress_head=True)); the head's bytes leave the tier
    that holds the embeddings and head. A tied head is refused, as the engine refuses it."""
    from flexsarathi.engine.planner_spec import planned_model

    fixed = tmp_path / "fixed.json"
    Policy(gpu_batch_size=4, compress_weight=True).save(fixed)
    workload, hardware = Workload(prompt_len=64, gen_len=8), HardwareSpec.preset("a100-40g")
    peaks = {}
    for head in (False, True):
        out_path = tmp_path / f"est-{head}.json"
        rc, _, err = run(["--model", "llama-2-7b", "--hardware", "a100-40g", "--prompt-len", "64", "--gen-len", "8",
                          "--dtype", "float16", "--policy", str(fixed), "--json", str(out_path)]
                         + (["--compress-head"] if head else []), capsys)
        assert rc == 0, err
        spec = planned_model("llama-2-7b", "float16", device="cuda", compress_head=head).spec
        expected = estimate(Policy.load(fixed), spec, hardware, workload)
        peaks[head] = json.loads(out_path.read_text())["estimate"]["peak_memory_bytes"]["gpu"]
        assert peaks[head] == pytest.approx(expected.peak_memory["gpu"])
    fp16_head = 32000 * 4096 * 2
    assert 0.7 * fp16_head < peaks[False] - peaks[True] < fp16_head  # 4-bit codes + group parameters stay

    rc, _, err = run(["--model", "opt-125m", "--compress-head"], capsys)
    assert rc == 2 and "--compress-head: opt-125m has no LM head of its own" in err
