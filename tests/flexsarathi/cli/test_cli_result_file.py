"""`flexsarathi generate`'s result file as users damage it: two jobs on one output (real processes),
a holder killed with -9, duplicate records, a damaged line in the middle or at the end, the input
given as the output, byte-order marks. The reference is always the uninterrupted run of the same
command (itself checked against `LLM.generate` in test_cli_generate.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from flexsarathi.cli.main import main
from tests.conftest import REPO
from tests.flexsarathi.cli.test_cli_generate import GREEDY, cli, records, write_lines

PROMPTS = [f"Once upon a time, number {i}" for i in range(12)]


@pytest.fixture(scope="module")
def reference(stories_dir, tmp_path_factory):
    """(the generate arguments without --output, the uninterrupted run's output file)."""
    tmp = tmp_path_factory.mktemp("reference")
    src = write_lines(tmp / "in.txt", PROMPTS)
    args = ["generate", "--model", stories_dir, "--input", src, *GREEDY]
    full = tmp / "full.jsonl"
    cli(*args, "--output", str(full), check_rc=0)
    assert len(records(full)) == len(PROMPTS)
    return args, full


def copy_result(full, path, data: bytes | None = None) -> str:
    """A result file of the reference job at `path` (its meta too), holding `data` (default: all)."""
    path.write_bytes(full.read_bytes() if data is None else data)
    shutil.copy(str(full) + ".meta.json", str(path) + ".meta.json")
    return str(path)


def by_id(path) -> dict:
    got = records(path)
    assert len({r["id"] for r in got}) == len(got), "a duplicate id"
    return {r["id"]: r for r in got}


def _start(args: list[str]) -> subprocess.Popen:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "flexsarathi", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_lock(proc: subprocess.Popen, lock: str) -> None:
    """Until `proc` has written its pid into the lock file (it holds the lock from before then)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with open(lock) as f:
                if f.read().strip() == str(proc.pid):
                    return
        except FileNotFoundError:
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("the job never took the lock")


def _refused_while_first_holds(args: list[str], held: str, output: str) -> None:
    """A job writing `held`, stopped while it holds its lock (for as long as a second job takes to
    start): the second job, on `output`, fails at once naming `output`, the first job's pid and
    `held`'s lock; the first, resumed, ends as if alone."""
    first = _start([*args, "--output", held])
    _wait_for_lock(first, held + ".lock")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = cli(*args, "--output", output, check_rc=2)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.stderr.splitlines() == [
        f"error: --output {output} is being written by another job (pid {first.pid}, holding {held}.lock); "
        "wait for it to end or give another --output"]
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err


def test_two_jobs_on_one_output_then_a_rerun(reference, tmp_path):
    """The second job started while the first holds the output fails at once, naming the file and
    the first job's pid; the first ends as if alone; a rerun has nothing to do."""
    args, full = reference
    out = str(tmp_path / "o.jsonl")
    _refused_while_first_holds(args, out, out)
    assert by_id(out) == by_id(full)
    assert not os.path.exists(out + ".lock")  # removed by the holder as it ended
    rerun = cli(*[a for a in args if a != "--quiet"], "--output", out, check_rc=0)
    assert f"12 already in {out}, 0 to run" in rerun.stdout
    assert by_id(out) == by_id(full)


def test_two_names_of_one_output_are_one_output(reference, tmp_path):
    """A symbolic link to the output is the output: its lock (and meta.json) are the real file's, so a
    job through the link is refused while one writes the file (both used to run and write every
    record twice), and a rerun through the link resumes the file."""
    args, full = reference
    out, link = str(tmp_path / "o.jsonl"), str(tmp_path / "link.jsonl")
    (tmp_path / "o.jsonl").touch()
    os.symlink(out, link)
    _refused_while_first_holds(args, out, link)
    assert by_id(out) == by_id(full) and os.path.islink(link)
    rerun = cli(*[a for a in args if a != "--quiet"], "--output", link, check_rc=0)
    assert f"12 already in {link}, 0 to run" in rerun.stdout
    assert not os.path.exists(link + ".meta.json") and not os.path.exists(link + ".lock")


def test_a_lock_holder_killed_with_sigkill_releases_the_lock(reference, tmp_path):
    args, full = reference
    out = str(tmp_path / "o.jsonl")
    holder = _start([*args, "--output", out])
    _wait_for_lock(holder, out + ".lock")
    os.kill(holder.pid, signal.SIGKILL)
    holder.communicate(timeout=60)
    assert os.path.exists(out + ".lock")  # the file stays behind; the kernel dropped its lock
    cli(*args, "--output", out, check_rc=0)
    assert by_id(out) == by_id(full)


def test_a_rerun_keeps_one_record_per_id(reference, tmp_path, capsys):
    """Duplicates written before the lock existed (or a file concatenated by hand): the rerun keeps
    the first record of each id and moves the others to OUTPUT.rejected, losing no byte."""
    args, full = reference
    data = full.read_bytes()
    lines = data.splitlines(keepends=True)
    out = copy_result(full, tmp_path / "o.jsonl", data + lines[3] + lines[0])
    assert main([*[a for a in args if a != "--quiet"], "--output", out]) == 0
    assert "(2 damaged or duplicate lines moved to" in capsys.readouterr().out
    assert (tmp_path / "o.jsonl").read_bytes() == data
    assert (tmp_path / "o.jsonl.rejected").read_bytes() == lines[3] + lines[0]


def test_a_damaged_middle_line_is_refused_and_repair_keeps_the_good_records(reference, tmp_path, capsys):
    args, full = reference
    lines = full.read_bytes().splitlines(keepends=True)
    damaged = b'{"id": 4, "prompt": "Once up\n'
    data = b"".join(lines[:3]) + damaged + b"".join(lines[4:])
    out = copy_result(full, tmp_path / "o.jsonl", data)
    assert main([*args, "--output", out]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: --output {out} line 4 is not a record of this job; rerun with --repair to move the "
                   f"damaged lines to {out}.rejected and redo their requests, keeping its 11 good records, or "
                   "--overwrite to start afresh"]
    assert (tmp_path / "o.jsonl").read_bytes() == data  # refused: nothing touched
    assert main([*args, "--output", out, "--repair"]) == 0
    assert by_id(out) == by_id(full)  # the damaged line's request redone, the others kept
    assert records(out)[:3] == records(full)[:3]
    assert (tmp_path / "o.jsonl.rejected").read_bytes() == damaged


def test_a_damaged_last_line_with_its_newline_is_redone(reference, tmp_path, capsys):
    """A last line cut short by a crash after its newline made it out (or by a process that wrote
    the newline separately): treated as torn, as one without a newline is, not refused."""
    args, full = reference
    lines = full.read_bytes().splitlines(keepends=True)
    out = copy_result(full, tmp_path / "o.jsonl", b"".join(lines[:-1]) + lines[-1][:20] + b"\n")
    assert main([*[a for a in args if a != "--quiet"], "--output", out]) == 0
    assert "11 already in" in capsys.readouterr().out
    assert by_id(out) == by_id(full)
    assert not (tmp_path / "o.jsonl.rejected").exists()


def test_the_input_is_never_the_output(reference, tmp_path, capsys):
    """Same path, a hard link, a symbolic link: refused before anything is opened for writing."""
    args, _ = reference
    src = write_lines(tmp_path / "in.txt", PROMPTS[:2])
    os.link(src, tmp_path / "hard.txt")
    os.symlink(src, tmp_path / "soft.txt")
    before = (tmp_path / "in.txt").read_bytes()
    model = args[args.index("--model") + 1]
    for output in (src, str(tmp_path / "hard.txt"), str(tmp_path / "soft.txt")):
        assert main(["generate", "--model", model, "--input", src, "--output", output, "--overwrite"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: --output {output} is the --input file {src}: results would replace the requests; "
            "give another --output"]
        assert (tmp_path / "in.txt").read_bytes() == before
        assert not os.path.exists(output + ".meta.json") and not os.path.exists(output + ".lock")


@pytest.mark.parametrize("fmt", ["text", "jsonl", "openai"])
def test_a_byte_order_mark_is_no_part_of_the_input(reference, tmp_path, fmt):
    """What Windows tools and Excel write: detection sees the first real character and the first
    request is the same as without the mark."""
    args, _ = reference
    model = args[args.index("--model") + 1]
    lines = {"text": PROMPTS[:2],
             "jsonl": [json.dumps({"id": i, "prompt": p}) for i, p in enumerate(PROMPTS[:2])],
             "openai": [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": p}}) for i, p in enumerate(PROMPTS[:2])]}[fmt]
    outputs = []
    for name, mark in (("plain", ""), ("bom", "\ufeff")):
        src = tmp_path / f"{name}.in"
        src.write_text(mark + "\n".join(lines) + "\n", encoding="utf-8")
        out = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--model", model, "--input", str(src), "--output", str(out), *GREEDY]) == 0
        assert json.loads((tmp_path / f"{name}.jsonl.meta.json").read_text())["format"] == fmt
        outputs.append(sorted(records(out), key=lambda r: str(r.get("id"))))
    plain, bom = outputs
    if fmt == "openai":  # the created time may differ by a second
        for r in plain + bom:
            r["response"]["body"].pop("created")
    assert bom == plain
    if fmt == "text":
        assert bom[0]["prompt"] == PROMPTS[0]


def test_a_rerun_of_error_records_says_why_it_exits_1(stories_dir, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x", "temperature": -1}, "{not json"])
    out = str(tmp_path / "o.jsonl")
    argv = ["generate", "--model", stories_dir, "--input", src, "--output", out, "--max-tokens", "2"]
    first = cli(*argv, check_rc=1)
    assert f"done: 0 ok, 2 failed -> {out}" in first.stdout
    rerun = cli(*argv, check_rc=1)
    assert f"done: 0 ok, 0 failed; the file also holds 2 error records of earlier runs -> {out}" in rerun.stdout


def test_a_hard_link_to_an_output_being_written_is_refused(tmp_path):
    """A hard link names the same file under another path, whose lock file is another: the second
    writer is refused by the lock on the file itself (both used to append, interleaving records),
    its own lock released; once the first has closed, the link's job runs."""
    from flexsarathi.cli.result_file import ResultFile
    from flexsarathi.errors import FlexSarathiError

    out, hard = tmp_path / "o.jsonl", tmp_path / "hard.jsonl"
    out.touch()
    os.link(out, hard)
    meta = {"model": "m"}
    first = ResultFile(str(out), "jsonl", meta)
    try:
        with pytest.raises(FlexSarathiError, match=rf"^--output {hard} is being written by another job under "
                                                   r"another name \(a hard link to the same file\)"):
            ResultFile(str(hard), "jsonl", meta)
        assert not os.path.exists(f"{hard}.lock")  # released
        first.append({"id": "a", "text": "x"})
    finally:
        first.close()
    second = ResultFile(str(hard), "jsonl", meta)
    assert len(second.done) == 1  # the first job's record, resumed through the link
    second.close()
