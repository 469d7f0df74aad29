"""offload/interrupts.py: SIGINT noted inside the deferral and raised only where asked (the
engine-level behaviour is in test_faults.py). Signals are real: signal.raise_signal delivers SIGINT
to this process, and its Python handler runs in the main thread before the call returns."""
import signal
import threading

import pytest

from offload.interrupts import DeferredInterrupts, raise_if_interrupted


pytestmark = pytest.mark.usefixtures("python_sigint")  # Python's own handler in each test

def test_a_noted_sigint_is_raised_at_the_next_checkpoint_only():
    with DeferredInterrupts() as deferral:
        signal.raise_signal(signal.SIGINT)  # noted, not raised
        reached = True
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
        raise_if_interrupted()  # taken once
    assert reached and not deferral.forced
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_not_taken_inside_is_raised_as_the_block_ends():
    after = []
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupts():
            signal.raise_signal(signal.SIGINT)
            after.append("the block ran on")
    assert after == ["the block ran on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    raise_if_interrupted()  # nothing is left pending


def test_a_holding_block_keeps_a_sigint_not_taken_inside_for_its_caller():
    """hold=True: the block ends without raising and says so in `held` (the engine hands a finished
    step's sequences over first); a SIGINT taken inside, or none, leaves held False."""
    with DeferredInterrupts(hold=True) as deferral:
        signal.raise_signal(signal.SIGINT)
    assert deferral.held
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    raise_if_interrupted()  # nothing is left pending
    with DeferredInterrupts(hold=True) as taken:
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    with DeferredInterrupts(hold=True) as quiet:
        pass
    assert not taken.held and not quiet.held


def test_a_second_sigint_before_the_first_is_taken_is_raised_at_once_and_forced():
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupts() as deferral:
            signal.raise_signal(signal.SIGINT)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                assert deferral.forced
                raise
            pytest.fail("the second SIGINT was not raised")
    with DeferredInterrupts() as deferral:  # each deferral starts unforced
        assert not deferral.forced


def test_an_exception_leaving_the_block_is_not_replaced_by_the_noted_sigint():
    with pytest.raises(ValueError):
        with DeferredInterrupts():
            signal.raise_signal(signal.SIGINT)
            raise ValueError("the block's own error")
    raise_if_interrupted()  # and the noted one is dropped with it


def test_an_inner_deferral_leaves_the_outer_one_in_charge():
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupts():
            with DeferredInterrupts():
                signal.raise_signal(signal.SIGINT)
            # the inner block ended without raising: the outer one still holds the SIGINT
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_applications_own_handler_is_left_as_it_is():
    calls = []
    signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    with DeferredInterrupts():
        signal.raise_signal(signal.SIGINT)
        raise_if_interrupted()  # nothing noted: the application's handler had it
    assert calls == [signal.SIGINT]


def test_off_the_main_thread_the_deferral_does_nothing():
    errors = []

    def body():
        try:
            with DeferredInterrupts() as deferral:  # signal.signal would raise ValueError here
                assert not deferral.forced
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert errors == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_as_the_handler_goes_back_leaves_later_deferrals_working(monkeypatch):
    """SIGINT in the instant after the block's end puts Python's handler back (found by sending
    SIGINT at random lines of a generate): it raises there, as outside any deferral, and the next
    deferral still defers (a flag set back one statement later stayed set, and every later deferral
    took itself for nested and did nothing)."""
    real_signal = signal.signal

    def handler_back_then_sigint(signum, handler):
        previous = real_signal(signum, handler)
        if handler is signal.default_int_handler:
            signal.raise_signal(signal.SIGINT)  # Python's own handler: KeyboardInterrupt right here
        return previous

    monkeypatch.setattr(signal, "signal", handler_back_then_sigint)
    with pytest.raises(KeyboardInterrupt):
        with DeferredInterrupts():
            pass
    monkeypatch.setattr(signal, "signal", real_signal)
    raise_if_interrupted()  # outside any deferral: nothing is raised, whatever was left
    with DeferredInterrupts():
        signal.raise_signal(signal.SIGINT)  # noted, not raised (KeyboardInterrupt here fails the test)
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
