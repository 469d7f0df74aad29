"""What the command line prints besides its results: report lines on stdout that survive a reader
who stops early (`| head`), and warnings from the engine and its I/O threads (a damaged offload
store rebuilt, direct I/O refused) as one `warning: ...` line on stderr, above a progress bar."""
from __future__ import annotations

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
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


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
