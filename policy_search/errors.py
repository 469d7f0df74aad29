"""Planner errors, each with a message that names the bad field, the memory shortfall or the missing tool."""
from __future__ import annotations


class FlexSarathiError(ValueError):
    """Bad input (a checkpoint, a prompt, a parameter, a policy): the message names what and where.
    The root of every user-facing error, defined at the bottom of the import graph so that the
    planner's own errors are ones too (`except flexsarathi.FlexSarathiError` catches a bad policy);
    flexsarathi.errors re-exports it."""


FlexSarathiError.__module__ = "flexsarathi.errors"  # where users import it from (tracebacks name it so)


class SpecError(FlexSarathiError):
    """A ModelSpec, HardwareSpec, Workload or search constraint field is invalid (named in the message)."""


class InfeasibleError(FlexSarathiError):
    """No policy fits the workload in the available memory; the message gives the arithmetic."""


class SolverMissingError(RuntimeError):
    """No CBC executable: the LP cannot be solved here (the message says how to get one)."""
