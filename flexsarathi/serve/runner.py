"""The background thread that runs the server's batches: one after another, oldest first, each to
its end (completed, cancelled or failed). The HTTP side never waits on it: it adds batches to the
store and wakes the thread, and reads their counts as requests finish.

Statuses it moves a batch through (OpenAI's): in_progress -> finalizing -> completed; cancelling ->
cancelled (a cancel stops the running batch at its next pass boundary); failed (the input file or
the engine failed: the finished records are still split into the output and error files). After a
restart the batch that was running resumes where its result file ends, and a batch caught
finalizing or cancelling is finished.
"""
from __future__ import annotations

import sys
import threading
import traceback

from flexsarathi.errors import FlexSarathiError
from flexsarathi.serve.batch_job import InputFileError, ServeEngine, finalize, run_batch
from flexsarathi.serve.schemas import FINAL_STATUSES, Batch, BatchError, BatchErrors
from flexsarathi.serve.store import Store


class BatchRunner:
    def __init__(self, store: Store, engine: ServeEngine, log=None):
        self.store, self.engine = store, engine
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._claimed: set[str] = set()  # batches someone is working on (under store.lock)
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

    def cancel(self, batch_id: str) -> Batch:
        """Cancel a batch that has not ended. The running one is marked cancelling and stopped at
        its next pass boundary by the thread; one still waiting is cancelled here at once."""
        with self.store.lock:
            batch = self.store.get_batch(batch_id)
            if batch.status in FINAL_STATUSES or batch.status == "cancelling":
                return batch
            running = batch_id in self._claimed
            self._claimed.add(batch_id)
            batch = self.store.update_batch(batch_id, status="cancelling")
        if running:
            return batch
        try:
            return finalize(self.engine, self.store, batch_id, "cancelled")
        finally:
            self._release(batch_id)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before looking: a batch added after the look sets it again
            batch = self._claim_next()
            if batch is None:
                self._wake.wait()
                continue
            if self._advanced(batch):
                self._release(batch.id)

    def _advanced(self, batch: Batch) -> bool:
        """_advance; False where even the batch's end could not be recorded (its store write failed:
        a full disk, say). That batch stays as the store has it, claimed, so this process does not
        pick it again at once (the next start does); the thread goes on with the others."""
        try:
            self._advance(batch)
        except Exception:  # noqa: BLE001 - the runner thread must outlive one batch's store failure
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
        """Take the batch one step to its end, whatever status it is found in."""
        try:
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
        except InputFileError as exc:
            self._fail(batch.id, exc.errors)
        except FlexSarathiError as exc:
            self._fail(batch.id, [BatchError(code="batch_failed", message=str(exc))])
        except Exception as exc:  # noqa: BLE001 - a bug fails this batch, not the server
            traceback.print_exc()
            self._fail(batch.id, [BatchError(code="server_error", message=f"unexpected {type(exc).__name__}: "
                                             f"{exc} (a bug: please report the server's traceback)")])

    def _fail(self, batch_id: str, errors: list[BatchError]) -> None:
        self.log(f"batch {batch_id}: failed: {errors[0].message}")
        try:
            finalize(self.engine, self.store, batch_id, "failed", errors)
        except (FlexSarathiError, OSError, ValueError):  # records unreadable: the batch fails without files
            self.store.update_batch(batch_id, status="failed", errors=BatchErrors(data=errors))
