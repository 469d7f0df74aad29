"""Ctrl-C inside a pass, taken where the engine can recover from it.

Python's own SIGINT handler raises KeyboardInterrupt at whatever bytecode the main thread runs
next: inside a thread pool's `submit` while it holds the pool's locks (the next pass then waits on
them forever), between a queue's put and its bookkeeping, in a library's context manager. No
`recover()` can know what such an interrupt left half done. While `DeferredInterrupts` is active
(the engine's step and its bookkeeping), SIGINT is only noted: the pass loop takes it between layers
(`raise_if_interrupted`), and the context raises it as it ends; at both points the engine is either
consistent or reset by its recover(). A layer takes seconds at most, so Ctrl-C still stops promptly.

A second SIGINT before the first is taken raises at once, as Python would (a stop that cannot wait
for the layer: a read that hangs); `forced` then says so, and the engine, which cannot vouch for
what it was doing, closes itself.

Only the main thread receives signals, and only Python's default handler is replaced: a handler of
the application's own (a server's, a notebook's) stays as it is, and so does its behaviour.
"""
from __future__ import annotations

import signal
import threading


class _Noted:
    """What SIGINT left for the process's one deferral. The deferral is active exactly while its
    handler (_note) is installed: no separate flag that an interrupt between two statements could
    leave stale."""
    pending = False  # a SIGINT came and is not taken yet
    forced = False  # a second one came first: raised at once, wherever the main thread was


_noted = _Noted()


def _note(signum, frame) -> None:
    if _noted.pending:
        _noted.forced = True
        raise KeyboardInterrupt
    _noted.pending = True


def raise_if_interrupted() -> None:
    """A point where the engine can recover: raise the SIGINT noted since the deferral began."""
    if (_noted.pending and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _note):
        _noted.pending = False
        raise KeyboardInterrupt


class DeferredInterrupts:
    """`with DeferredInterrupts() as deferral:` SIGINT is noted, not raised, until a
    raise_if_interrupted() or the end of the block. Re-entrant (an inner one does nothing); does
    nothing off the main thread or where the SIGINT handler is not Python's default."""

    def __init__(self, hold: bool = False) -> None:
        """hold: a SIGINT still noted as the block ends without an exception is not raised there but
        kept in `held`, for the caller to raise once it has handed its finished work over (a step
        whose pass completed returns its finished sequences first: LLMEngine.step)."""
        self._owner, self._hold = False, hold
        self._previous = None
        self.held = False

    @property
    def forced(self) -> bool:
        """A second SIGINT came before the first was taken and was raised where it landed."""
        return self._owner and _noted.forced

    def __enter__(self) -> "DeferredInterrupts":
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # _note: nested
            return self
        _noted.pending = _noted.forced = False
        self._previous = signal.signal(signal.SIGINT, _note)
        self._owner = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._owner:
            return
        signal.signal(signal.SIGINT, self._previous)  # from here a SIGINT raises at once, as it would
        pending, _noted.pending = _noted.pending, False
        if pending and exc_type is None:  # an exception on its way out already ends the call
            if self._hold:
                self.held = True
                return
            raise KeyboardInterrupt
