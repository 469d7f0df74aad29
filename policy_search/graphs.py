"""Which policies' decode passes the engine replays from CUDA graphs: one rule for the engine
(flexsarathi/engine/graph_passes.py) and the planner's estimate (cost_model: such a pass costs
`HardwareSpec.graph_layer_overhead` per layer instead of `layer_overhead`)."""
from __future__ import annotations

from policy_search.policy import Policy


def graphs_refused(policy: Policy, has_experts: bool) -> str | None:
    """Why this policy's decode passes cannot be captured, or None where they can: a decode pass
    must move nothing (every weight, the whole KV cache and the hidden states on the GPU), its KV
    plain (a 4-bit pool's block bookkeeping is host-side data) and its layers dense (a
    mixture-of-experts router decides on the host which experts run)."""
    if policy.w_gpu < 1:
        return "weights are streamed"
    if policy.kv_gpu < 1:
        return "the KV cache is not all on the GPU"
    if policy.act_gpu < 1:
        return "activations are parked off the GPU"
    if policy.compress_kv:
        return "the KV cache is 4-bit"
    if has_experts:
        return "mixture-of-experts routing is decided on the host"
    return None
