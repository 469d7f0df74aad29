"""The placement LP against brute force, stacking, and the relaxation bound used to skip LPs."""
import itertools

import pytest

from policy_search import ModelSpec, Policy, Workload, estimate
from policy_search import SolverMissingError, lp
from policy_search.bounds import placement_bound
from policy_search.estimate import pass_costs
from policy_search.units import GiB

GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


def splits():
    return [(a, b, round(1 - a - b, 10)) for a in GRID for b in GRID if a + b <= 1 + 1e-9]


def solve_one(policy, model, hw, wl, **kw):
    run, costs = pass_costs(policy, model, hw, wl)
    problem = lp.PlacementLP(costs=tuple(costs), generated_tokens=run.generated_tokens,
                             overlap=policy.overlap, budgets=hw.budgets(), **kw)
    return problem, lp.solve([problem])[0]


@pytest.fixture(scope="module")
def tight(t4):
    """opt-6.7b (12.5 GiB of weights) on 8 GiB GPU / 24 GiB CPU: placement matters on every tier."""
    return ModelSpec.from_name("opt-6.7b"), t4.with_memory(gpu=8 * GiB, cpu=24 * GiB), Workload(
        prompt_len=256, gen_len=16)


@pytest.mark.parametrize("knobs", [dict(scheduler="block"), dict(scheduler="block", cpu_attention=True),
                                   dict(scheduler="decode-maximal", prefill_budget=275)])
def test_lp_beats_every_grid_placement(tight, knobs):
    model, hw, wl = tight
    policy = Policy(gpu_batch_size=8, num_gpu_batches=2, **knobs)
    _, solution = solve_one(policy, model, hw, wl)
    assert solution.fits
    best = estimate(policy.replace(**solution.fractions), model, hw, wl)
    assert best.fits
    assert best.throughput == pytest.approx(1 / solution.seconds_per_token, rel=1e-6)
    grid_best = 0.0
    for w, kv, act in itertools.product(splits(), splits(), [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0)]):
        candidate = policy.replace(w_gpu=w[0], w_cpu=w[1], w_disk=w[2], kv_gpu=kv[0], kv_cpu=kv[1],
                                   kv_disk=kv[2], act_gpu=act[0], act_cpu=act[1], act_disk=act[2])
        est = estimate(candidate, model, hw, wl)
        if est.fits:
            grid_best = max(grid_best, est.throughput)
    assert grid_best > 0
    assert best.throughput >= grid_best * (1 - 1e-6)


def test_stacked_lps_equal_separate_ones(tight):
    model, hw, wl = tight
    hw = hw.with_memory(disk=0)
    policies = [Policy(gpu_batch_size=g, num_gpu_batches=n, scheduler=s, compress_kv=c)
                for g, n, s, c in [(4, 1, "block", False), (8, 4, "decode-maximal", True),
                                   (64, 64, "block", False), (16, 2, "block", True)]]
    problems, separate = [], []
    for p in policies:
        problem, solution = solve_one(p, model, hw, wl)
        problems.append(problem)
        separate.append(solution)
    stacked = lp.solve(problems)
    assert [s.fits for s in stacked] == [s.fits for s in separate]
    assert not stacked[2].fits and stacked[2].overflow_bytes > 0  # 4096 sequences' cache: no room
    for a, b in zip(stacked, separate):
        if a.fits:
            assert a.seconds_per_token == pytest.approx(b.seconds_per_token, rel=1e-6)


def test_fixed_fractions_are_honoured(tight):
    model, hw, wl = tight
    problem, solution = solve_one(Policy(gpu_batch_size=4, scheduler="block"), model, hw, wl,
                                  fixed=(("w_gpu", 0.1), ("kv_cpu", 1.0)))
    assert solution.fractions["w_gpu"] == pytest.approx(0.1) and solution.fractions["kv_cpu"] == 1.0


@pytest.mark.parametrize("gbs, nb, kind", [(1, 1, "block"), (8, 2, "block"), (8, 8, "decode-maximal"),
                                           (32, 16, "block"), (64, 64, "decode-maximal")])
def test_relaxation_bounds_the_lp(tight, gbs, nb, kind):
    model, hw, wl = tight
    policy = Policy(gpu_batch_size=gbs, num_gpu_batches=nb, scheduler=kind, prefill_budget=gbs * nb * 16)
    problem, solution = solve_one(policy, model, hw, wl)
    bound = placement_bound(list(problem.costs), problem.generated_tokens, True, hw.budgets(), {})
    free = placement_bound(list(problem.costs), problem.generated_tokens, True, hw.budgets(), {},
                           memory=False)
    if solution.fits:
        assert free >= bound >= (1 / solution.seconds_per_token) * (1 - 1e-9)
    if bound == 0:
        assert not solution.fits


# ---- the CBC solver under PuLP 4 (no pulp.apis.coin_api, no bundled binary) ------------------------
def test_lp_module_imports_without_pulps_bundled_cbc_module():
    """PuLP 4 has no pulp.apis.coin_api (a Python 3.12 machine installing pulp>=2.7 got it and the
    planner failed at import); emulated by making that module unimportable."""
    import subprocess
    import sys

    code = ("import sys, pulp.apis; del pulp.apis.coin_api; sys.modules['pulp.apis.coin_api'] = None; "
            "import policy_search.lp as lp; assert lp.coin_api is None")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_without_a_bundled_cbc_the_one_on_path_solves_the_same(tight, monkeypatch, tmp_path):
    model, hw, wl = tight
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2)
    bundled = lp._solver().path
    expected = solve_one(policy, model, hw, wl)[1]
    (tmp_path / "cbc").symlink_to(bundled)  # PuLP 4's way: a `cbc` found on PATH
    monkeypatch.setattr(lp, "coin_api", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert lp._solver().path != bundled
    assert solve_one(policy, model, hw, wl)[1] == expected


def test_no_cbc_anywhere_is_one_clear_error(tight, monkeypatch, tmp_path):
    model, hw, wl = tight
    monkeypatch.setattr(lp, "coin_api", None)
    monkeypatch.setenv("PATH", str(tmp_path))  # empty: no cbc
    with pytest.raises(SolverMissingError, match=r"needs the CBC solver.*pulp<4"):
        solve_one(Policy(gpu_batch_size=4, num_gpu_batches=2), model, hw, wl)
