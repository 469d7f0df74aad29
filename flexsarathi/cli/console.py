"""What the command line prints besides its results: report lines on stdout that survive a reader
who stops early (`| head`), stderr (progress bars, warnings, error lines) that goes quiet when its
reader is gone instead of ending the job, and warnings from the engine and its I/O threads (a
damaged offload store rebuilt, direct I/O refused) as one `warning: ...` line on stderr, above a
progress bar."""
from __future__ import annotations

import contextlib
import os
import select
import sys
import warnings


def say(text: str) -> None:
    """Print a line of a command's report to stdout. A reader that closed it (`... | head -1`) is
    no error, as for Unix tools: the rest of the report goes nowhere and the work goes on."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        silence_stdout()


def silence_stdout() -> None:
    """stdout's reader is gone: point it at /dev/null, so that later prints and the interpreter's
    flush at exit write nowhere instead of raising BrokenPipeError."""
    _to_devnull(sys.stdout.fileno())


class _QuietWhenGone:
    """A text stream that, once its reader is gone (a write raises BrokenPipeError: `2>&1 | head
    -1`), points its file descriptor at /dev/null and writes nowhere from then on: a progress bar
    or a message must never end the job. Everything else is the wrapped stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._go_quiet()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._go_quiet()

    def _go_quiet(self) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            _to_devnull(self._stream.fileno())
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what the failed write left buffered goes to /dev/null now

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _to_devnull(fd: int) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)  # the lowest free descriptor: `fd` itself when it is closed
    if devnull != fd:
        os.dup2(devnull, fd)
        os.close(devnull)


@contextlib.contextmanager
def quiet_stderr_when_gone():
    """For a command's run: sys.stderr goes quiet when its reader is gone instead of raising. A
    closed stdout or stderr (`2>&-`) is opened on /dev/null first: else the first file the command
    opens would get its descriptor, and whatever a library prints there would land in that file."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            _to_devnull(fd)
            setattr(sys, name, open(fd, "w", closefd=False))  # noqa: SIM115 - for the process's life
    saved = sys.stderr
    sys.stderr = _QuietWhenGone(saved)
    try:
        yield
    finally:
        sys.stderr = saved


def stdout_is_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)  # POLLERR is always reported
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout, or not a file
        return False


def show_warnings_as_lines() -> None:
    """Every warning shown from now on is one `warning: MESSAGE` line on stderr, written above any
    tqdm bar (not into it), without Python's file, line and category: they name a library's
    thread, not anything the user can act on."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        from tqdm import tqdm

        tqdm.write(f"warning: {' '.join(str(message).split())}", file=sys.stderr)

    warnings.showwarning = show
