"""User-facing errors: each says what is wrong and where."""


class FlexSarathiError(ValueError):
    """Bad input (a checkpoint, a prompt, a parameter): the message names what and where."""


class CheckpointError(FlexSarathiError):
    """A checkpoint folder, config.json or safetensors file is missing, corrupt or inconsistent."""
