"""Planner errors, each with a message that names the bad field, the memory shortfall or the missing tool."""
from __future__ import annotations


class SpecError(ValueError):
    """A ModelSpec, HardwareSpec, Workload or search constraint field is invalid (named in the message)."""


class InfeasibleError(ValueError):
    """No policy fits the workload in the available memory; the message gives the arithmetic."""


class SolverMissingError(RuntimeError):
    """No CBC executable: the LP cannot be solved here (the message says how to get one)."""
