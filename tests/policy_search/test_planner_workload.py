import itertools
import json

import pytest

from policy_search import SpecError, Workload


def test_fixed_lengths():
    w = Workload(prompt_len=512, gen_len=32)
    assert w.is_fixed and w.lengths == ((512, 32),)
    assert w.mean_decode_steps == 31
    # decode step i (1..31) attends to 512 + i tokens: the mean is 512 + 32 / 2
    assert w.mean_decode_context == pytest.approx(sum(512 + i for i in range(1, 32)) / 31)
    assert w.mean_prompt_causal_pairs == pytest.approx((512 + 1) / 2)
    assert w.expected_block_max(64) == (512, 32)


def test_distribution_statistics_match_brute_force():
    pairs = [(100, 10), (300, 2), (50, 40), (300, 2)]
    w = Workload.from_pairs(pairs, num_requests=7)
    decode = [(s, i) for s, n in pairs for i in range(1, n)]
    assert w.mean_decode_steps == pytest.approx(len(decode) / len(pairs))
    assert w.mean_decode_context == pytest.approx(sum(s + i for s, i in decode) / len(decode))
    assert (w.max_prompt_len, w.max_gen_len, w.max_total_len) == (300, 40, 302)
    for block in (1, 2, 3):
        draws = list(itertools.product(pairs, repeat=block))
        expect_s = sum(max(p[0] for p in d) for d in draws) / len(draws)
        expect_n = sum(max(p[1] for p in d) for d in draws) / len(draws)
        assert w.expected_block_max(block) == pytest.approx((expect_s, expect_n))


@pytest.mark.parametrize("text", [
    "[[100, 10], [300, 2]]",
    '[{"prompt_len": 100, "gen_len": 10}, {"prompt_len": 300, "gen_len": 2}]',
    '{"pairs": [[100, 10], [300, 2]]}',
    '{"prompt_len": 100, "gen_len": 10}\n{"prompt_len": 300, "gen_len": 2}\n',
    "prompt_len,gen_len\n100,10\n300,2\n",
    "# lengths\n100 10\n\n300 2\n",
])
def test_file_formats(tmp_path, text):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    assert Workload.from_file(path, num_requests=5) == Workload(pairs=((100, 10), (300, 2)), num_requests=5)


def test_errors_name_the_field(tmp_path):
    with pytest.raises(SpecError, match="prompt_len"):
        Workload(prompt_len=0, gen_len=3)
    with pytest.raises(SpecError, match="gen_len"):
        Workload(prompt_len=3)
    with pytest.raises(SpecError, match="not both"):
        Workload(prompt_len=3, gen_len=3, pairs=((1, 1),))
    with pytest.raises(SpecError, match=r"pairs\[1\]"):
        Workload(pairs=((1, 1), (5, 0)))
    with pytest.raises(SpecError, match="num_requests"):
        Workload(prompt_len=3, gen_len=3, num_requests=0)
    path = tmp_path / "bad.txt"
    path.write_text("100 10\n100 x\n")
    with pytest.raises(SpecError, match="line 2"):
        Workload.from_file(path)
    path.write_text(json.dumps([{"prompt": 1}]))
    with pytest.raises(SpecError, match="prompt_len"):
        Workload.from_file(path)
