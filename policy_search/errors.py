"""Planner errors. Both are ValueErrors whose message names the bad field or the memory shortfall."""
from __future__ import annotations


class SpecError(ValueError):
    """A ModelSpec, HardwareSpec, Workload or search constraint field is invalid (named in the message)."""


class InfeasibleError(ValueError):
    """No policy fits the workload in the available memory; the message gives the arithmetic."""
