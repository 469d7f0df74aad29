"""The background thread that runs the server's batches: one after another, oldest first, each to
its end (completed, cancelled or failed). The HTTP side never waits on it: it adds batches to the
store and wakes the thread, and reads their counts as requests finish.

Statuses it moves a batch through (OpenAI's): in_progress -> finalizing -> completed; cancelling ->
cancelled (a cancel stops the running batch at its next pass boundary); failed (the input file or
the engine failed: the finished records are still split into the output and error files). After a
restart the batch that was running resumes where its result file ends, and a batch caught
finalizing or cancelling is finished.

A full disk (ENOSPC, EDQUOT) anywhere in a batch's step pauses the batch instead of failing it:
failing would need files written too, and a batch failed without its output files hides results
that were finished. Its status stays as the store has it (in_progress, finalizing or cancelling),
its finished records stay in its result file (a record torn by the full disk is cut off and its
request redone), and it is taken up again where it stopped: when a file is deleted (space freed
through the API), every DISK_RETRY_S, or on the next start. The other batches go on meanwhile.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback

from flexsarathi.errors import FlexSarathiError
from flexsarathi.serve.batch_job import InputFileError, ServeEngine, finalize, run_batch
from flexsarathi.serve.schemas import FINAL_STATUSES, Batch, BatchError, BatchErrors
from flexsarathi.serve.store import Store, disk_full


class BatchRunner:
    DISK_RETRY_S = 60.0  # a batch a full disk paused is tried again after this long (or a file's deletion)

    def __init__(self, store: Store, engine: ServeEngine, log=None):
        self.store, self.engine = store, engine
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._claimed: set[str] = set()  # batches someone is working on (under store.lock)
        self._paused: dict[str, float] = {}  # batch -> when a full disk paused it (claimed meanwhile; store.lock)
        self._thread = threading.Thread(target=self._loop, name="flexsarathi-batches", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """A batch was added: look for work."""
        self._wake.set()

    def request_stop(self) -> None:
        """Stop at the running batch's next pass boundary (it stays in_progress and resumes on the
        next start); returns at once."""
        self._stopping.set()
        self._wake.set()

    def shutdown(self, timeout: float | None = None) -> None:
        """request_stop, then wait for the thread."""
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def retry_paused(self) -> None:
        """Space was freed (a file deleted): the batches a full disk paused are taken up again now."""
        self._unpause(lambda since: True)
        self._wake.set()

    def _unpause(self, due) -> None:
        """Release the paused batches for which due(when it paused) is true: the thread takes them up."""
        with self.store.lock:
            for batch_id, since in list(self._paused.items()):
                if due(since):
                    del self._paused[batch_id]
                    self._claimed.discard(batch_id)

    def cancel(self, batch_id: str) -> Batch:
        """Cancel a batch that has not ended. The running one is marked cancelling and stopped at
        its next pass boundary by the thread; one still waiting is cancelled here at once."""
        with self.store.lock:
            batch = self.store.get_batch(batch_id)
            if batch.status in FINAL_STATUSES or batch.status == "cancelling":
                return batch
            running, paused = batch_id in self._claimed, batch_id in self._paused
            batch = self.store.update_batch(batch_id, status="cancelling")  # a full disk: 507, nothing claimed
            self._claimed.add(batch_id)
        if paused:  # the thread finishes it cancelled, now, as space allows
            self.retry_paused()
        if running:
            return batch
        try:
            return finalize(self.engine, self.store, batch_id, "cancelled")
        finally:
            self._release(batch_id)
            self._wake.set()  # where finalize failed (a full disk), the thread finishes it

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before looking: a batch added after the look sets it again
            self._unpause(lambda since: time.monotonic() - since >= self.DISK_RETRY_S)
            batch = self._claim_next()
            if batch is None:
                self._wake.wait(self.DISK_RETRY_S if self._paused else None)
                continue
            if self._advanced(batch):
                self._release(batch.id)

    def _advanced(self, batch: Batch) -> bool:
        """_advance; False where the batch stays claimed: a full disk paused it (see the module's
        docstring), or its end could not be recorded (another store failure): that one stays as the
        store has it until the server restarts. Either way the thread goes on with the others."""
        try:
            self._advance(batch)
        except Exception as exc:  # noqa: BLE001 - the runner thread must outlive one batch's store failure
            full = disk_full(exc)
            if full is not None:
                with self.store.lock:
                    self._paused[batch.id] = time.monotonic()
                self.log(f"batch {batch.id}: paused: the server's disk is full ({full.strerror or full}); its "
                         f"finished records are kept, and it goes on when a file is deleted, in "
                         f"{self.DISK_RETRY_S:.0f} s, or on the next start")
                return False
            traceback.print_exc()
            self.log(f"batch {batch.id}: its end could not be recorded (the traceback above); it stays as it "
                     "is until the server restarts, and the other batches run")
            return False
        return True

    def _claim_next(self) -> Batch | None:
        with self.store.lock:
            batch = self.store.next_batch(skip=self._claimed)
            if batch is not None:
                self._claimed.add(batch.id)
            return batch

    def _release(self, batch_id: str) -> None:
        with self.store.lock:
            self._claimed.discard(batch_id)

    def _cancelling(self, batch_id: str) -> bool:
        return self.store.get_batch(batch_id).status == "cancelling"

    def _advance(self, batch: Batch) -> None:
        """Take the batch one step to its end, whatever status it is found in; a failure fails it,
        but a full disk is raised on (_advanced pauses the batch)."""
        try:
            self._run_to_end(batch)
        except Exception as exc:  # noqa: BLE001 - a bug fails this batch, not the server
            if disk_full(exc) is not None:
                raise
            if isinstance(exc, InputFileError):
                errors = exc.errors
            elif isinstance(exc, FlexSarathiError):
                errors = [BatchError(code="batch_failed", message=str(exc))]
            else:
                traceback.print_exc()
                errors = [BatchError(code="server_error", message=f"unexpected {type(exc).__name__}: {exc} "
                                     "(a bug: please report the server's traceback)")]
            self._fail(batch.id, errors)

    def _run_to_end(self, batch: Batch) -> None:
        if batch.status == "in_progress":
            self.log(f"batch {batch.id}: running {batch.request_counts.total} requests")
            finished = run_batch(self.engine, self.store, batch,
                                 stop=lambda: self._stopping.is_set() or self._cancelling(batch.id))
            if not finished and not self._cancelling(batch.id):
                if self._stopping.is_set():
                    return  # the server is stopping: resumed on the next start
                raise FlexSarathiError("the engine ended the batch before every request finished")
        if self._cancelling(batch.id):
            finalize(self.engine, self.store, batch.id, "cancelled")
        else:
            self.store.update_batch(batch.id, status="finalizing")
            finalize(self.engine, self.store, batch.id, "completed")
        self.log(f"batch {batch.id}: {self.store.get_batch(batch.id).status}")

    def _fail(self, batch_id: str, errors: list[BatchError]) -> None:
        """Fail the batch, its finished records split into its files; a full disk is raised on (the
        batch is paused, not failed without the files that hold its results)."""
        try:
            finalize(self.engine, self.store, batch_id, "failed", errors)
        except (FlexSarathiError, OSError, ValueError) as exc:  # records unreadable: it fails without files
            if disk_full(exc) is not None:
                raise
            self.store.update_batch(batch_id, status="failed", errors=BatchErrors(data=errors))
        self.log(f"batch {batch_id}: failed: {errors[0].message}")
