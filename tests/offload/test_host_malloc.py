"""offload/host_malloc.py: with the policy applied, passes on the CPU reuse the memory earlier
passes freed instead of faulting in fresh pages.

Each case runs in a fresh interpreter: the policy is process-wide and applied once."""
import os
import subprocess
import sys
import textwrap

import pytest

from offload.host_malloc import _glibc

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the policy changes, read from glibc's own statistics (mallinfo2): whether an activation-sized
# tensor (8 MiB) is a separate mapping (hblkhd: bytes in mmapped blocks) that is unmapped again on
# free, or a heap block (arena: bytes of the heap) that stays in the heap once freed, for the next
# layer to reuse without faulting in fresh pages. The first allocation of the process is the one
# measured, the same in both cases. Prints: state, mmapped bytes while it lives, heap bytes while it
# lives, heap bytes after it is freed.
PROGRAM = textwrap.dedent("""
    import ctypes
    import torch
    from offload.host_malloc import host_malloc_state, keep_freed_host_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                    "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    keep_freed_host_memory()
    base = libc.mallinfo2()
    x = torch.ones(4 << 20, dtype=torch.bfloat16)  # 8 MiB, touched
    alive = libc.mallinfo2()
    del x
    freed = libc.mallinfo2()
    print(host_malloc_state(), alive.hblkhd - base.hblkhd, alive.arena, freed.arena)
""")


def run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "FLEXSARATHI_HOST_MALLOC"}
    if env_value is not None:
        env["FLEXSARATHI_HOST_MALLOC"] = env_value
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    state, mapped, heap_alive, heap_freed = out.stdout.split()
    return state, int(mapped), int(heap_alive), int(heap_freed)


def _has_mallinfo2() -> bool:
    libc = _glibc()
    return libc is not None and hasattr(libc, "mallinfo2")


@pytest.mark.skipif(not _has_mallinfo2(), reason="the policy is glibc's mallopt (mallinfo2: glibc >= 2.33); "
                    "this C library is not one")
def test_activation_sized_tensors_stay_in_the_heap():
    MiB = 1 << 20
    state, mapped, heap_alive, heap_freed = run(None)
    assert state == "applied"
    assert mapped == 0, f"the 8 MiB tensor was a separate {mapped}-byte mapping"
    assert heap_alive >= 8 * MiB
    assert heap_freed == heap_alive, "the heap was trimmed when the tensor was freed"
    # glibc's defaults: the same tensor is its own mapping (unmapped on free: the next one faults)
    state, mapped, _, _ = run("default")
    assert state == "disabled"
    assert mapped >= 8 * MiB


def test_bad_setting_is_one_clear_error():
    env = dict(os.environ, FLEXSARATHI_HOST_MALLOC="fast", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", "from offload.host_malloc import keep_freed_host_memory as k; k()"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "FLEXSARATHI_HOST_MALLOC='fast'" in out.stderr and "'reuse'" in out.stderr


@pytest.mark.skipif(_glibc() is None, reason="the policy is glibc's mallopt; this C library is not glibc")
def test_a_pass_on_the_cpu_applies_the_policy(tiny_checkpoint):
    env = {k: v for k, v in os.environ.items() if k != "FLEXSARATHI_HOST_MALLOC"}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    program = textwrap.dedent("""
        import sys
        from flexsarathi import LLM, SamplingParams
        from offload.host_malloc import host_malloc_state
        llm = LLM(sys.argv[1], device="cpu")
        before = host_malloc_state()
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        print(before, host_malloc_state())
    """)
    out = subprocess.run([sys.executable, "-c", program, tiny_checkpoint("opt")[0]], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["untouched", "applied"]
