"""Structured outputs on stories260K: every constrained output parses and validates (jsonschema for
JSON schemas, re.fullmatch for regexes, membership for choices), in both schedulers, with n > 1;
unconstrained neighbours give the tokens they give alone (fp32); a grammar compiles once per
engine; a schema that cannot compile is that request's error; a matcher made for a sequence that
keeps outputs re-matches them; EOS is allowed only where the grammar is complete."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from flexsarathi import LLM, FlexSarathiError, SamplingParams
from flexsarathi.engine.sampling import StructuredOutputsParams
from flexsarathi.engine.structured_output import apply_grammar_masks
from policy_search import Policy
from tests.conftest import REPO

pytest.importorskip("xgrammar")

# A nested object with an enum, an array and required fields; strings bounded so that a 260K-
# parameter model cannot wander inside one for its whole max_tokens (scripts/bench_structured.py
# times the same schema).
SCHEMA = json.loads((REPO / "examples" / "story_schema.json").read_text())
PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog", "One day, a big bird", "Tom and Sue"]
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
WORDS = r"[A-Z][a-z]{2,6} (is|was) (happy|sad)\."  # bounded: it ends within max_tokens


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 150, "temperature": 0.8, "seed": 3, "structured_outputs": JSON, **kwargs})


@pytest.fixture(scope="module", params=["decode-maximal", "block"])
def stories(stories_dir, request):
    with LLM(stories_dir, dtype="float32", policy=Policy(gpu_batch_size=8, prefill_budget=8,
                                                         scheduler=request.param)) as llm:
        yield llm


def check_json(out) -> None:
    for completion in out.outputs:
        assert completion.finish_reason == "stop", completion.text
        obj = json.loads(completion.text)
        jsonschema.validate(obj, SCHEMA)
        assert list(obj) == [k for k in SCHEMA["properties"] if k in obj]  # the schema's order


def test_json_schema_outputs_validate_with_n_and_mixed_neighbours(stories):
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = stories.generate([PROMPTS[0], PROMPTS[2]], plain, use_tqdm=False)
    mixed = stories.generate(PROMPTS, [plain, constrained(n=2), plain, constrained(), constrained(temperature=0)],
                             use_tqdm=False)
    assert [m.token_ids for m in (mixed[0], mixed[2])] == [a.token_ids for a in alone]  # untouched by the masks
    for out in (mixed[1], mixed[3], mixed[4]):
        check_json(out)
    assert len(mixed[1].outputs) == 2 and mixed[1].outputs[0].text != mixed[1].outputs[1].text
    assert stories.engine.grammars.compiled == 1  # one schema, five sequences: compiled once


def test_each_kind_of_grammar_holds(stories):
    kinds = {"regex": StructuredOutputsParams(regex=WORDS),
             "choice": StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
             "grammar": StructuredOutputsParams(grammar='root ::= "The " animal " ran."\nanimal ::= "cat" | "dog" | "fox"'),
             "json_object": StructuredOutputsParams(json_object=True, disable_any_whitespace=True)}
    outs = stories.generate(PROMPTS[:4], [SamplingParams(max_tokens=120, temperature=0.8, seed=i, structured_outputs=s)
                                          for i, s in enumerate(kinds.values())], use_tqdm=False)
    regex, choice, grammar, obj = (o.text for o in outs)
    assert re.fullmatch(kinds["regex"].regex, regex)
    assert choice in ("yes", "no", "maybe so")
    assert re.fullmatch(r"The (cat|dog|fox) ran\.", grammar)
    assert all(o.finish_reason == "stop" for o in outs[:3])
    if outs[3].finish_reason == "stop":  # any JSON object: a small model may not close it in time
        assert isinstance(json.loads(obj), dict)


def test_a_schema_that_cannot_compile_is_that_requests_error(stories):
    bad = [SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json")),
           SamplingParams(structured_outputs=StructuredOutputsParams(regex="([a-z")),
           SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= missing_rule"))]
    outs = stories.generate(PROMPTS[:4], [*bad, constrained()], use_tqdm=False, on_error="record")
    for out, kind in zip(outs, ("json", "regex", "grammar")):
        assert out.error and f"structured_outputs.{kind} cannot be compiled" in out.error
    check_json(outs[3])
    with pytest.raises(FlexSarathiError, match="structured_outputs.regex cannot be compiled"):
        stories.generate(PROMPTS[0], bad[1], use_tqdm=False)


def test_a_grammar_that_ends_before_min_tokens_stops_there(stories):
    """min_tokens past what the grammar allows (a one-word choice, a one-letter regex): the grammar
    wins, as its EOS is the only token it allows: the sequence stops with its complete output
    (an xgrammar matcher asked for a mask after its end failed the whole batch)."""
    params = [SamplingParams(max_tokens=8, min_tokens=6, temperature=t, seed=1, structured_outputs=s)
              for t in (0, 0.9) for s in ({"choice": ["no"]}, {"regex": "a"})]
    outs = stories.generate(PROMPTS[:4], params, use_tqdm=False)
    eos = stories.tokenizer.eos_token_id
    assert [o.text for o in outs] == ["no", "a", "no", "a"]
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos


def test_a_request_whose_rules_leave_no_token_fails_alone(stories):
    """A choice whose end (EOS) bad_words bar: after "no" nothing is allowed. That request fails
    with an error saying so (it took token 0 and failed the batch in the grammar matcher before);
    its neighbour gives the tokens it gives alone."""
    plain = SamplingParams(max_tokens=6, temperature=0)
    alone = stories.generate(PROMPTS[1], plain, use_tqdm=False)[0]
    for temperature in (0, 0.9):
        stuck = SamplingParams(max_tokens=6, temperature=temperature, seed=2, structured_outputs={"choice": ["no"]},
                               bad_words=["</s>"])
        outs = stories.generate(PROMPTS[:2], [stuck, plain], use_tqdm=False, on_error="record")
        assert outs[0].error and "no token may follow output token 2" in outs[0].error
        assert not outs[0].refused  # it failed in a pass, not before
        assert outs[1].error is None and outs[1].token_ids == alone.token_ids


def test_eos_only_where_the_grammar_is_complete_and_a_kept_prefix_is_rematched(stories):
    out = stories.generate(PROMPTS[0], constrained(temperature=0), use_tqdm=False)[0]
    engine, eos = stories.engine, stories.tokenizer.eos_token_id
    assert out.token_ids[-1] == eos
    vocab = engine.config.vocab_size
    for k in (0, 5, len(out.token_ids) - 2, len(out.token_ids) - 1):
        seq = engine.make_sequence(out.prompt_token_ids, constrained(temperature=0))
        seq.output_token_ids = list(out.token_ids[:k])  # kept outputs, as after a preemption or resume
        allowed = torch.isfinite(apply_grammar_masks(torch.zeros(1, vocab), [seq])[0])
        assert allowed[out.token_ids[k]]  # the token the uninterrupted run took next
        assert bool(allowed[eos]) == (k == len(out.token_ids) - 1)  # EOS only once the JSON is whole
    with pytest.raises(FlexSarathiError, match="ignore_eos cannot be set with structured_outputs"):
        constrained(ignore_eos=True)


def _kept_prefix_rows(llm, k_values: tuple[int, ...]) -> list:
    """Sequences as a step sees them: one constrained sequence per k holding the first k tokens
    of a greedy constrained run, and between them one without a grammar."""
    out = llm.generate(PROMPTS[1], constrained(temperature=0), use_tqdm=False)[0]
    seqs = []
    for k in k_values:
        seq = llm.engine.make_sequence(out.prompt_token_ids, constrained(temperature=0))
        seq.output_token_ids = list(out.token_ids[:k])
        seqs += [seq, llm.engine.make_sequence(out.prompt_token_ids, SamplingParams(max_tokens=4))]
    return seqs


def test_the_mask_is_what_the_matcher_accepts_and_rows_without_a_grammar_are_untouched(stories):
    """apply_grammar_masks (the bitmask filled on the host, applied by xgrammar's kernel on the
    logits' device, here the CPU) against a reference token by token: a matcher fed the kept
    outputs accepts the token (then rolls it back). Allowed logits keep their values, rows without
    a grammar are the model's, and the model's logits are not written (raw logprobs read them)."""
    import xgrammar

    seqs = _kept_prefix_rows(stories, (0, 3, 9))
    vocab = stories.engine.config.vocab_size
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    masked = apply_grammar_masks(logits, seqs)
    assert torch.equal(logits, before)
    for row, seq in enumerate(seqs):
        if seq.grammar is None:
            assert torch.equal(masked[row], logits[row])
            continue
        matcher = xgrammar.GrammarMatcher(seq.grammar.compiled)
        for token in seq.output_token_ids:
            assert matcher.accept_token(token)
        accepted = []
        for token in range(vocab):
            accepted.append(matcher.accept_token(token))
            if accepted[-1]:
                matcher.rollback(1)
        allowed = torch.tensor(accepted)
        assert 0 < int(allowed.sum()) < vocab
        assert torch.equal(torch.isfinite(masked[row]), allowed)
        assert torch.equal(masked[row][allowed], logits[row][allowed])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_masks_and_a_constrained_job_give_the_cpu_results(stories_dir):
    """On CUDA the bitmask is copied to the device once per step (pinned, asynchronous: no host
    sync) and applied there by xgrammar's Triton kernel: the masked logits are the CPU's exactly.
    A mixed constrained job on CUDA, its decode passes replayed from CUDA graphs, gives outputs
    that parse and validate and the CPU run's tokens (fp32)."""
    # n = 1 everywhere: a pass holding a parent with forks runs eagerly (graph_passes.py)
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), constrained(seed=4),
              constrained(temperature=0), constrained(seed=5, structured_outputs=StructuredOutputsParams(regex=WORDS)),
              constrained(seed=9)]
    tokens, masked = {}, {}
    for device in ("cpu", "cuda"):
        policy = Policy(gpu_batch_size=8, prefill_budget=8)
        with LLM(stories_dir, dtype="float32", device=device, policy=policy) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            tokens[device] = [[c.token_ids for c in o.outputs] for o in outs]
            for out in (outs[1], outs[2], outs[4]):
                check_json(out)
            assert re.fullmatch(WORDS, outs[3].text)
            seqs = _kept_prefix_rows(llm, (0, 4, 11))
            logits = torch.randn(len(seqs), llm.engine.config.vocab_size, generator=torch.Generator().manual_seed(1))
            if device == "cuda":
                assert llm.engine.stats["graph_passes"] > 0  # the sampler read logits copied out of a graph
                logits = logits.cuda()
                apply_grammar_masks(logits, seqs)  # the Triton kernel compiles on its first call
                torch.cuda.set_sync_debug_mode("error")  # a blocking (pageable) host -> device copy raises
                try:
                    masked[device] = apply_grammar_masks(logits, seqs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                assert masked[device].device.type == "cuda"
            else:
                masked[device] = apply_grammar_masks(logits, seqs)
    assert tokens["cuda"] == tokens["cpu"]
    assert torch.equal(masked["cuda"].cpu(), masked["cpu"])


def test_a_row_dropped_for_non_finite_logits_takes_its_bitmask_row_along(stories, monkeypatch):
    """The engine fills the step's bitmask before it drops rows whose logits are not finite: the
    constrained rows after a dropped one keep their own masks (their outputs are the clean run's)."""
    from flexsarathi.engine.llm_engine import LLMEngine

    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), constrained(), constrained(temperature=0)]
    clean = stories.generate(PROMPTS[:3], params, use_tqdm=False)
    poisoned_ids = clean[0].prompt_token_ids
    forward = LLMEngine.forward

    def poisoned(self, plan):
        outputs = forward(self, plan)
        for item, logits in outputs:
            if item.seq.prompt_token_ids == poisoned_ids and len(item.seq.output_token_ids) == 2:  # decoding
                with torch.inference_mode():  # the logits are inference tensors
                    logits[-1, 0] = float("inf")
        return outputs

    monkeypatch.setattr(LLMEngine, "forward", poisoned)
    bad, *rest = stories.generate(PROMPTS[:3], params, use_tqdm=False, on_error="record")
    assert "logits for output token 3 are not finite" in bad.error
    for got, ref in zip(rest, clean[1:]):
        check_json(got)
        assert got.token_ids == ref.token_ids
