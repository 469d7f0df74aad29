"""The prefill budget of a decode-maximal policy over a closed batch: the planner's choice.

Why: a closed batch (every request admitted at once: no more requests than the running set) makes
its prompt passes first and decodes after (policy_search/passes.py): no decode waits in them, so
SARATHI's reason for a small budget (decodes riding along prompt chunks) is gone, and each prompt
pass pays the layer's fixed costs again: its weights streamed from the host or dequantized from
4 bits, the executor's per-layer overhead. Fewer, larger passes cost less, until their
activations no longer fit. FlexGen's block schedule is the one-pass end of that range.

The choice is the estimate's: among whole-prompt multiples of the prompt length (1, 2, 4, ... and
every prompt at once), the budget with the most tokens per second whose passes fit the tiers.
"""
from __future__ import annotations

import math

from policy_search.estimate import estimate
from policy_search.hardware import HardwareSpec
from policy_search.model_spec import ModelSpec
from policy_search.policy import Policy
from policy_search.workload import Workload


def closed_batch(policy: Policy, workload: Workload) -> bool:
    """Whether the workload is one closed batch under the policy: finite, all admitted at once."""
    return workload.num_requests is not None and workload.num_requests <= policy.max_running


def budget_candidates(prompt_len: int, requests: int) -> list[int]:
    """Whole prompts per pass, 1, 2, 4, ... and all `requests` of them, in tokens (ascending)."""
    counts = sorted({min(2**i, requests) for i in range(math.ceil(math.log2(max(requests, 1))) + 1)})
    return [count * prompt_len for count in counts]


def closed_batch_prefill_budget(policy: Policy, model: ModelSpec, hardware: HardwareSpec,
                                workload: Workload) -> int:
    """The prefill budget (prompt tokens per pass) the estimate runs fastest at, among the policy's
    own and the candidates whose passes fit, for a decode-maximal policy over a closed batch; the
    policy's own budget where the run is not one (another scheduler, an open stream) or where no
    candidate fits and runs faster."""
    if policy.scheduler != "decode-maximal" or not closed_batch(policy, workload):
        return policy.prefill_budget
    prompt = max(1, math.ceil(workload.max_prompt_len))
    own = estimate(policy, model, hardware, workload)
    best, best_rate = policy.prefill_budget, own.throughput if own.fits else None
    for budget in budget_candidates(prompt, workload.num_requests):
        est = estimate(policy.replace(prefill_budget=budget), model, hardware, workload)
        if est.fits and (best_rate is None or est.throughput > best_rate):
            best, best_rate = budget, est.throughput
    return best
