"""Run by tests/offload/test_faults.py in a child process: SIGINT at lines drawn at random over a
whole generate, each followed by a generate that must give a fresh engine's tokens. A child, so
that a hang (a lock left held) ends in a dump of every thread's stack that the test shows, not in
a test run that never returns.

    python tests/offload/ctrl_c_at_lines.py OFFLOAD_DIR TRIALS_PER_KIND SEED
"""
from __future__ import annotations

import _thread
import faulthandler
import os
import random
import signal
import sys

from flexsarathi import LLM, SamplingParams
from policy_search.policy import Policy

ON_DISK = Policy(w_gpu=0.0, w_cpu=0.0, w_disk=1.0, overlap=True)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 3]
# Lines of any file, then lines of the threading module: the locks the thread pools take, where a
# KeyboardInterrupt raised just after an acquire leaves the lock held.
KINDS = (os.sep, f"{os.sep}threading.py")


def traced(call, where: str, at_line: int = 0) -> int:
    """Run call() counting the main thread's Python lines in files whose path holds `where`;
    SIGINT as the at_line-th one is reached (Python runs the handler at its next check, which may
    fall after a C call inside that line: a lock's acquire). Returns the count."""
    count = [0]

    def tracer(frame, event, arg):
        if event == "line" and where in frame.f_code.co_filename:
            count[0] += 1
            if count[0] == at_line:
                _thread.interrupt_main()
        return tracer

    sys.settrace(tracer)
    try:
        call()
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return count[0]


def main(folder: str, trials: int, seed: int) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with LLM("dummy:opt-125m-4l", dtype="float32", policy=ON_DISK, offload_dir=folder) as fresh:
        reference = [o.token_ids for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]
    rng, failures = random.Random(seed), 0
    with LLM("dummy:opt-125m-4l", dtype="float32", policy=ON_DISK, offload_dir=folder) as llm:
        def generate():
            return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]

        for where in KINDS:
            total = traced(generate, where)
            for n in sorted(rng.sample(range(1, total), trials)):
                faulthandler.dump_traceback_later(120, exit=True)  # a hang: every thread's stack, exit 1
                traced(generate, where, n)
                tokens = generate()
                faulthandler.cancel_dump_traceback_later()
                handler_back = signal.getsignal(signal.SIGINT) is signal.default_int_handler
                ok = tokens == reference and handler_back
                failures += not ok
                print(f"{'ok' if ok else 'WRONG'}: SIGINT at line {n} of {total} in {where!r}"
                      + ("" if ok else f": {tokens} != {reference}, handler back: {handler_back}"), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
