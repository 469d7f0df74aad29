"""A checkpoint folder's tokenizer files (generation_config.json, tokenizer_config.json,
chat_template.jinja, tokenizer.json): every EOS id generation_config.json lists ends generation as
in transformers, and a bad file or field is one CheckpointError naming them, at load."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flexsarathi.errors import CheckpointError
from flexsarathi.formats.tokenizer import Tokenizer, load_tokenizer
from flexsarathi.models.model_config import ModelConfig

PROMPT = "Once upon a time"
BASELINE = [432, 383, 286, 261, 376, 298, 315, 421]  # stories260K's greedy continuation of PROMPT


def _folder(stories_dir: str, tmp_path: Path, files: dict | None = None) -> Path:
    """stories260K copied into tmp_path, each of `files` (name -> JSON object, or bytes) written over it."""
    folder = tmp_path / "stories"
    shutil.copytree(stories_dir, folder)
    for name, content in (files or {}).items():
        data = content if isinstance(content, bytes) else json.dumps(content).encode()
        (folder / name).write_bytes(data)
    return folder


def _stories_json(stories_dir: str, name: str, **edit) -> dict:
    return {**json.loads((Path(stories_dir) / name).read_text()), **edit}


def test_every_generation_config_eos_id_is_an_eos_id(stories_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _folder(stories_dir, tmp_path, {"generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 383]}})
    ours = load_tokenizer(str(folder), ModelConfig.from_folder(folder))
    assert ours.eos_token_ids == (2, 383) and ours.eos_token_id == 2
    hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"]
    assert ids == ours.encode(PROMPT)
    out = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert out == BASELINE[:2]  # transformers stops at 383, the second id
    assert out[-1] in ours.eos_token_ids and not set(out[:-1]) & set(ours.eos_token_ids)


def test_generation_stops_at_any_generation_config_eos_id(stories_dir, tmp_path):
    from flexsarathi import LLM, SamplingParams

    folder = _folder(stories_dir, tmp_path, {"generation_config.json": {"bos_token_id": 1, "eos_token_id": [2, 383]}})
    with LLM(str(folder), dtype="float32") as llm:
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert out.token_ids == BASELINE[:2]


BAD = [
    ("generation_config.json", {"eos_token_id": "2"}, r"generation_config\.json: eos_token_id must be an integer, "
                                                      r"got '2'"),
    ("generation_config.json", {"eos_token_id": [2, "383"]}, r"generation_config\.json: eos_token_id\[1\] must be "
                                                             r"an integer, got '383'"),
    ("generation_config.json", {"eos_token_id": -2}, r"generation_config\.json: eos_token_id must be an integer "
                                                     r">= 0, got -2"),
    ("generation_config.json", {"bos_token_id": "1"}, r"generation_config\.json: bos_token_id must be an integer, "
                                                      r"got '1'"),
    ("generation_config.json", [1], r"generation_config\.json: expected a JSON object, got a list"),
    ("tokenizer_config.json", [1], r"tokenizer_config\.json: expected a JSON object, got a list"),
    ("tokenizer_config.json", b'{"eos_token": "caf\xe9"}', r"tokenizer_config\.json is not UTF-8 text "
                                                           r"\(byte 0xe9 at offset 18\)"),
    ("tokenizer_config.json", {"add_bos_token": "false"}, r"tokenizer_config\.json: add_bos_token must be true or "
                                                          r"false, got 'false'"),
    ("tokenizer_config.json", {"add_eos_token": 1}, r"tokenizer_config\.json: add_eos_token must be true or false, "
                                                    r"got 1"),
    ("tokenizer_config.json", {"chat_template": 5}, r"tokenizer_config\.json: chat_template must be a string or a "
                                                    r"list of named templates, got int"),
    ("chat_template.jinja", b"{{ messages }} caf\xe9", r"chat_template\.jinja is not UTF-8 text \(byte 0xe9 at "
                                                      r"offset 18\)"),
]


@pytest.mark.parametrize("name, content, message", BAD, ids=[f"{n}-{c!r}" for n, c, _ in BAD])
def test_a_bad_tokenizer_file_is_one_load_error(stories_dir, tmp_path, name, content, message):
    folder = _folder(stories_dir, tmp_path, {name: content})
    with pytest.raises(CheckpointError, match=message):
        Tokenizer.from_folder(str(folder), 1, 2)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_a_load_error(stories_dir, tmp_path):
    spec = _stories_json(stories_dir, "tokenizer.json")
    spec["added_tokens"].append({"id": 512, "content": "<extra>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    folder = _folder(stories_dir, tmp_path, {"tokenizer.json": spec})
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: the tokenizer has token id 512, outside the "
                                              r"model's vocabulary \(config\.json vocab_size=512\)"):
        load_tokenizer(str(folder), ModelConfig.from_folder(folder))


def test_null_flags_in_tokenizer_config_are_the_defaults(stories_dir, tmp_path):
    """"add_bos_token": null (as some tokenizer_config.json files write absent values) is the
    default, not an error: the same ids as the untouched folder's tokenizer."""
    from flexsarathi.formats.tokenizer import Tokenizer

    edited = _stories_json(stories_dir, "tokenizer_config.json", add_bos_token=None, add_eos_token=None)
    folder = _folder(stories_dir, tmp_path, {"tokenizer_config.json": edited})
    assert Tokenizer.from_folder(str(folder)).encode("Once upon a time") == \
        Tokenizer.from_folder(stories_dir).encode("Once upon a time")


CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def chat_folder(stories_dir, tmp_path) -> Path:
    return _folder(stories_dir, tmp_path, {"tokenizer_config.json": _stories_json(
        stories_dir, "tokenizer_config.json", chat_template=CHAT_TEMPLATE)})


def test_openai_content_parts_render_as_their_joined_text(chat_folder):
    """OpenAI's content forms, as vLLM's "string" content format renders them: a list of text parts
    is their texts joined by newlines; an assistant message of tool calls has null content (its
    other fields reach the template). Reference: transformers on the plain-string messages."""
    from transformers import AutoTokenizer

    parts = [{"role": "user", "content": [{"type": "text", "text": "A story"}, {"type": "text", "text": "of a dog"}]},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]},
             {"role": "tool", "content": "ok", "tool_call_id": "1"}]
    plain = [{"role": "user", "content": "A story\nof a dog"}, {"role": "assistant", "content": ""},
             {"role": "tool", "content": "ok"}]
    ref = AutoTokenizer.from_pretrained(chat_folder).apply_chat_template(plain, add_generation_prompt=True,
                                                                         tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref  # a BatchEncoding in newer transformers
    assert Tokenizer.from_folder(str(chat_folder)).apply_chat_template(parts) == list(ref)


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     r"messages\[1\]\.content\[0\] must be a text part .* \(this engine reads text only\), got a part of type "
     r"'image_url'"),
    ({"role": "user", "content": ["hi"]}, r"messages\[1\]\.content\[0\] must be a text part .*got 'hi'"),
    ({"role": "user", "content": [{"type": "text", "text": 5}]}, r"messages\[1\]\.content\[0\]\.text must be a "
                                                                 r"string, got int"),
    ({"role": "user", "content": None}, r"messages\[1\]\.content must be a string or a list of text parts, "
                                        r"got null"),
    ({"role": "user", "content": 3}, r"messages\[1\]\.content must be a string .*, got int"),
    ({"content": "hi"}, r"messages\[1\]\.role must be a non-empty string, got None"),
    ("hi", r"messages\[1\] must be an object with \"role\" and \"content\", got str"),
])
def test_a_bad_chat_message_names_the_message_and_its_field(chat_folder, message, error):
    from flexsarathi.errors import FlexSarathiError

    tokenizer = Tokenizer.from_folder(str(chat_folder))
    with pytest.raises(FlexSarathiError, match=error):
        tokenizer.apply_chat_template([{"role": "system", "content": "be brief"}, message])


THINKING_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>{% endif %}{% endif %}")


@pytest.mark.parametrize("options", [
    {"add_generation_prompt": False},
    {"add_generation_prompt": True, "enable_thinking": True},
    {"add_generation_prompt": False, "continue_final_message": True},
    {"add_generation_prompt": False, "continue_final_message": True, "enable_thinking": True},
], ids=["no-generation-prompt", "template-kwargs", "continue-final", "continue-final-kwargs"])
def test_chat_options_render_as_transformers_renders_them(stories_dir, tmp_path, options):
    """add_generation_prompt, continue_final_message (the last message left open: its end-of-turn
    dropped) and the template's own variables (chat_template_kwargs): transformers' tokens."""
    from transformers import AutoTokenizer

    folder = _folder(stories_dir, tmp_path, {"tokenizer_config.json": _stories_json(
        stories_dir, "tokenizer_config.json", chat_template=THINKING_TEMPLATE)})
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
    ref = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=True, **options)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    kwargs = {k: v for k, v in options.items() if k not in ("add_generation_prompt", "continue_final_message")}
    ours = Tokenizer.from_folder(str(folder)).apply_chat_template(
        messages, options["add_generation_prompt"], options.get("continue_final_message", False), kwargs)
    assert ours == list(ref)


@pytest.mark.parametrize("call, error", [
    (dict(add_generation_prompt=True, continue_final_message=True), "set add_generation_prompt to false to continue"),
    (dict(add_generation_prompt="yes"), "add_generation_prompt must be true or false, got 'yes'"),
    (dict(add_generation_prompt=False, chat_template_kwargs={"bos_token": "x"}),
     r"chat_template_kwargs may not set \['bos_token'\]: the engine passes them itself"),
    (dict(add_generation_prompt=False, chat_template_kwargs=["x"]), "chat_template_kwargs must be an object"),
    (dict(add_generation_prompt=False, continue_final_message=True, final=" "),
     "the final message is empty, so there is nothing to continue"),
])
def test_chat_options_that_cannot_render_are_one_error(chat_folder, call, error):
    from flexsarathi.errors import FlexSarathiError

    final = call.pop("final", "Once upon a")
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": final}]
    with pytest.raises(FlexSarathiError, match=error):
        Tokenizer.from_folder(str(chat_folder)).apply_chat_template(messages, **call)


def test_a_text_the_context_cannot_hold_is_refused_before_it_is_encoded(stories_dir):
    """open_model tells the tokenizer the model's context: a text with more characters than that many
    tokens could stand for is refused, naming its size, before the tokenizers library holds ~100
    bytes per character of it (VmHWM of a child process: a 20-million-character line). The bound is
    one: any `context` tokens decode to a text it passes. A document read in windows is encoded whole."""
    import subprocess
    import sys

    from flexsarathi.errors import FlexSarathiError
    from flexsarathi.formats.opened_model import open_model
    from tests.conftest import REPO

    tok = open_model(stories_dir).tokenizer
    context = tok.context_tokens
    assert context == ModelConfig.from_folder(stories_dir).max_position_embeddings
    generator = torch.Generator().manual_seed(0)
    vocab = tok.backend.get_vocab_size()
    longest = max(tok.backend.get_vocab(), key=len)
    for ids in [torch.randint(3, vocab, (context,), generator=generator).tolist() for _ in range(20)] + [
            [tok.backend.token_to_id(longest)] * context]:
        tok.check_fits(tok.decode(ids, skip_special_tokens=False))
    with pytest.raises(FlexSarathiError, match=rf"^the text is 10,000,000 characters, more than the model's "
                                               rf"context of {context} tokens can hold \(at most [\d,]+"):
        tok.encode("a " * 5_000_000)
    assert len(tok.encode("a " * 5_000, whole=True)) > context  # longer than the context, as perplexity reads
    child = ("import sys; from flexsarathi.formats.opened_model import open_model\n"
             "from flexsarathi.errors import FlexSarathiError\n"
             f"tok = open_model({stories_dir!r}).tokenizer; text = 'a ' * 10_000_000\n"
             "def hwm(): return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"
             "before = hwm()\n"
             "try:\n    tok.encode(text)\nexcept FlexSarathiError:\n    pass\n"
             "print(hwm() - before)")
    grown_kib = int(subprocess.run([sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True,
                                   check=True).stdout)
    assert grown_kib < 100 * 1024, f"the refused text grew the peak by {grown_kib} KiB"
