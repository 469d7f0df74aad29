"""User-facing errors: each says what is wrong and where."""
from policy_search.errors import FlexSarathiError  # the root, beneath the planner's errors too

__all__ = ["FlexSarathiError", "CheckpointError"]


class CheckpointError(FlexSarathiError):
    """A checkpoint folder, config.json or safetensors file is missing, corrupt or inconsistent."""
