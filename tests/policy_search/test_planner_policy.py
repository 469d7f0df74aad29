"""policy_search/policy.py: validation names the bad field, JSON round trips, derived sizes."""
import json

import pytest

from policy_search import Policy
from policy_search.policy import PolicyError

BAD = [
    (dict(gpu_batch_size=0), r"Policy.gpu_batch_size must be a positive integer, got 0"),
    (dict(num_gpu_batches=1.5), r"Policy.num_gpu_batches must be a positive integer, got 1.5"),
    (dict(prefill_budget=True), r"Policy.prefill_budget must be a positive integer, got True"),
    (dict(weight_prefetch=0), r"Policy.weight_prefetch must be a positive integer, got 0"),
    (dict(w_gpu=1.2, w_cpu=-0.2), r"Policy.w_gpu must be in \[0, 1\], got 1.2"),
    (dict(kv_gpu=0.5, kv_cpu=0.4), r"Policy KV cache fractions must sum to 1: kv_gpu=0.5 \+ kv_cpu=0.4 \+ kv_disk=0 = 0.9"),
    (dict(act_gpu=float("nan")), r"Policy.act_gpu must be a number in \[0, 1\], got nan"),
    (dict(overlap="yes"), r"Policy.overlap must be true or false, got 'yes'"),
    (dict(scheduler="fifo"), r"Policy.scheduler must be one of \('decode-maximal', 'block'\), got 'fifo'"),
]


@pytest.mark.parametrize("changes, message", BAD, ids=[next(iter(c)) for c, _ in BAD])
def test_bad_field_is_one_clear_error(changes, message):
    with pytest.raises(PolicyError, match=f"^{message}$"):
        Policy(**changes)


def test_json_round_trip_and_a_bad_file_names_itself(tmp_path):
    policy = Policy(gpu_batch_size=24, num_gpu_batches=3, w_gpu=0.2, w_cpu=0.5, w_disk=0.3, kv_gpu=0.0,
                    kv_cpu=1.0, cpu_attention=True, compress_weight=True, weight_prefetch=2)
    path = tmp_path / "p.json"
    policy.save(path)
    assert Policy.load(path) == policy
    path.write_text(json.dumps({**policy.to_dict(), "weight_prefetch": -1}))
    with pytest.raises(PolicyError, match=f"^policy file {path}: Policy.weight_prefetch must be a positive integer"):
        Policy.load(path)
    path.write_text(json.dumps({"w_gpu": 1.0, "gpu_batch": 4}))
    with pytest.raises(PolicyError, match=r"unknown policy field\(s\) \['gpu_batch'\]"):
        Policy.load(path)
    # A policy file written before weight_prefetch existed still loads, with FlexGen's default.
    old = {k: v for k, v in policy.to_dict().items() if k != "weight_prefetch"}
    assert Policy.from_dict(old).weight_prefetch == 1


@pytest.mark.parametrize("text, message", [
    (b"{", "is not valid JSON: Expecting property name"),
    (b"", "is not valid JSON: Expecting value"),
    (b'{"scheduler": "\xff"}', r"is not UTF-8 text \(byte 0xff at offset 15\)"),
    (b"[" * 100_000, "is not valid JSON: nested too deeply"),
    (b'{"a": "' + b"x" * (1 << 20) + b'"}', r"is 1048585 bytes, larger than any policy file \(1048576 at most\)"),
    (b"[1]", ": expected a JSON object of policy fields, got list"),
    (b'{"policy": [1], "estimate": {}}', r", field 'policy': expected a JSON object of policy fields, got list"),
    (b'{"policy": {"gpu_batch_size": 0}, "estimate": {}}', ", field 'policy': Policy.gpu_batch_size must be a positive"),
    (b'{"gpu_batchsize": 4}', r"unknown policy field\(s\) \['gpu_batchsize'\]; did you mean 'gpu_batch_size' for "
                            r"'gpu_batchsize'\?; known fields"),
    (b'{"gpu_batch_size": 1e400}', "Policy.gpu_batch_size must be a positive integer, got inf"),
    (b'{"gpu_batch_size": 1' + b"0" * 400 + b"}", "Policy.gpu_batch_size must be at most 2147483647, got 1000"),
    (b'{"kv_cache_tokens": 100000000000000000000}', "Policy.kv_cache_tokens must be a positive integer "
                                                  r"\(at most 2147483647\) or null, got 100000000000000000000"),
], ids=["malformed", "empty", "not-utf8", "deep", "huge", "array", "wrapped-array", "wrapped-bad", "typo",
        "inf", "huge-int", "huge-kv-tokens"])
def test_a_bad_policy_file_is_one_error_naming_it(tmp_path, text, message):
    """Each used to escape as a UnicodeDecodeError, RecursionError, a file read whole into memory, a
    misleading 'unknown field policy', or an int that overflowed later (the estimate's floats, torch)."""
    path = tmp_path / "p.json"
    path.write_bytes(text)
    with pytest.raises(PolicyError, match=f"^policy file {path}.*{message}"):
        Policy.load(path)


def test_a_folder_is_no_policy_file(tmp_path):
    with pytest.raises(PolicyError, match=f"^policy file {tmp_path} is a folder, not a JSON file$"):
        Policy.load(tmp_path)


def test_the_file_policy_json_writes_loads(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"policy": Policy(gpu_batch_size=4).to_dict(), "estimate": {"tokens_per_s": 1.0}}))
    assert Policy.load(path) == Policy(gpu_batch_size=4)


@pytest.mark.parametrize("overlap, prefetch, buffers", [(True, 1, 2), (True, 2, 3), (False, 2, 1)])
def test_weight_buffers(overlap, prefetch, buffers):
    policy = Policy(overlap=overlap, weight_prefetch=prefetch)
    assert policy.weight_buffers == buffers
    assert policy.max_running == policy.gpu_batch_size * policy.num_gpu_batches


def test_the_planners_errors_are_flexsarathi_errors():
    """One `except FlexSarathiError` catches every bad input, a bad policy or spec too (they were
    plain ValueErrors: a serve batch failing on one reported it as a server bug)."""
    from flexsarathi import FlexSarathiError
    from policy_search import HardwareSpec
    from policy_search.errors import InfeasibleError, SpecError

    assert issubclass(SpecError, FlexSarathiError) and issubclass(InfeasibleError, FlexSarathiError)
    with pytest.raises(FlexSarathiError, match="w_gpu"):
        Policy(w_gpu=2.0)
    with pytest.raises(FlexSarathiError):
        HardwareSpec.preset("no-such-gpu")
    assert FlexSarathiError.__module__ == "flexsarathi.errors"
