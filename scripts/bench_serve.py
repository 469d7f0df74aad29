"""`flexsarathi serve` under load: a batch's generated tok/s while 20 clients on loopback poll it
and download a finished output file, against the same batch with no other client. Rounds alternate
(none, clients, none, ...) so drift hits both; the ratio of the medians is printed.

    .venv/bin/python scripts/bench_serve.py [--model ../shared/models/stories260K] [--clients 20]
        [--interval 1.0] [--requests 256] [--max-tokens 64] [--rounds 3] [--timeout 600]

Two ratios: tok/s, and tokens per CPU second of the server process. The engine's thread and the
HTTP side share one interpreter lock, so what the clients cost the engine is the server's extra CPU
time; on a machine busy with other work, wall time swings with the neighbours while the CPU ratio
still says what the HTTP side took (on a quiet machine the two agree).

tok/s is measured as a user sees it: the batch's completion tokens over the wall time from its
creation to its `completed` status (observed by one more poller, every 20 ms, in both conditions).
Each load client, on its own connection, retrieves the batch and downloads the output file of an
earlier batch, then sleeps --interval seconds (a 1 s poll is aggressive: OpenAI's cookbook polls
every 10-60 s). Everything is bounded: --requests per batch, 2 x --rounds timed batches, and
--timeout seconds for the whole run (the server is stopped on the way out).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import harness  # puts the repository root on sys.path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STORIES = os.path.join(os.path.dirname(REPO), "shared", "models", "stories260K")
KEY = "bench-serve-key"


def start_server(args, data_dir: str, log) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "flexsarathi", "serve", "--model", args.model, "--dtype", args.dtype,
                             "--host", "127.0.0.1", "--port", str(port), "--data-dir", data_dir, "--api-key", KEY],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def wait_ready(client, proc, deadline: float) -> None:
    import openai

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise SystemExit("the server did not start in time") from None
            time.sleep(0.2)


def batch_file(path: str, requests: int, max_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(requests):  # token-id prompts: any model, tokenizer or not
            body = {"model": "m", "prompt": [rng.randrange(3, 500) for _ in range(16)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")
    return path


def timed_batch(client, file_id: str, deadline: float, holder: dict | None = None) -> tuple[str, float, str]:
    """(batch id, seconds from creation to completed, output file id); holder["id"]: the batch's id
    from its creation on (what the load clients poll)."""
    start = time.perf_counter()
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    if holder is not None:
        holder["id"] = batch.id
    while batch.status not in ("completed", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise SystemExit("--timeout reached during a batch")
        time.sleep(0.02)
        batch = client.batches.retrieve(batch.id)
    seconds = time.perf_counter() - start
    if batch.status != "completed" or batch.request_counts.failed:
        raise SystemExit(f"batch {batch.id} ended {batch.status}: {batch.errors or batch.request_counts}")
    return batch.id, seconds, batch.output_file_id


def completion_tokens(client, output_file_id: str) -> int:
    lines = client.files.content(output_file_id).text.splitlines()
    return sum(json.loads(ln)["response"]["body"]["usage"]["completion_tokens"] for ln in lines)


def load_client(make_client, batch_holder: dict, download_id: str, interval: float, stop: threading.Event,
                served: list) -> None:
    client = make_client()
    stop.wait(random.random() * interval)  # spread the clients over the interval
    while not stop.is_set():
        if batch_holder.get("id"):
            client.batches.retrieve(batch_holder["id"])
            served.append(1)
        client.files.content(download_id).read()
        served.append(1)
        stop.wait(interval)


def measure(client, make_client, args, file_id: str, download_id: str, clients: int, deadline: float,
            server_pid: int) -> dict:
    """One batch under `clients` load clients: its tok/s, the requests they had answered per second,
    and the CPU seconds the server and this process (the clients) used meanwhile."""
    stop, served, holder = threading.Event(), [], {}
    threads = [threading.Thread(target=load_client, args=(make_client, holder, download_id, args.interval, stop, served),
                                daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(args.interval if clients else 0)  # every client in its loop before the batch starts
    try:
        served.clear()
        start, server_cpu, own_cpu = time.perf_counter(), _cpu_seconds(server_pid), time.process_time()
        _, seconds, output_id = timed_batch(client, file_id, deadline, holder)
        server_cpu, own_cpu = _cpu_seconds(server_pid) - server_cpu, time.process_time() - own_cpu
        load_seconds = time.perf_counter() - start
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    tokens = completion_tokens(client, output_id)
    return {"rate": tokens / seconds, "served": len(served) / load_seconds, "seconds": seconds, "tokens": tokens,
            "server_cpu": server_cpu, "client_cpu": own_cpu}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args) -> None:
    import openai

    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "server.log"), "wb") as log:
        proc, port = start_server(args, os.path.join(tmp, "data"), log)
        make_client = lambda: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)  # noqa: E731
        client = make_client()
        try:
            wait_ready(client, proc, deadline)
            with open(batch_file(os.path.join(tmp, "in.jsonl"), args.requests, args.max_tokens, 0), "rb") as f:
                file_id = client.files.create(file=f, purpose="batch").id
            _, seconds, download_id = timed_batch(client, file_id, deadline)  # warm-up; its output is downloaded
            size = client.files.retrieve(download_id).bytes
            print(f"warm-up batch: {seconds:.2f} s; the clients download its {size} byte output file", flush=True)
            results = {0: [], args.clients: []}
            per_cpu = {0: [], args.clients: []}  # tokens per CPU second of the server process
            rows = []
            for r in range(args.rounds):
                for clients in (0, args.clients):
                    m = measure(client, make_client, args, file_id, download_id, clients, deadline, proc.pid)
                    results[clients].append(m["rate"])
                    rows.append({"round": r + 1, "clients": clients, **m})
                    per_cpu[clients].append(m["tokens"] / m["server_cpu"])
                    load = f"; {m['served']:.1f} requests/s answered" if clients else ""
                    print(f"{clients:3d} clients: {m['tokens']} tokens in {m['seconds']:6.2f} s = {m['rate']:8.1f} "
                          f"tok/s; CPU s: server {m['server_cpu']:.2f}, clients {m['client_cpu']:.2f}{load}", flush=True)
            base, loaded = statistics.median(results[0]), statistics.median(results[args.clients])
            print(f"ratio (median tok/s with {args.clients} clients / with none): {loaded / base:.3f}", flush=True)
            cpu_ratio = statistics.median(per_cpu[args.clients]) / statistics.median(per_cpu[0])
            print(f"ratio (median tokens per server CPU second, {args.clients} clients / none): {cpu_ratio:.3f}",
                  flush=True)
            harness.write_result(args, rows, {"tok_s_clients_over_none": loaded / base,
                                              "tokens_per_server_cpu_s_clients_over_none": cpu_ratio})
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=STORIES)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds each client sleeps between rounds")
    ap.add_argument("--requests", type=int, default=256, help="requests per batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed batches per condition")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    harness.add_json_option(ap, __file__)
    args = ap.parse_args()
    if not 1 <= args.clients <= 200 or not 1 <= args.requests <= 5000 or not 1 <= args.rounds <= 20:
        raise SystemExit("--clients 1..200, --requests 1..5000, --rounds 1..20: keep the run bounded")
    from flexsarathi.machine.cpu_info import cpu_line

    print(f"bench_serve: {args.model}, {args.dtype}, {args.requests} requests x {args.max_tokens} tokens; "
          f"{cpu_line(None)}", flush=True)
    run(args)


if __name__ == "__main__":
    main()
