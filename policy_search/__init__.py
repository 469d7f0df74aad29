"""Pure planning: model shapes, hardware, workload -> Policy + Estimate. Never imports the runtime."""
from policy_search.policy import Policy, PolicyError

__all__ = ["Policy", "PolicyError"]
