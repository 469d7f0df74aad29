"""LoRA adapters served per request (LLM(enable_lora=True), LoRARequest) against PEFT's own adapted
models run unmerged: one batch mixing adapters and the base model gives each prompt its model's
logits; every placement and schedule gives the all-on-device tokens; prefix-cache blocks are never
shared across adapters; what cannot be served is refused, saying what."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from flexsarathi import LLM, LoRARequest, SamplingParams
from flexsarathi.errors import CheckpointError, FlexSarathiError
from offload import executor
from offload.memory import MemoryBudgetError
from policy_search import Policy
from policy_search.hardware import HardwareSpec
from tests.prompt_logits import prompt_logits

peft = pytest.importorskip("peft")
from tests.flexsarathi.formats.test_lora_adapter import adapt, peft_logits, save_adapter  # noqa: E402

# two adapters of different targets and ranks' worth of modules: a stacked weight (qkv, gate_up)
# partly adapted, so its B is block-diagonal with zero blocks
TARGETS = {
    "opt": (["q_proj", "v_proj", "fc1"], ["k_proj", "out_proj", "fc2"]),
    "llama_gqa_untied": (["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"], ["k_proj", "up_proj"]),
    "qwen3": (["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]),
    "gemma3": (["q_proj", "v_proj", "gate_proj"], ["k_proj", "o_proj", "down_proj"]),
    "phi3": (["qkv_proj", "down_proj"], ["o_proj", "gate_up_proj"]),
}
PROMPTS = [[3, 17, 42, 9, 77, 5, 23], [11, 12, 13, 14], [3, 17, 42, 9], [5, 6, 7, 8, 9]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def two_adapters(tiny_checkpoint, tmp_path):
    """(folder, base model, {name: (LoRARequest, PEFT model)}) for a family."""
    def make(kind: str):
        folder, base = tiny_checkpoint(kind)
        adapters = {}
        for i, targets in enumerate(TARGETS[kind]):
            name = "ab"[i]
            model = save_adapter(folder, tmp_path / name, targets, seed=i + 1)
            adapters[name] = (LoRARequest(name, i + 1, str(tmp_path / name)), model)
        return folder, base, adapters

    return make


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_a_batch_mixing_adapters_gives_each_prompt_its_models_logits(two_adapters, kind):
    folder, base, adapters = two_adapters(kind)
    names = ["a", "b", None, "a"]
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        ours = prompt_logits(llm, PROMPTS, [adapters[n][0] if n else None for n in names])
    for prompt, name, got in zip(PROMPTS, names, ours):
        with torch.no_grad():
            plain = base(torch.tensor([prompt])).logits[0].float()
        want = peft_logits(adapters[name][1], prompt) if name else plain
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if name:  # the adapter changes the model: this comparison could fail
            assert (want - plain).abs().max() > 0.1


PLACEMENTS = {
    "cpu_weights": dict(w_gpu=0.0, w_cpu=1.0),
    "disk_weights": dict(w_gpu=0.3, w_cpu=0.0, w_disk=0.7),
    "disk_4bit": dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5, compress_weight=True),
    "block_schedule": dict(scheduler="block"),
    "chunked_prefill": dict(prefill_budget=3),
}


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_every_placement_and_schedule_gives_the_all_on_device_tokens(two_adapters, tmp_path, placement):
    folder, _, adapters = two_adapters("llama_gqa_untied")
    loras = [adapters["a"][0], None, adapters["b"][0], adapters["a"][0]]
    compress = PLACEMENTS[placement].get("compress_weight", False)
    with LLM(folder, dtype="float32", enable_lora=True, policy=Policy(compress_weight=compress)) as llm:
        reference = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)]
        base = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert reference != base  # the adapters change the tokens: the comparison below could fail
    with LLM(folder, dtype="float32", enable_lora=True, policy=Policy(**PLACEMENTS[placement]),
             offload_dir=str(tmp_path / "offload")) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)] == reference


def test_a_prompt_pass_cut_into_row_slices_updates_each_slices_own_rows(two_adapters, monkeypatch):
    """A pass of more rows than POST_ATTENTION_ROWS runs the MLP slice by slice: each slice takes
    the rows of each adapter within it (slices of 5 rows cut through the prompts here)."""
    folder, _, adapters = two_adapters("llama_gqa_untied")
    loras = [adapters["a"][0], adapters["b"][0], None, adapters["a"][0]]
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        whole = prompt_logits(llm, PROMPTS, loras)
        monkeypatch.setattr(executor, "POST_ATTENTION_ROWS", 5)
        sliced = prompt_logits(llm, PROMPTS, loras)
    for got, want in zip(sliced, whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_graph_passes_leave_adapter_rows_to_the_eager_pass(two_adapters):
    """cuda_graphs=True (on the CPU: the same static buffers, run eagerly): decode passes with
    adapter rows are not replayed, so the tokens are the eager engine's."""
    folder, _, adapters = two_adapters("llama_gqa_untied")
    loras = [adapters["a"][0], adapters["b"][0], adapters["a"][0], adapters["b"][0]]
    runs = {}
    for graphs in (False, True):
        with LLM(folder, dtype="float32", enable_lora=True, cuda_graphs=graphs) as llm:
            runs[graphs] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)]
            replayed = llm.engine.stats["graph_passes"]
    assert runs[True] == runs[False]
    assert replayed == 0


def test_prefix_cache_blocks_are_shared_within_an_adapter_only(two_adapters):
    """One prompt four times, one request at a time (a cache that holds them all), with adapters a, b,
    none and a: only the second a finds blocks (the first's); the tokens are those without the cache."""
    folder, _, adapters = two_adapters("llama_gqa_untied")
    prompts = [list(range(3, 40))] * 4  # two whole blocks of 16 and a part
    loras = [adapters["a"][0], adapters["b"][0], None, adapters["a"][0]]
    outs = {}
    for caching in (True, False):
        with LLM(folder, dtype="float32", enable_lora=True, kv_block_size=16, enable_prefix_caching=caching,
                 policy=Policy(gpu_batch_size=1, kv_cache_tokens=512)) as llm:
            outs[caching] = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert [o.num_cached_tokens for o in outs[True]] == [0, 0, 0, 32]
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]


def test_the_adapters_are_charged_to_the_compute_device(two_adapters):
    """Their bytes: per stacked weight, A [R, in] and B [out, R] in the compute dtype."""
    folder, _, adapters = two_adapters("llama_gqa_untied")
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters["a"][0])
        shapes, layers = llm.engine.model.layer_shapes(), llm.engine.config.num_layers
        r = 4
        # a: q and v in qkv (R = 2r), o, gate in gate_up (R = r), down
        want = layers * sum(r * parts * (shapes[name][0] + shapes[name][1]) * 4 for name, parts in
                            (("qkv_proj.weight", 2), ("o_proj.weight", 1), ("gate_up_proj.weight", 1),
                             ("down_proj.weight", 1)))
        assert llm.engine.memory.report()["gpu"]["by_what"]["LoRA adapters"] == want
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=adapters["a"][0])  # read once
        assert llm.engine.memory.report()["gpu"]["by_what"]["LoRA adapters"] == want


def test_what_cannot_be_served_is_refused_saying_what(two_adapters, tmp_path, tiny_checkpoint):
    folder, _, adapters = two_adapters("llama_gqa_untied")
    a = adapters["a"][0]
    with LLM(folder, dtype="float32") as llm, pytest.raises(FlexSarathiError, match="enable_lora=True"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)
    with pytest.raises(FlexSarathiError, match="give one of them"):
        LLM(folder, dtype="float32", enable_lora=True, lora=a.lora_path)
    save_adapter(folder, tmp_path / "head", ["q_proj", "lm_head"])
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        with pytest.raises(FlexSarathiError, match="2 entries for 4 prompts"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=[a, None])
        with pytest.raises(CheckpointError, match="lm_head, which is not a dense layer linear"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("h", 3, str(tmp_path / "head")))
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)
        with pytest.raises(FlexSarathiError, match="LoRARequest id 1 is 'a'"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("b", 1, adapters["b"][0].lora_path))
        outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, on_error="record",
                               lora_request=[a, LoRARequest("gone", 4, str(tmp_path / "missing"))])
        assert outputs[0].error is None and "is not a folder" in outputs[1].error
    other, _ = tiny_checkpoint("opt")
    with LLM(other, dtype="float32", enable_lora=True) as llm, pytest.raises(CheckpointError, match="adapts model"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=a)  # an adapter of the llama checkpoint
    for bad, field in (("", "lora_name"), (0, "lora_int_id"), (None, "lora_path")):
        args = {"lora_name": "x", "lora_int_id": 1, "lora_path": "p"}
        args[field] = bad
        with pytest.raises(FlexSarathiError, match=f"LoRARequest.{field}"):
            LoRARequest(**args)


def test_a_batch_file_routes_each_line_to_the_adapter_its_model_names(two_adapters, tmp_path, capsys):
    """`generate --lora-modules a=DIR b=DIR`: lines whose "model" is a, b, the job's model or absent
    run with that adapter or the base model, the tokens of LLM.generate with those LoRARequests; a
    model that is neither is an error record; an OpenAI line's result names the adapter as its
    model; a resume with another adapter under a name is refused."""
    from flexsarathi.cli.main import main

    folder, _, adapters = two_adapters("llama_gqa_untied")
    models = ["a", "b", None, "a", os.path.basename(folder), "c"]
    job, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    records = [{"id": f"r{i}", "prompt_token_ids": PROMPTS[i % 4], **({"model": m} if m else {})}
               for i, m in enumerate(models)]
    job.write_text("".join(json.dumps(r) + "\n" for r in records))
    modules = ["--lora-modules", f"a={adapters['a'][0].lora_path}", f"b={adapters['b'][0].lora_path}"]
    args = ["generate", "--model", folder, "--output", str(out), "--dtype", "float32", "--quiet", "--temperature", "0",
            "--max-tokens", "6"]
    assert main([*args, "--input", str(job), *modules]) == 1  # one error record
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "'c' is neither the base model nor one of the --lora-modules (a, b)" in records["r5"]["error"]["message"]
    loras = [adapters[m][0] if m in ("a", "b") else None for m in models[:5]]
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        want = llm.generate([PROMPTS[i % 4] for i in range(5)], SamplingParams(max_tokens=6, temperature=0),
                            use_tqdm=False, lora_request=loras)
    assert [records[f"r{i}"]["token_ids"] for i in range(5)] == [o.outputs[0].token_ids for o in want]
    assert len({json.dumps(records[f"r{i}"]["token_ids"]) for i in range(3)}) == 3  # three models
    capsys.readouterr()
    swapped = ["--lora-modules", f"a={adapters['b'][0].lora_path}", f"b={adapters['a'][0].lora_path}"]
    assert main([*args, "--input", str(job), *swapped]) == 2
    assert "another configuration" in capsys.readouterr().err
    openai = tmp_path / "openai.jsonl"
    openai.write_text("".join(json.dumps({"custom_id": f"o{i}", "method": "POST", "url": "/v1/completions",
                                          "body": {"prompt": PROMPTS[0], "model": m}}) + "\n"
                              for i, m in enumerate(["b", "base-name"])))
    args[args.index("--output") + 1] = str(tmp_path / "openai_out.jsonl")
    assert main([*args, "--input", str(openai), *modules]) == 1
    results = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "openai_out.jsonl").read_text().splitlines())}
    assert results["o0"]["response"]["body"]["model"] == "b" and "'base-name' is neither" in json.dumps(results["o1"])
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "prompt_token_ids": [3, 4], "model": 5}) + "\n")
    args[args.index("--output") + 1] = str(tmp_path / "bad_out.jsonl")
    assert main([*args, "--input", str(bad), *modules]) == 1
    assert "model must be a non-empty string, got 5" in (tmp_path / "bad_out.jsonl").read_text()
    for misuse, said in ((["--lora-modules", "a=x", "a=y"], "names 'a' twice"),
                         ([*modules, "--lora", str(tmp_path / "a")], "give one of them")):
        assert main([*args, "--input", str(job), "--overwrite", *misuse]) == 2
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--input", str(job), "--lora-modules", "a"])  # argparse: NAME=DIR


def test_chat_runs_each_conversation_with_its_adapter(stories_dir, tmp_path):
    """LLM.chat's lora_request, one per conversation: each gives the tokens generate gives its
    rendered prompt with that adapter, and the adapter's differ from the base model's."""
    from tests.conftest import with_chat_template

    folder = with_chat_template(stories_dir, tmp_path / "stories", "{% for m in messages %}{{ m['content'] }} "
                                "{% endfor %}")
    save_adapter(folder, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], seed=3)
    a = LoRARequest("a", 1, str(tmp_path / "a"))
    chats = [[{"role": "user", "content": "Once upon a time"}], [{"role": "user", "content": "Lily wanted to"}]]
    with LLM(folder, dtype="float32", enable_lora=True) as llm:
        got = llm.chat(chats * 2, GREEDY, use_tqdm=False, lora_request=[a, a, None, None])
        ids = [llm.tokenizer.encode(o.prompt, add_special_tokens=False) for o in got[:2]]
        want = llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY, use_tqdm=False, lora_request=a)
    assert [o.outputs[0].token_ids for o in got[:2]] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got[:2]] != [o.outputs[0].token_ids for o in got[2:]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("placement", ["all_on_gpu", "cpu_weights"])
def test_on_a_gpu_a_mixed_batch_gives_the_cpus_logits(two_adapters, tmp_path, placement, monkeypatch):
    """The same mixed batch on CUDA (adapter factors there; streamed base weights with cpu_weights;
    long prompt passes sliced, the slices' rows found on the device) and on the CPU, fp32."""
    folder, _, adapters = two_adapters("llama_gqa_untied")
    loras = [adapters["a"][0], adapters["b"][0], None, adapters["a"][0]]
    policy = Policy(**({} if placement == "all_on_gpu" else PLACEMENTS["cpu_weights"]))
    got = {}
    for device in ("cpu", "cuda"):
        with LLM(folder, dtype="float32", device=device, enable_lora=True, policy=policy,
                 offload_dir=str(tmp_path / device)) as llm:
            got[device] = prompt_logits(llm, PROMPTS, loras)
            monkeypatch.setattr(executor, "POST_ATTENTION_ROWS", 5)
            got[device + " sliced"] = prompt_logits(llm, PROMPTS, loras)
            monkeypatch.undo()
    for key in ("cuda", "cuda sliced"):
        for mine, theirs in zip(got[key], got["cpu"]):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_a_gguf_base_serves_adapters_as_peft_does_on_its_weights(tmp_path):
    """A Q4_0 GGUF file as the base (its codes kept as they are; q/k rows back in transformers'
    order): an adapter trained on transformers' load of that file gives PEFT's logits, a prompt
    without one the base model's."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    from tests.gguf_files import build_model, write_gguf

    path = tmp_path / "model.gguf"
    write_gguf(build_model("llama"), path, weight_type="Q4_0")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    model = adapt(ref, tmp_path / "a", ["q_proj", "k_proj", "o_proj", "down_proj"], seed=5)
    prompts = [[1, 5, 9, 33, 7, 100, 3], [17, 2, 99, 64, 31, 8]]
    with LLM(str(path), dtype="float32", device="cpu", cpu_matmul="dequantize", enable_lora=True) as llm:
        ours = prompt_logits(llm, prompts, [LoRARequest("a", 1, str(tmp_path / "a")), None])
    assert_adapted_then_plain(ours, model, prompts, tolerance=1e-4)


def assert_adapted_then_plain(ours: list[torch.Tensor], model, prompts: list[list[int]], tolerance: float) -> None:
    """ours[0]: the PEFT `model`'s logits of prompts[0] with its adapter; ours[1]: prompts[1]'s
    without it (the base model's); and the adapter does change prompts[0]'s (the first could fail)."""
    with torch.no_grad():
        adapted = model(torch.tensor([prompts[0]])).logits[0]
        with model.disable_adapter():
            plain = [model(torch.tensor([p])).logits[0] for p in prompts]
    torch.testing.assert_close(ours[0], adapted, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(ours[1], plain[1], rtol=tolerance, atol=tolerance)
    assert (adapted - plain[0]).abs().max() > 0.1


def test_adapters_no_request_uses_give_their_room_to_a_batch_that_needs_it(tiny_checkpoint, tmp_path):
    """A compute budget with room for a batch of three prompts and two adapters beside the model:
    a batch with a third adapter takes the room of those no request of it uses (their tokens
    unchanged when they come back); a batch that needs all three at once is refused before any
    work, the adapters named in the arithmetic, and the engine runs the next batch."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    loras = {}
    for i, name in enumerate("abc"):
        save_adapter(folder, tmp_path / name, ["q_proj", "v_proj", "down_proj"], seed=i + 1)
        loras[name] = LoRARequest(name, i + 1, str(tmp_path / name))
    prompts, policy = [[3, 17, 42, 9], [5, 6, 7], [8, 9, 10, 11, 12]], Policy(gpu_batch_size=4)

    def run(llm, *names):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[loras[n] for n in names])
        return [o.outputs[0].token_ids for o in outs]

    with LLM(folder, dtype="float32", enable_lora=True, policy=policy) as llm:
        want = {name: run(llm, name, name, name) for name in loras}
        report = llm.engine.memory.report()["gpu"]
        one = report["by_what"]["LoRA adapters"] // 3
        room = report["peak"] - one // 2  # the peak held all three adapters: room for two and a half
    t4 = HardwareSpec.resolve("t4", "hardware=")  # its budget: gpu_memory * memory_usable_fraction
    with LLM(folder, dtype="float32", enable_lora=True, policy=policy,
             hardware=dataclasses.replace(t4, gpu_memory=room / t4.memory_usable_fraction)) as llm:
        assert run(llm, "a", "a", "a") == want["a"] and run(llm, "b", "b", "b") == want["b"]
        assert list(llm.engine.loras.loaded) == [1, 2]
        assert run(llm, "c", "c", "c") == want["c"]
        assert list(llm.engine.loras.loaded) == [3]  # a and b, idle, gave their room
        assert run(llm, "b", "a", "b") == [want["b"][0], want["a"][1], want["b"][2]]
        with pytest.raises(MemoryBudgetError, match=f"LoRA adapters .* \\({3 * one} bytes\\)"):
            run(llm, "a", "b", "c")
        assert run(llm, "c", "c", "c") == want["c"]


def test_a_large_adapter_read_where_room_is_short_drops_the_least_recently_requested_idle_one(tiny_checkpoint,
                                                                                               tmp_path):
    """Adapters larger than a pass's headroom, room for one and a half: reading the next drops the
    least recently requested adapter that no queued request uses, as the read happens (the batch
    being made keeps its own); its tokens are unchanged. An adapter the batch being made holds is
    never dropped: a second one in the same batch is that request's refusal, saying why."""
    folder, _ = tiny_checkpoint("llama_gqa_untied")
    loras = {}
    for i, name in enumerate("abc"):
        save_adapter(folder, tmp_path / name, TARGETS["llama_gqa_untied"][0], seed=i + 1, r=64)
        loras[name] = LoRARequest(name, i + 1, str(tmp_path / name))
    prompt, policy = [[3, 17, 42, 9]], Policy(gpu_batch_size=2)

    def run(llm, *names, on_error="raise"):
        outs = llm.generate(prompt * len(names), GREEDY, use_tqdm=False, on_error=on_error,
                            lora_request=[loras[n] for n in names])
        return [o.error or o.outputs[0].token_ids for o in outs]

    with LLM(folder, dtype="float32", enable_lora=True, policy=policy) as llm:
        want = {name: run(llm, name)[0] for name in loras}
        report = llm.engine.memory.report()["gpu"]
        one = report["by_what"]["LoRA adapters"] // 3
        room = report["peak"] - 3 * one + one + one // 2
        assert report["peak_by_what"]["largest pass (activations)"] < one // 2  # reads, not layouts, drop
    t4 = HardwareSpec.resolve("t4", "hardware=")
    with LLM(folder, dtype="float32", enable_lora=True, policy=policy,
             hardware=dataclasses.replace(t4, gpu_memory=room / t4.memory_usable_fraction)) as llm:
        assert run(llm, "a") == [want["a"]] and run(llm, "b") == [want["b"]] and run(llm, "c") == [want["c"]]
        assert list(llm.engine.loras.loaded) == [3]
        got = run(llm, "a", "b", on_error="record")
        assert got[0] == want["a"] and "LoRA adapter 'b'" in got[1] and "the 1 held are all in use" in got[1]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gptq_or_awq_base_serves_adapters_as_peft_does_on_its_weights(tmp_path, method):
    """A 4-bit GPTQ / AWQ checkpoint as the base (its codes kept as they are): an adapter trained on
    the model those codes are gives PEFT's logits, a prompt without one the base model's."""
    from tests.flexsarathi.formats.test_quantized_checkpoint import packed_checkpoint

    folder, ref = packed_checkpoint(tmp_path / "base", "llama", method, 4, 32, sym=method == "gptq")
    model = adapt(ref, tmp_path / "a", ["q_proj", "v_proj", "gate_proj", "down_proj"], seed=6)
    with LLM(folder, dtype="float32", device="cpu", cpu_matmul="dequantize", enable_lora=True) as llm:
        ours = prompt_logits(llm, PROMPTS[:2], [LoRARequest("a", 1, str(tmp_path / "a")), None])
    assert_adapted_then_plain(ours, model, PROMPTS[:2], tolerance=1e-3)


def test_embeddings_with_adapters_are_pefts_last_hidden_states(two_adapters, tmp_path):
    """LLM(task="embed", enable_lora=True).embed(..., lora_request=...): each prompt's embedding the
    PEFT model's normalized last hidden state (the base model's without an adapter); a batch file's
    embedding lines naming an adapter by "model" give the same vectors."""
    from flexsarathi.cli.main import main

    folder, base, adapters = two_adapters("llama_gqa_untied")
    names = ["a", None, "b"]
    with LLM(folder, dtype="float32", task="embed", enable_lora=True) as llm:
        got = llm.embed(PROMPTS[:3], use_tqdm=False, lora_request=[adapters[n][0] if n else None for n in names])
    for prompt, name, out in zip(PROMPTS, names, got):
        hf = adapters[name][1].base_model.model if name else base
        with torch.no_grad():
            want = torch.nn.functional.normalize(hf.model(torch.tensor([prompt])).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, rtol=1e-4, atol=1e-5)
    assert got[0].outputs.embedding != got[1].outputs.embedding
    job, out = tmp_path / "embed.jsonl", tmp_path / "out.jsonl"
    job.write_text("".join(json.dumps({"id": f"e{i}", "input": [p], **({"model": n} if n else {})}) + "\n"
                           for i, (p, n) in enumerate(zip(PROMPTS, names))))
    modules = ["--lora-modules", f"a={adapters['a'][0].lora_path}", f"b={adapters['b'][0].lora_path}"]
    assert main(["generate", "--model", folder, "--input", str(job), "--output", str(out), "--dtype", "float32",
                 "--quiet", *modules]) == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i, o in enumerate(got):
        torch.testing.assert_close(torch.tensor(records[f"e{i}"]["embeddings"][0]), torch.tensor(o.outputs.embedding))


def test_classification_with_an_adapter_gives_pefts_probabilities(tmp_path):
    """LLM(task="classify", enable_lora=True).classify(..., lora_request=...): the softmax of the
    PEFT-adapted classifier's logits, and the base classifier's without an adapter."""
    from tests.flexsarathi.engine.test_classify import build_classifier

    model = build_classifier("llama_gqa_untied", 3)
    model.save_pretrained(tmp_path / "cls", safe_serialization=True)
    adapted = adapt(model, tmp_path / "a", ["q_proj", "o_proj", "up_proj"], seed=7)
    with LLM(str(tmp_path / "cls"), dtype="float32", task="classify", enable_lora=True) as llm:
        got = llm.classify(PROMPTS[:2], use_tqdm=False, lora_request=[LoRARequest("a", 1, str(tmp_path / "a")), None])
    with torch.no_grad():
        want = [torch.softmax(adapted(torch.tensor([PROMPTS[0]])).logits[0], -1)]
        with adapted.disable_adapter():
            want.append(torch.softmax(adapted(torch.tensor([PROMPTS[1]])).logits[0], -1))
            unadapted = torch.softmax(adapted(torch.tensor([PROMPTS[0]])).logits[0], -1)
    for out, probs in zip(got, want):
        torch.testing.assert_close(torch.tensor(out.outputs.probs), probs, rtol=1e-4, atol=1e-5)
    assert (want[0] - unadapted).abs().max() > 1e-3  # the adapter changes the first: the comparison could fail
