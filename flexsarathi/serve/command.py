"""`flexsarathi serve`: OpenAI's Files and Batches API on this machine, one engine per server.

Code written for OpenAI's Batch workflow runs unchanged with base_url pointed here:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY")
    f = client.files.create(file=open("batch.jsonl", "rb"), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    print(client.files.content(client.batches.retrieve(b.id).output_file_id).text)  # once completed

Batches run one after another, in the order they were created, on a background thread; each
request's record is written as it finishes (as `flexsarathi generate` writes them), so a server
killed mid-batch resumes it where it stopped on the next start with the same --data-dir. Files,
batches and results live under --data-dir. Binds to 127.0.0.1 unless --host says otherwise; any other
address needs an API key (--api-key or $FLEXSARATHI_API_KEY) or --allow-no-key.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from flexsarathi.cli.engine_args import add_lora_modules_arg, add_model_args, build_llm, describe_policy, lora_modules
from flexsarathi.cli.file_checks import positive_int
from flexsarathi.cli.generate import add_tool_call_parser_arg
from flexsarathi.engine.pooling import BATCH_TASKS
from flexsarathi.errors import FlexSarathiError

API_KEY_ENV = "FLEXSARATHI_API_KEY"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "flexsarathi", "serve")
# What a request body leaves out, as OpenAI's API defaults it (and `flexsarathi generate`'s flags do).
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_tokens": 0, "stop": [],
                     "ignore_eos": False}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve OpenAI's Files and Batches API (HTTP) on one engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_lora_modules_arg(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help=f"clients must send it as a bearer token (default: "
                   f"${API_KEY_ENV}; none: no check, allowed on loopback only)")
    g.add_argument("--allow-no-key", action="store_true", help="bind a non-loopback --host without a key")
    g.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="files, batches and their results "
                   f"(kept across restarts; default {DEFAULT_DATA_DIR})")
    g.add_argument("--max-file-mib", type=positive_int, default=200,
                   help="largest upload in MiB (default 200, OpenAI's batch file limit); larger ones get 413")
    g.add_argument("--max-storage-mib", type=positive_int, default=None,
                   help="most MiB the stored files (uploads and batch outputs) may take: an upload that would "
                   "pass it gets 413 (batch outputs are always written; default: no limit)")
    g = p.add_argument_group("requests")
    g.add_argument("--max-tokens", type=positive_int, default=16,
                   help="max_tokens of a request body without one (default 16, OpenAI's completions default)")
    g.add_argument("--seed", type=int, default=0, help="a request without its own seed samples with one "
                   "derived from this and its custom_id, so a resumed batch samples what an uninterrupted one would")
    add_tool_call_parser_arg(g)
    g.add_argument("--task", choices=BATCH_TASKS, default="generate",
                   help="generate (batches for /v1/completions and /v1/chat/completions) or embed (batches for "
                        "/v1/embeddings: the last token's final hidden state)")
    p.set_defaults(func=run_serve)
    return p


def check_bind(host: str, api_key: str | None, allow_no_key: bool) -> None:
    """Refuse to expose an engine without a key: any address but loopback needs one."""
    if api_key or allow_no_key or _is_loopback(host):
        return
    raise FlexSarathiError(f"--host {host} is reachable from other machines: give an API key (--api-key or "
                           f"${API_KEY_ENV}) or pass --allow-no-key")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only `localhost` is known to stay on this machine
        return False


def run_serve(args) -> int:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_bind(args.host, api_key, args.allow_no_key)
    try:
        import uvicorn

        from flexsarathi.serve.app import Server, create_app
    except ImportError as exc:
        raise FlexSarathiError(f"flexsarathi serve needs FastAPI and uvicorn ({exc}): "
                               "pip install 'flexsarathi[serve]'") from None
    from flexsarathi.serve.store import Store

    sock = _bind(args.host, args.port)  # before the model loads: a taken port fails at once
    max_stored = args.max_storage_mib << 20 if args.max_storage_mib else None
    store = Store(os.path.expanduser(args.data_dir), max_stored)
    engine = build_engine(args)
    app = create_app(store, engine, api_key, args.max_file_mib << 20)
    limit = f"limit {max_stored}" if max_stored else "no limit"
    print(f"serving {engine.model_name} on http://{args.host}:{args.port}/v1 (data in {store.data_dir}: "
          f"{store.stored_bytes} bytes stored, {limit}; {'bearer key required' if api_key else 'no key'})",
          file=sys.stderr, flush=True)
    try:
        Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        engine.llm.close()
    return 0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FlexSarathiError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def build_engine(args):
    """The server's one engine, built as `generate` builds its (the same model arguments), and what
    every batch's result file records about it."""
    from flexsarathi.engine.llm_engine import resolve_device, resolve_dtype
    from flexsarathi.engine.sampling import SamplingParams
    from flexsarathi.formats.opened_model import open_model
    from flexsarathi.cli.request_files import adapter_fingerprints
    from flexsarathi.serve.batch_job import ServeEngine

    sampling = {**SAMPLING_DEFAULTS, "max_tokens": args.max_tokens}
    SamplingParams(**sampling)
    opened = open_model(args.model, lora=args.lora)
    modules = lora_modules(args)
    adapters = adapter_fingerprints(modules)  # each folder read before the server starts
    dtype = resolve_dtype(args.dtype, opened.source.config.checkpoint_dtype, resolve_device(args.device))
    args.dtype = str(dtype).removeprefix("torch.")
    llm, policy = build_llm(args, None, opened=opened)  # --policy auto: planned for the default workload
    print(f"policy: {describe_policy(policy, llm.engine.engine_config.fit_running)}; device: {llm.engine.device}, "
          f"{args.dtype}", file=sys.stderr)
    name = os.path.realpath(args.model) if os.path.isdir(args.model) else args.model
    meta = {"job": "flexsarathi serve", "format": "openai", "model": name, "weights": opened.source.fingerprint,
            "dtype": args.dtype, "seed": args.seed, "sampling": sampling,
            **({"tool_call_parser": args.tool_call_parser} if args.tool_call_parser else {}),
            **({"task": args.task} if args.task != "generate" else {}),
            **({"lora_modules": adapters} if adapters else {})}
    return ServeEngine(llm=llm, model_name=os.path.basename(os.path.normpath(args.model)), meta=meta,
                       sampling=sampling, seed=args.seed, tool_call_parser=args.tool_call_parser, task=args.task,
                       lora_modules=modules)
