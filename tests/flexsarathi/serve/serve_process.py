"""A `flexsarathi serve` process as users run it, on 127.0.0.1 with a key, and what the serve tests
send it: batch lines, uploads through the official `openai` client, polls until a batch ends."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import openai

from tests.conftest import REPO

API_KEY = "test-key-45"
MAX_FILE_MIB = 8
TERMINAL = ("completed", "failed", "cancelled", "expired")

# `python -c SERVE_WITH_HOOKS ARGS...` runs `flexsarathi ARGS...` (a server) with hooks driven by
# marker files in --data-dir. After each record its batch runner writes: `kill` (holding N) SIGKILLs
# the server once it has written N records; while `hold` exists the runner waits (and says so with
# `held`), as a long pass would, so a test can act while a batch is surely running. After a batch's
# create call has read its input file: while `hold-create` exists the call waits (`held-create`).
# After a lookup finds file ID: if `vanish-ID` exists, the file is deleted there (the marker too),
# as a client's delete landing between a download's lookup and its read would. A full disk
# (full_disk.py): while `enospc-upload` exists, uploads' data is written to a full disk; while
# `enospc-record` exists, the store's JSON records are; while `enospc-results` exists, batches'
# result files are; while `enospc-spool` exists, the temporary files request bodies are spooled to are.
SERVE_WITH_HOOKS = """
import errno, os, signal, sys, time
from starlette import formparsers
from flexsarathi.cli import result_file
from flexsarathi.cli.main import main
from flexsarathi.serve import routes, store
from tests.flexsarathi.serve.full_disk import full_disk_open, full_disk_writer
data = sys.argv[sys.argv.index("--data-dir") + 1]
append, validate, written = result_file.ResultFile.append, routes.validate_input, []
get_file, open_results = store.Store.get_file, result_file.ResultFile._open

def marked(name):
    return lambda: os.path.exists(os.path.join(data, name))

class SpoolWithHook(formparsers.SpooledTemporaryFile):
    def write(self, data):
        if marked("enospc-spool")():
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)

def open_results_with_hook(self, *args):
    open_results(self, *args)
    self._file.close()
    self._file = full_disk_writer(self.real_path, "ab", marked("enospc-results"))

def wait_while(hold, held):
    if os.path.exists(os.path.join(data, hold)):
        open(os.path.join(data, held), "w").close()
        while os.path.exists(os.path.join(data, hold)):
            time.sleep(0.01)
        os.remove(os.path.join(data, held))

def append_with_hooks(self, record):
    append(self, record)
    written.append(record)
    kill = os.path.join(data, "kill")
    if os.path.exists(kill) and len(written) >= int(open(kill).read()):
        os.kill(os.getpid(), signal.SIGKILL)
    wait_while("hold", "held")

def validate_with_hook(*args):
    try:
        return validate(*args)
    finally:
        wait_while("hold-create", "held-create")

def get_file_with_hook(self, file_id):
    found = get_file(self, file_id)
    vanish = os.path.join(data, f"vanish-{file_id}")
    if found is not None and os.path.exists(vanish):
        os.remove(vanish)
        self.delete_file(file_id)
    return found

result_file.ResultFile.append = append_with_hooks
routes.validate_input = validate_with_hook
store.Store.get_file = get_file_with_hook
store.open = full_disk_open({".data.tmp": marked("enospc-upload"), ".json.tmp": marked("enospc-record")})
result_file.ResultFile._open = open_results_with_hook
formparsers.SpooledTemporaryFile = SpoolWithHook
sys.exit(main(sys.argv[1:]))
"""

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `flexsarathi serve` process on loopback, its log in DATA/../server-N.log."""

    def __init__(self, data_dir, *args: str):
        self.data_dir, self.args, self.starts = data_dir, args, 0
        self.proc = None

    def start(self) -> "Server":
        self.port, self.starts = free_port(), self.starts + 1
        self.log = self.data_dir.parent / f"server-{self.starts}.log"
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        argv = [sys.executable, "-c", SERVE_WITH_HOOKS, "serve", *self.args, "--host", "127.0.0.1",
                "--port", str(self.port), "--data-dir", str(self.data_dir), "--api-key", API_KEY]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        client = self.client()
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.output()}"
            try:
                client.models.list()
                return self
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, self.output()
                time.sleep(0.1)

    def client(self, api_key: str = API_KEY):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        assert "Traceback" not in self.output(), self.output()


def completion(custom_id: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "stories260K", "prompt": prompt, "max_tokens": 6, "temperature": 0, **body}}


def write_lines(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def wait_until_ended(client, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.05)


def wait_for_file(path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def submit(client, src: str, endpoint: str = "/v1/completions"):
    with open(src, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def downloaded(client, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(ln) for ln in client.files.content(file_id).text.splitlines()]
