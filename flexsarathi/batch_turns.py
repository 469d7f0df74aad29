"""One batch at a time on an LLM's engine: whose turn it is.

A generate from another thread waits until the running one ends (a server's worker threads take
turns; Ctrl-C still stops the wait); one from the thread whose generate_iter is still being iterated
(not run to its end, nor closed) would wait on itself forever, and is refused.

A turn is held by a ticket that only the holding generate_iter's frame references. Its end gives
the turn back; a Ctrl-C can land anywhere in that Python code, before the give-back too, and a
turn left taken would stop every later generate for good. So a turn whose ticket is gone (its
generate_iter ended, whatever way) counts as free: nothing can leave the engine held.

close() from another thread waits for a running generate's pass, but not for a generate_iter
suspended at a yield: its caller may never resume it (an abandoned iterator that something still
references), and close() would wait forever. It takes such a turn over (turn(take_suspended=True)),
and the iterator, when resumed, first waits for that close() to finish (suspended()).
"""
from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Iterator

from flexsarathi.errors import FlexSarathiError
from offload.interrupts import DeferredInterrupts, raise_if_interrupted


class _Ticket:
    __slots__ = ("__weakref__", "suspended", "closer")

    def __init__(self) -> None:
        self.suspended = False  # its generate_iter is at a yield, its caller holding it
        self.closer: weakref.ref | None = None  # the ticket of the close() that took this turn over


class BatchTurns:
    def __init__(self) -> None:
        self._mutex = threading.Lock()  # C-level: `with` gives it back on any exception
        self._holder: tuple[int, weakref.ref] | None = None  # (thread, the holding turn's ticket)
        self._given_back = queue.SimpleQueue()  # wakes a waiter at once (C-level put and get)

    def held_here(self) -> bool:
        """Whether this thread holds the turn (inside its own generate_iter)."""
        holder = self._holder
        return holder is not None and holder[0] == threading.get_ident() and holder[1]() is not None

    def _try_take(self, ticket: _Ticket, take_suspended: bool) -> bool:
        me = threading.get_ident()
        with self._mutex:
            holder = self._holder
            held = holder[1]() if holder is not None else None
            if held is None:  # free, or its holder ended without giving it back
                self._holder = (me, weakref.ref(ticket))
                return True
            if holder[0] == me:
                raise FlexSarathiError("this LLM's previous generate_iter in this thread is still being "
                                       "iterated: run it to its end or close() it before the next generate")
            if take_suspended and held.suspended:
                held.closer = weakref.ref(ticket)
                self._holder = (me, weakref.ref(ticket))
                return True
            return False

    def _give_back(self, ticket: _Ticket) -> None:
        with self._mutex:
            if self._holder is not None and self._holder[1]() is ticket:
                self._holder = None
        if self._given_back.empty():  # at most a stale wake-up or two left behind, not one per turn
            self._given_back.put(None)

    @contextlib.contextmanager
    def turn(self, take_suspended: bool = False) -> Iterator[None]:
        """Wait for the turn (Ctrl-C is taken while waiting), hold it inside the block.
        take_suspended: also take it from a holder suspended at a yield (close() does)."""
        ticket = _Ticket()
        with DeferredInterrupts():
            while not self._try_take(ticket, take_suspended):
                raise_if_interrupted()
                try:  # a turn given back wakes one waiter; one whose holder ended without it, the timeout
                    self._given_back.get(timeout=0.05)
                except queue.Empty:
                    pass
        try:
            yield
        finally:
            self._give_back(ticket)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Around a yield of the generate_iter holding the turn in this thread: meanwhile a close()
        from another thread may take the turn over; on resuming, this waits until that close() has
        given it back (the engine is closed then; the generate_iter's next engine call says so). A
        thread that does not hold the turn (taken over already) marks nothing."""
        me = threading.get_ident()
        with self._mutex:
            holder = self._holder
            ticket = holder[1]() if holder is not None and holder[0] == me else None
            if ticket is not None:
                ticket.suspended = True
        try:
            yield
        finally:
            if ticket is not None:
                self._resume(ticket)

    def _resume(self, ticket: _Ticket) -> None:
        while True:
            with self._mutex:
                if ticket.closer is None:  # not taken over: running again, close() waits for it
                    ticket.suspended = False
                    return
                holder = self._holder
                if holder is None or holder[1]() is None or holder[1]() is not ticket.closer():
                    return  # the close() that took it over has given it back
            try:
                self._given_back.get(timeout=0.05)
            except queue.Empty:
                pass
