"""Checks the command line makes on files and folders BEFORE any long work, so bad paths end in
one clear `error: ...` line (flexsarathi/cli/main.py's main) and not in a traceback after a search or a
measurement."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from flexsarathi.errors import FlexSarathiError


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def gib(text: str) -> float:
    """argparse type: a memory size in GiB, a finite number >= 0 (a tier may be given none)."""
    return _gib(text, positive=False)


def positive_gib(text: str) -> float:
    """argparse type: a memory size in GiB, a finite number > 0 (the compute device's)."""
    return _gib(text, positive=True)


def _gib(text: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB {'>' if positive else '>='} 0, got {text}")
    return value


def check_output_file(path: str, flag: str) -> None:
    """`path` can be created or overwritten: its folder exists and is writable, it is no folder."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise FlexSarathiError(f"{flag} {path} is a folder; give a file name")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise FlexSarathiError(f"{flag} {path}: {folder} {what}")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise FlexSarathiError(f"{flag} {path} is not writable")


def check_folder(path: str, flag: str) -> None:
    """`path` is (or can be made) a writable folder."""
    if os.path.exists(path) and not os.path.isdir(path):  # makedirs would say "File exists"
        raise FlexSarathiError(f"{flag} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise FlexSarathiError(f"{flag} {path} cannot be created: {exc.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FlexSarathiError(f"{flag} {path} is not writable")


def check_not_the_input(input_path: str, output: str) -> None:
    """The output is not the input file under another name (same path, a hard link or a symbolic
    link to it): writing results there would destroy the requests. Checked before anything is
    opened for writing."""
    try:
        same = os.path.samefile(input_path, output)
    except OSError:  # the output does not exist yet (or cannot be stat'ed: its own checks say so)
        same = False
    if same:
        raise FlexSarathiError(f"--output {output} is the --input file {input_path}: results would replace the "
                               "requests; give another --output")


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of `path`, or an error that says which file and what is wrong with it. A
    leading byte-order mark (what Windows tools and Excel write) is no part of the text; a NUL byte
    is refused (a file of them is valid UTF-8, and would be scored or prompted as text)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise FlexSarathiError(f"cannot read {flag} {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise FlexSarathiError(f"{flag} {path} is not UTF-8 text: byte {data[exc.start]:#04x} at offset "
                               f"{exc.start} ({exc.reason})") from None
    nul = data.find(b"\0")  # valid UTF-8, but no text has NUL bytes: UTF-16 without a BOM ("\0O\0n"), binary
    if nul >= 0:
        raise FlexSarathiError(f"{flag} {path} is not UTF-8 text: a NUL byte at offset {nul} (UTF-16 text or a "
                               "binary file?)")
    return text

