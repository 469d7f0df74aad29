"""Pure planning: model shapes, hardware, workload -> Policy + Estimate. Never imports the runtime.

    from policy_search import ModelSpec, HardwareSpec, Workload, search, estimate
    model = ModelSpec.from_name("opt-30b")
    policy, est = search(model, HardwareSpec.preset("t4"), Workload(prompt_len=512, gen_len=32))
    print(est.throughput, est.peak_memory, est.passes)
"""
from policy_search.errors import InfeasibleError, SolverMissingError, SpecError
from policy_search.estimate import Estimate, PassEstimate, estimate
from policy_search.hardware import PRESETS, HardwareSpec
from policy_search.model_spec import ModelSpec
from policy_search.policy import Policy, PolicyError
from policy_search.report import format_report, policy_file, write_policy_file
from policy_search.search import SearchResult, search, search_detailed
from policy_search.workload import Workload

__all__ = [
    "Policy", "PolicyError",
    "ModelSpec", "HardwareSpec", "PRESETS", "Workload",
    "search", "search_detailed", "SearchResult", "estimate", "Estimate", "PassEstimate",
    "format_report", "policy_file", "write_policy_file",
    "SpecError", "InfeasibleError", "SolverMissingError",
]
