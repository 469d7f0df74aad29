"""User-facing errors: each says what is wrong and where."""
from policy_search.errors import FlexSarathiError  # the root, beneath the planner's errors too

__all__ = ["FlexSarathiError", "CheckpointError", "in_chain"]


class CheckpointError(FlexSarathiError):
    """A checkpoint folder, config.json or safetensors file is missing, corrupt or inconsistent."""


def in_chain(exc: BaseException | None, wanted) -> BaseException | None:
    """The first exception `wanted(e)` accepts among exc itself and those it was raised from or
    during (__cause__, else __context__: an error raised `from None` in an except block keeps the
    one it replaced as its context); None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if wanted(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
