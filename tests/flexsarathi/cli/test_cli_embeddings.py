"""`flexsarathi generate` on OpenAI Batch lines for /v1/embeddings (stories260K): every input form
OpenAI takes (a string, several, token ids), `dimensions` and base64 `encoding_format`; each body is
an embeddings response the official openai client reads, its vectors LLM(task="embed").embed's of
the same inputs; a line for another url, a bad field or an input the context cannot hold is that
line's error record; a job cut short resumes to the uninterrupted file."""
from __future__ import annotations

import base64
import struct

import pytest
import torch

from flexsarathi import LLM, PoolingParams
from flexsarathi.cli.main import main
from tests.flexsarathi.cli.test_cli_generate import records, write_lines

openai_types = pytest.importorskip("openai.types")


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": "m", **body}}


LINES = [line("one", input="Once upon a time"),
         line("many", input=["Lily wanted to", "The little dog"], dimensions=8, encoding_format="base64"),
         line("ids", input=[1, 403, 407, 261]),
         line("id lists", input=[[1, 403], [1, 407, 261]], user="u"),
         {"custom_id": "text", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "Hi"}},
         line("too long", input=["fine", [5] * 600]),
         line("bad format", input="x", encoding_format="int8"),
         line("typo", input="x", dimension=8)]


def run(stories_dir: str, tmp_path, name: str = "out") -> dict:
    src = write_lines(tmp_path / "in.jsonl", LINES)
    out = tmp_path / f"{name}.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), "--dtype", "float32",
                 "--quiet"]) == 1  # error records
    return {r["custom_id"]: r for r in records(out)}


def test_embedding_lines_equal_llm_embed(stories_dir, tmp_path):
    got = run(stories_dir, tmp_path)
    with LLM(stories_dir, dtype="float32", task="embed") as llm:
        one, *many = llm.embed(["Once upon a time", "Lily wanted to", "The little dog"], use_tqdm=False)
        cut = llm.embed(["Lily wanted to", "The little dog"], PoolingParams(dimensions=8), use_tqdm=False)
        ids = llm.embed([[1, 403, 407, 261], [1, 403], [1, 407, 261]], use_tqdm=False)
    bodies = {key: r["response"]["body"] for key, r in got.items() if r["error"] is None}
    assert sorted(bodies) == ["id lists", "ids", "many", "one"]
    for key, body in bodies.items():  # the client reads them (a base64 body as its raw response: decoded after)
        if key != "many":
            openai_types.CreateEmbeddingResponse.model_validate(body)
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(bodies["one"]["data"][0]["embedding"]),
                               torch.tensor(one.outputs.embedding), **close)
    assert bodies["one"]["usage"] == {"prompt_tokens": len(one.prompt_token_ids),
                                      "total_tokens": len(one.prompt_token_ids)}
    for k, (item, expected) in enumerate(zip(bodies["many"]["data"], cut)):
        floats = struct.unpack("<8f", base64.b64decode(item["embedding"]))  # OpenAI's base64: float32 bytes
        assert item["index"] == k
        torch.testing.assert_close(torch.tensor(floats), torch.tensor(expected.outputs.embedding), **close)
        assert abs(torch.tensor(floats).norm().item() - 1) < 1e-5  # cut, then normalized
    vectors = [d["embedding"] for d in bodies["ids"]["data"] + bodies["id lists"]["data"]]
    torch.testing.assert_close(torch.tensor(vectors), torch.tensor([o.outputs.embedding for o in ids]), **close)
    assert len(many) == 2

    errors = {key: r["error"]["message"] for key, r in got.items() if r["error"] is not None}
    assert errors["text"] == ("line 5: this job embeds (as its first request, line 1, asks): a request for text goes "
                              "in a file of its own")
    assert errors["too long"] == "line 6: input 1: prompt has 600 tokens, more than the model's context of 512"
    assert 'body.encoding_format must be "float" or "base64"' in errors["bad format"]
    assert "unknown body field(s) ['dimension']" in errors["typo"]


def test_a_job_cut_short_resumes_to_the_uninterrupted_file(stories_dir, tmp_path):
    whole = run(stories_dir, tmp_path, "whole")
    path = tmp_path / "cut.jsonl"
    run(stories_dir, tmp_path, "cut")
    kept = path.read_text().splitlines(keepends=True)
    path.write_text("".join(kept[:3]))  # the job stopped after three records
    again = run(stories_dir, tmp_path, "cut")
    assert again.keys() == whole.keys()
    for key in whole:
        assert again[key]["error"] == whole[key]["error"]
        if whole[key]["error"] is None:
            assert again[key]["response"] == whole[key]["response"]


def test_jsonl_embedding_records(stories_dir, tmp_path):
    """A JSONL record with "input" (and "dimensions", "normalize") asks for embeddings: its record
    holds them in input order, as LLM.embed gives them; a record mixing in generation fields, or a
    text request in an embedding job, is that line's error."""
    lines = [{"id": "a", "input": "Once upon a time"},
             {"id": "b", "input": ["Lily wanted to", [1, 403, 407]], "dimensions": 8, "normalize": False},
             {"id": "c", "input": "x", "max_tokens": 3},
             {"id": "d", "prompt": "Once"},
             {"id": "e", "input": "x", "normalize": "yes"}]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", stories_dir, "--input", src, "--output", str(out), "--dtype", "float32",
                 "--quiet"]) == 1
    got = {r["id"]: r for r in records(out)}
    with LLM(stories_dir, dtype="float32", task="embed") as llm:
        a = llm.embed("Once upon a time", use_tqdm=False)[0]
        b = llm.embed(["Lily wanted to", [1, 403, 407]], PoolingParams(dimensions=8, normalize=False), use_tqdm=False)
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["a"]["embeddings"]), torch.tensor([a.outputs.embedding]), **close)
    torch.testing.assert_close(torch.tensor(got["b"]["embeddings"]), torch.tensor([o.outputs.embedding for o in b]),
                               **close)
    assert got["b"]["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in b)
    assert "an embedding record (it has \"input\") takes id, input, dimensions, normalize, model; it also has " \
           "['max_tokens']" in got["c"]["error"]["message"]
    assert "this job embeds (as its first request, line 1, asks): a request for text" in got["d"]["error"]["message"]
    assert got["e"]["error"]["message"] == "line 5: normalize must be true or false, got 'yes'"


def test_embed_a_text_file(stories_dir, tmp_path, capsys):
    """`--embed` with a plain-text file: each line's embedding, as LLM.embed gives it; the meta says
    so (a resume without --embed is refused, not mixed); JSONL input is refused, naming the way."""
    texts = ["Once upon a time", "Lily wanted to", "The little dog"]
    src = tmp_path / "texts.txt"
    src.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", stories_dir, "--input", str(src), "--output", str(out), "--dtype", "float32",
            "--quiet"]
    assert main([*argv, "--embed"]) == 0
    got = {r["id"]: r for r in records(out)}
    with LLM(stories_dir, dtype="float32", task="embed") as llm:
        refs = llm.embed(texts, use_tqdm=False)
    for line, ref in enumerate(refs, 1):
        torch.testing.assert_close(torch.tensor(got[line]["embeddings"]), torch.tensor([ref.outputs.embedding]),
                                   rtol=1e-5, atol=1e-6)
    capsys.readouterr()
    assert main(argv) == 2  # the same output without --embed: another job
    assert "task" in capsys.readouterr().err
    jsonl = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    assert main(["generate", "--model", stories_dir, "--input", jsonl, "--output", str(tmp_path / "o.jsonl"),
                 "--embed", "--quiet"]) == 2
    assert "--embed reads a plain-text file (one text per line)" in capsys.readouterr().err
