"""`flexsarathi.ray.build_processor` in a user's Ray Data pipeline (LoRA rows, embeddings), and the
engine spec each actor builds from, on a local Ray instance of this module's own (test_ray.py's
fixture): the reference is LLM.generate / LLM.embed in this process. Split from test_ray.py so that
the two halves run on two test workers."""
from __future__ import annotations

import os

import pytest
import torch

from flexsarathi import LLM, SamplingParams
from policy_search import Policy
from tests.flexsarathi.ray.test_ray import cluster, needs_ray, ray  # noqa: F401 (fixture)


@needs_ray
def test_processor_rows_naming_lora_modules_run_with_those_adapters(tiny_checkpoint, cluster, tmp_path):
    """build_processor(lora_modules=...): each row's `model` column picks its adapter (None or the
    base model's name: none), the tokens of LLM.generate with those LoRARequests; a row naming
    neither fails the pipeline, saying which."""
    pytest.importorskip("peft")
    from flexsarathi import LLM, LoRARequest, SamplingParams
    from flexsarathi.ray import build_processor
    from tests.flexsarathi.formats.test_lora_adapter import save_adapter

    folder, _ = tiny_checkpoint("llama_gqa_untied")
    save_adapter(folder, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], seed=1)
    save_adapter(folder, tmp_path / "b", ["k_proj", "up_proj"], seed=2)
    modules = {"a": str(tmp_path / "a"), "b": str(tmp_path / "b")}
    models = ["a", "b", None, os.path.basename(folder), "a"]
    prompts = [[3, 17, 42, 9 + i] for i in range(len(models))]
    processor = build_processor(folder, sampling={"max_tokens": 6, "temperature": 0, "ignore_eos": True},
                                concurrency=2, batch_size=2, dtype="float32", lora_modules=modules)
    rows = processor(ray.data.from_items([{"n": i, "prompt": p, "model": m}
                                          for i, (p, m) in enumerate(zip(prompts, models))])).take_all()
    rows.sort(key=lambda row: row["n"])
    loras = [LoRARequest(m, "ab".index(m) + 1, modules[m]) if m in modules else None for m in models]
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        want = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False,
                            lora_request=loras)
    assert [list(row["generated_token_ids"]) for row in rows] == [o.outputs[0].token_ids for o in want]
    with pytest.raises(Exception, match="a row's model 'c' is neither the base model nor one of lora_modules"):
        processor(ray.data.from_items([{"prompt": prompts[0], "model": "c"}])).take_all()


@needs_ray
def test_processor_in_a_user_pipeline(stories_dir, cluster):
    """from_items -> the user's own map -> build_processor -> the user's filter -> take_all,
    against LLM.generate in this process."""
    from flexsarathi.ray import OUTPUT_COLUMNS, build_processor

    starts = ["Once upon a time", "Lily wanted to", "The little dog", "One day, a bird", "Tom had a"]
    processor = build_processor(stories_dir, sampling={"max_tokens": 7, "temperature": 0}, concurrency=2,
                                batch_size=2, dtype="float32")  # float32: see GREEDY
    dataset = ray.data.from_items([{"n": i, "start": s} for i, s in enumerate(starts + ["so " * 600])])
    dataset = dataset.map(lambda row: {**row, "prompt": row["start"].rstrip()})
    rows = processor(dataset).filter(lambda row: row["n"] != 1).take_all()
    rows.sort(key=lambda row: row["n"])
    assert [row["n"] for row in rows] == [0, 2, 3, 4, 5]
    assert set(OUTPUT_COLUMNS) | {"n", "start", "prompt"} == set(rows[0])
    with LLM(stories_dir, dtype="float32") as llm:
        refs = llm.generate([starts[i] for i in (0, 2, 3, 4)], SamplingParams(max_tokens=7, temperature=0),
                            use_tqdm=False)
    for row, ref in zip(rows, refs):
        assert row["error"] is None
        assert row["generated_text"] == ref.text and list(row["generated_token_ids"]) == ref.token_ids
        assert row["finish_reason"] == ref.finish_reason
        assert (row["num_input_tokens"], row["num_generated_tokens"]) == (len(ref.prompt_token_ids), 7)
    too_long = rows[-1]
    assert too_long["generated_text"] is None and "more than the model's context of 512" in too_long["error"]

    token_rows = processor(ray.data.from_items([{"prompt": [1, 403, 407]}])).take_all()
    with LLM(stories_dir, dtype="float32") as llm:
        ref, = llm.generate([[1, 403, 407]], SamplingParams(max_tokens=7, temperature=0), use_tqdm=False)
    assert list(token_rows[0]["generated_token_ids"]) == ref.token_ids


@needs_ray  # flexsarathi.ray (the spec module's package) imports Ray Data
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a driver without a GPU")
def test_job_dtype_is_resolved_once_for_the_actors_device():
    """--ray resolves dtype auto on the driver for the device the ACTORS compute on: GPU actors
    get the checkpoint's half dtype (fp16 for an fp32 checkpoint) even from a driver without a GPU
    (this machine), CPU actors this machine's measured choice; an explicit dtype passes through; a
    bad device is one error. Starts no Ray instance."""
    from flexsarathi.machine.dtype_choice import cpu_compute_dtype
    from flexsarathi.errors import FlexSarathiError
    from flexsarathi.ray.spec import job_dtype

    f32, bf16 = torch.float32, torch.bfloat16
    assert job_dtype(None, f32, None, num_gpus=1) == "float16"
    assert job_dtype(None, bf16, None, num_gpus=1) == "bfloat16"
    assert job_dtype("auto", f32, "cuda:1", num_gpus=0) == "float16"  # named, not present here
    assert job_dtype(None, f32, None, num_gpus=0) == str(cpu_compute_dtype()).removeprefix("torch.")
    assert job_dtype("float32", bf16, None, num_gpus=1) == "float32"
    with pytest.raises(FlexSarathiError, match="'gpu' is not one FlexSarathi computes on"):
        job_dtype(None, f32, "gpu", num_gpus=1)


@needs_ray  # flexsarathi.ray (the spec module's package) imports Ray Data
def test_engine_spec_carries_the_engine_options_to_each_actor(stories_dir, tmp_path):
    """`generate --ray --cpu-matmul dequantize`: each actor's engine multiplies as asked (the spec
    once dropped the option and every actor ran `auto`, int8x2 where its kernel builds). Built
    locally from the pickled spec, as an actor builds it; starts no Ray instance."""
    import pickle

    from flexsarathi.ray.spec import EngineSpec

    spec = pickle.loads(pickle.dumps(EngineSpec.of(stories_dir, Policy(compress_weight=True), dtype="float32",
                                                   device="cpu", cpu_matmul="dequantize", compress_head=False)))
    assert spec.options == {"cpu_matmul": "dequantize", "compress_head": False}
    llm = spec.build(str(tmp_path))
    try:
        assert llm.engine.cpu_matmul == "dequantize"
    finally:
        llm.close()


@needs_ray
def test_an_embedding_processor_in_a_user_pipeline(stories_dir, cluster):
    """build_processor(task="embed"): each row's embedding (EMBEDDING_COLUMNS), LLM.embed's in this
    process to float32; a prompt beyond the context is its row's error; misused arguments named."""
    from flexsarathi import FlexSarathiError, PoolingParams
    from flexsarathi.ray import EMBEDDING_COLUMNS, build_processor

    starts = ["Once upon a time", "Lily wanted to", "The little dog"]
    processor = build_processor(stories_dir, task="embed", pooling={"dimensions": 16}, concurrency=2, batch_size=2,
                                dtype="float32")
    dataset = ray.data.from_items([{"n": i, "prompt": p} for i, p in enumerate(starts + ["so " * 600])])
    rows = sorted(processor(dataset).take_all(), key=lambda row: row["n"])
    assert set(EMBEDDING_COLUMNS) | {"n", "prompt"} == set(rows[0])
    with LLM(stories_dir, dtype="float32", task="embed") as llm:
        refs = llm.embed(starts, PoolingParams(dimensions=16), use_tqdm=False)
    for row, ref in zip(rows, refs):
        assert row["error"] is None and row["num_input_tokens"] == len(ref.prompt_token_ids)
        torch.testing.assert_close(torch.tensor(row["embeddings"]), torch.tensor(ref.outputs.embedding),
                                   rtol=1e-5, atol=1e-6)
    assert rows[-1]["embeddings"] is None and "more than the model's context" in rows[-1]["error"]
    with pytest.raises(FlexSarathiError, match=r"build_processor\(sampling=...\) does not go with task='embed'"):
        build_processor(stories_dir, task="embed", sampling={"max_tokens": 2})
    with pytest.raises(FlexSarathiError, match="task=...\\) must be one of generate, embed"):
        build_processor(stories_dir, task="score")
