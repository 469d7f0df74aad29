"""FlexGen's `--percent` as the bytes it places (policy_search/flexgen_placement.py), against the
tensors FlexGen's midpoint rule puts on each tier, worked out by hand for OPT's layer lists:
attention [q, b_q, k, b_k, v, b_v, out, b_out, ln, b_ln] (4h^2 + 6h values) and MLP [fc1, b_fc1,
fc2, b_fc2, ln, b_ln] (8h^2 + 7h, ffn = 4h)."""
import pytest

from policy_search import ModelSpec
from policy_search.flexgen_placement import flexgen_weight_split


def test_twenty_percent_on_the_gpu_holds_out_proj_only():
    """--percent 20 80: midpoints below 80% go to the CPU. Attention: q, k, v (12.5, 37.5, 62.5%) and
    their biases on the CPU; out_proj (87.5%), its bias and the LayerNorm on the GPU. MLP: fc1 (25%),
    its bias (50%), fc2 (75%) on the CPU; fc2's bias and the LayerNorm on the GPU."""
    model = ModelSpec.from_name("opt-30b")
    h = model.hidden_size
    gpu = (h * h + 3 * h) + 3 * h
    whole = (4 * h * h + 6 * h) + (8 * h * h + 7 * h)
    assert flexgen_weight_split(model, 20, 80) == pytest.approx((gpu / whole, 1 - gpu / whole, 0.0), rel=1e-12)
    assert gpu / whole == pytest.approx(1 / 12, rel=1e-3)  # 8.3% of the bytes, not 20%


def test_half_on_disk_half_on_the_cpu():
    """--percent 0 50 (OPT-175B's): midpoints below 50% on disk. Attention: q, b_q, k, b_k on disk
    (b_k's midpoint: (2h^2 + 1.5h) / (4h^2 + 6h) < 50%); MLP: fc1 and its bias (midpoint just below 50%)."""
    model = ModelSpec.from_name("opt-175b")
    h = model.hidden_size
    disk = (2 * h * h + 2 * h) + (4 * h * h + 4 * h)
    whole = (4 * h * h + 6 * h) + (8 * h * h + 7 * h)
    assert flexgen_weight_split(model, 0, 50) == pytest.approx((0.0, 1 - disk / whole, disk / whole), rel=1e-12)


@pytest.mark.parametrize("percent, split", [((100, 0), (1.0, 0.0, 0.0)), ((0, 100), (0.0, 1.0, 0.0)),
                                            ((0, 0), (0.0, 0.0, 1.0))])
def test_whole_placements(percent, split):
    assert flexgen_weight_split(ModelSpec.from_name("opt-6.7b"), *percent) == split


def test_refuses_what_flexgen_does_not_place():
    with pytest.raises(ValueError, match="not one"):
        flexgen_weight_split(ModelSpec.from_name("llama-2-7b"), 20, 80)
