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

pytest.importorskip("xgrammar")

# A nested object with an enum, an array and required fields; strings bounded so that a 260K-
# parameter model cannot wander inside one for its whole max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "mood": {"enum": ["happy", "sad", "angry"]},
        "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 10},
                                                  "size": {"enum": ["big", "small"]}},
                 "required": ["town", "size"], "additionalProperties": False},
    },
    "required": ["name", "mood", "friends", "home"],
    "additionalProperties": False,
}
PROMPTS = ["Once upon a time", "Lily wanted to", "The little dog", "One day, a big bird", "Tom and Sue"]
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


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
    kinds = {"regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6} (is|was) (happy|sad)\."),
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
