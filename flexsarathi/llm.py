"""`LLM`: the offline batch API, in vLLM's vocabulary.

    llm = LLM("path/to/checkpoint")          # or "dummy:opt-1.3b"
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import time
from typing import Callable, Iterator, Sequence as Seq

from tqdm.auto import tqdm

from flexsarathi.batch_turns import BatchTurns
from flexsarathi.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from flexsarathi.engine.lora_requests import LoRARequest
from flexsarathi.engine.pooling import POOLING_TASKS, ClassificationRequestOutput, EmbeddingRequestOutput, PoolingParams
from flexsarathi.engine.running_fit import policy_or_default
from flexsarathi.machine.this_machine import this_machine_hardware
from flexsarathi.errors import FlexSarathiError
from flexsarathi.formats.hub import resolve_model
from flexsarathi.formats.opened_model import OpenedModel, open_model
from flexsarathi.engine.planner_spec import planned_model
from flexsarathi.engine.sampling import SamplingParams
from offload.memory import TierBudget
from policy_search.hardware import HardwareSpec
from policy_search.policy import Policy
from policy_search.workload import Workload

Prompt = str | list[int] | dict  # dict: vLLM's {"prompt": ...} / {"prompt_token_ids": ...}


class LLM:
    def __init__(self, model: str | OpenedModel, dtype=None, device=None, policy: Policy | str | None = None,
                 seed: int = 0, kv_block_size: int | None = None, hardware=None, offload_dir: str | None = None,
                 compress_weight: bool | None = None, compress_kv: bool | None = None,
                 direct_io: bool = True, workload=None, **engine_options):
        """model: a checkpoint folder, a `.gguf` file (single or any part of a split one), a Hugging Face
        repo (`org/name`, `org/name@revision`, `org/name:Q4_K_M` for a GGUF in it: flexsarathi/formats/hub.py)
        or `dummy:<name>`, or one already opened (`open_model`). policy: a Policy, a policy JSON file,
        "auto" (searched by policy_search for `hardware`, without one this machine measured once and
        cached, and `workload`, a policy_search.Workload, default prompt 512 / output 32), or None (everything on the compute device, each batch running as many
        sequences as its memory holds, up to 256: flexsarathi/engine/running_fit.py). hardware: a HardwareSpec, a preset name (`t4`,
        `a100-80g`, ...) or a profile JSON: its memory limits are the tier budgets the engine
        enforces. offload_dir: where disk-tier weights, KV and activations live (default
        ~/.cache/flexsarathi/offload; placed weights are reused across runs). engine_options
        go to EngineConfig (weight_quant, kv_bits, kv_value_group: the compression formats)."""
        self._turns = BatchTurns()  # one batch at a time: a call from another thread waits for the one running
        self._closing = False  # close() was called: a running generate ends after its pass
        model, policy, hardware = _check_llm_arguments(model, policy, hardware, seed, kv_block_size, engine_options)
        _check_workload(workload, policy)
        opened = model if isinstance(model, OpenedModel) else None
        model = opened.name if opened else resolve_model(model)  # "org/name" -> its folder in the HF cache
        if opened is not None and opened.lora is not None:
            engine_options.setdefault("lora", opened.lora)  # the adapter it was opened with
        elif isinstance(engine_options.get("lora"), str):  # an adapter's hub name too
            engine_options["lora"] = resolve_model(engine_options["lora"])
        spec = None
        if hardware is not None:
            spec = hardware if isinstance(hardware, HardwareSpec) else HardwareSpec.resolve(hardware, "hardware=")
        if policy == "auto":
            spec = spec or this_machine_hardware(LLM, dtype, device, offload_dir)  # no hardware: this machine's
            if opened is None and os.path.exists(model):
                opened = open_model(model, lora=engine_options.get("lora"))  # once: the search reads its config
            formats = {k: v for k, v in engine_options.items()
                       if k in ("weight_quant", "kv_bits", "kv_value_group", "compress_head")}
            formats["kv_block_size"] = kv_block_size
            policy = self.search_policy(opened or model, spec, workload, dtype, device=device, formats=formats,
                                        task=engine_options.get("task", "generate"))
        elif isinstance(policy, str):
            policy = Policy.load(policy)
        policy = policy_or_default(policy, engine_options)  # None: as many running as memory holds
        overrides = {k: v for k, v in (("compress_weight", compress_weight), ("compress_kv", compress_kv))
                     if v is not None}
        if overrides:
            policy = policy.replace(**overrides)
        budget = None if spec is None else TierBudget(
            **{tier: int(b) for tier, b in spec.budgets().items()},
            host=None if spec.host_budget is None else int(spec.host_budget))
        self.engine = LLMEngine(EngineConfig(model, dtype=dtype, device=device, policy=policy, seed=seed,
                                             kv_block_size=kv_block_size, budget=budget, offload_dir=offload_dir,
                                             direct_io=direct_io, **engine_options), opened)
        self.last_stats: dict = {}

    @staticmethod
    def search_policy(model: str | OpenedModel, hardware, workload, dtype, device=None, formats: dict | None = None,
                      task: str = "generate", **constraints) -> Policy:
        """policy_search's best policy for this model, hardware and workload (constraints: see
        policy_search.search, e.g. scheduler="block"; formats: planned_model's options). Without a
        workload: prompts of 512 tokens (fewer where the context is shorter), 32 generated (an
        embedding engine's: 1, the pooled row)."""
        from policy_search import Workload, search

        if hardware is None:
            raise FlexSarathiError('policy="auto" needs hardware= (a preset such as "t4", or a profile '
                                   'written by `flexsarathi profile`)')
        planned = planned_model(model, dtype, device=device, **(formats or {}))
        if workload is None:
            gen = 1 if task in POOLING_TASKS else 32
            workload = Workload(prompt_len=max(1, min(512, planned.spec.max_positions - gen)), gen_len=gen)
        policy, _ = search(planned.spec, hardware, workload, **planned.search_constraints(constraints))
        return policy

    def close(self) -> None:
        """Release the engine: I/O threads, disk-store files, KV pools, working buffers. Also
        called on leaving a `with LLM(...) as llm:` block. Idempotent. Called from another thread
        while a generate runs, it lets that pass end, the generate then raises FlexSarathiError
        (what finished was given), and the engine closes. A generate_iter suspended at a yield
        (its caller holding it, not iterating) does not hold it up: the engine closes at once, and
        that iterator, resumed, gives the rest of its last pass's outputs, then the same error
        where prompts did not finish."""
        self._closing = True
        if self._turns.held_here():  # inside this thread's own generate_iter
            self.engine.close()
            return
        with self._turns.turn(take_suspended=True):  # flexsarathi/batch_turns.py
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, on_error: str = "raise",
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One output per prompt, in prompt order. Prompts are strings or lists of token ids.
        on_error="record": a request that cannot run (empty, beyond the context, text without a
        tokenizer, ...) or fails in a pass (non-finite logits) yields an output whose `.error`
        says why; the others run. "raise": the first such request raises FlexSarathiError (a
        refused one before any work). lora_request (an LLM of enable_lora=True): the LoRA adapter
        of every prompt, or one per prompt (None: the base model), as vLLM takes it."""
        results = dict(self.generate_iter(prompts, sampling_params, use_tqdm, on_error, lora_request=lora_request))
        return [results[i] for i in range(len(results))]

    def chat(self, messages: list[dict] | Seq[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None,
             on_error: str = "raise", tools: list[dict] | None = None,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of OpenAI chat messages) or a list of them,
        each rendered by the checkpoint's chat template (or `chat_template`, a jinja2 string) with
        these options (Tokenizer.render_chat) and generated as `generate` does; one RequestOutput
        per conversation, its `prompt` the rendered text. tools: OpenAI's tool objects, shown to the
        model as its template writes them (read a reply's calls with
        flexsarathi.formats.tool_calls.read_tool_calls). on_error="record": a conversation that
        cannot render is an output whose `.error` says why (refused), the others run; "raise": it
        raises, naming the conversation. lora_request: as generate takes it, one per conversation."""
        if self.tokenizer is None:
            raise FlexSarathiError("LLM.chat needs the checkpoint's tokenizer (tokenizer.json) and chat template")
        conversations = [messages] if _one_conversation(messages) else list(messages)
        params = _per_conversation(sampling_params, len(conversations))
        texts, ids, refused = {}, {}, {}
        for i, conversation in enumerate(conversations):
            try:
                texts[i] = self.tokenizer.render_chat(conversation, add_generation_prompt, continue_final_message,
                                                      chat_template_kwargs, template=chat_template, tools=tools)
                ids[i] = self.tokenizer.encode(texts[i], add_special_tokens=False)
            except FlexSarathiError as exc:
                if on_error != "record":
                    raise FlexSarathiError(f"conversation {i}: {exc}") from None
                refused[i] = str(exc)
                texts.pop(i, None)
        rendered = sorted(ids)
        adapters = _per_prompt_lora(lora_request, len(conversations))
        outputs = iter(self.generate(
            [{"prompt_token_ids": ids[i]} for i in rendered],
            params if not isinstance(params, list) else [params[i] for i in rendered], use_tqdm, on_error,
            [adapters[i] for i in rendered]) if rendered else [])
        results = []
        for i in range(len(conversations)):
            if i in refused:
                results.append(_refused_output(None, refused[i]))
            else:
                results.append(dataclasses.replace(next(outputs), prompt=texts[i]))
        return results

    def generate_iter(self, prompts: Prompt | Seq[Prompt],
                      sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                      use_tqdm: bool = True, on_error: str = "raise",
                      stop: Callable[[], bool] | None = None,
                      lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                      ) -> Iterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as requests finish (refused ones first): what a caller that
        writes results as they come (the CLI) iterates. `last_stats` is set when it ends.
        stop: asked after every pass; True ends the run there (the unfinished requests are
        dropped, the finished ones were yielded): how a server cancels a batch at a pass boundary.
        lora_request: as generate takes it."""
        prompts, params = _check_arguments(prompts, sampling_params, on_error)
        adapters = _per_prompt_lora(lora_request, len(prompts))
        task = self.engine.engine_config.task
        if task in POOLING_TASKS:
            verb = {"embed": "embeds", "classify": "classifies"}[task]
            raise FlexSarathiError(f'this LLM {verb} (task="{task}"): call LLM.{task}, or build another LLM to '
                                   'generate')
        yield from self._requests_iter(prompts, params, None, use_tqdm, on_error, stop, adapters)

    def embed(self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
              use_tqdm: bool = True, on_error: str = "raise",
              lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed (needs LLM(model, task="embed")): one EmbeddingRequestOutput per prompt,
        in prompt order, its `.outputs.embedding` the final hidden state of the prompt's last token
        (engine/pooling.py); prompts are prefilled as generate prefills them (chunked, offloaded,
        many per pass). on_error and lora_request as generate's."""
        results = dict(self.embed_iter(prompts, pooling_params, use_tqdm, on_error, lora_request=lora_request))
        return [results[i] for i in range(len(results))]

    def embed_iter(self, prompts: Prompt | Seq[Prompt],
                   pooling_params: PoolingParams | Seq[PoolingParams] | None = None, use_tqdm: bool = True,
                   on_error: str = "raise", stop: Callable[[], bool] | None = None,
                   lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                   ) -> Iterator[tuple[int, EmbeddingRequestOutput]]:
        """(prompt index, output) as embeddings finish: generate_iter's counterpart."""
        if self.engine.engine_config.task != "embed":
            raise FlexSarathiError('LLM.embed needs an LLM built to embed: LLM(model, task="embed")')
        prompts, poolings = _check_pooling_arguments(prompts, pooling_params, on_error)
        params, adapters = [_PROMPT_ONLY] * len(prompts), _per_prompt_lora(lora_request, len(prompts))
        yield from self._requests_iter(prompts, params, poolings, use_tqdm, on_error, stop, adapters)

    def classify(self, prompts: Prompt | Seq[Prompt], use_tqdm: bool = True, on_error: str = "raise",
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify (needs LLM(model, task="classify") on a *ForSequenceClassification
        checkpoint): one ClassificationRequestOutput per prompt, in prompt order, its `.outputs.probs`
        the score head over the prompt's last token, through the activation of the checkpoint's
        problem type (softmax; sigmoid for multi-label; as given for one label: a reward model's
        score). Prompts are prefilled as generate prefills them; on_error and lora_request as generate's."""
        results = dict(self.classify_iter(prompts, use_tqdm, on_error, lora_request=lora_request))
        return [results[i] for i in range(len(results))]

    def classify_iter(self, prompts: Prompt | Seq[Prompt], use_tqdm: bool = True, on_error: str = "raise",
                      stop: Callable[[], bool] | None = None,
                      lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                      ) -> Iterator[tuple[int, ClassificationRequestOutput]]:
        """(prompt index, output) as classifications finish: generate_iter's counterpart."""
        if self.engine.engine_config.task != "classify":
            raise FlexSarathiError('LLM.classify needs an LLM built to classify: LLM(model, task="classify")')
        prompts, _ = _check_arguments(prompts, None, on_error, "classify")
        poolings, adapters = [PoolingParams()] * len(prompts), _per_prompt_lora(lora_request, len(prompts))
        yield from self._requests_iter(prompts, [_PROMPT_ONLY] * len(prompts), poolings, use_tqdm, on_error, stop,
                                       adapters)

    def _requests_iter(self, prompts: list, params: list[SamplingParams], poolings: list | None, use_tqdm: bool,
                       on_error: str, stop: Callable[[], bool] | None, adapters: list | None = None):
        with self._turns.turn():  # flexsarathi/batch_turns.py
            self.last_stats = _stats(0, 0, 0, 0, 0, 0.0, self.engine.memory.report())
            groups, refused = self._make_requests(prompts, params, poolings, on_error, adapters)
            self.last_stats["failed"] = len(refused)
            for index, error in refused:
                with self._turns.suspended():  # close() from another thread may close the engine meanwhile
                    text = prompts[index] if isinstance(prompts[index], str) else None
                    yield index, _refused_output(text, error, self.engine.engine_config.task)
            if groups:
                yield from self._run(groups, len(refused), use_tqdm, on_error, stop)

    def _make_requests(self, prompts: list, params: list[SamplingParams], poolings: list | None, on_error: str,
                       adapters: list | None = None):
        """{prompt index: its n sequences} and [(prompt index, error)] for refused prompts."""
        groups, refused = {}, []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                # a text longer than the context is encoded whole where only its last tokens are read
                ids, text = self._encode(prompt, i, whole=p.truncate_prompt_tokens is not None)
                ids = p.truncated(ids, self.engine.config.max_position_embeddings)
                self.engine.validate_prompt(ids, i)
                pooling = poolings[i] if poolings is not None else None
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                adapter = adapters[i] if adapters is not None else None
                groups[i] = [self.engine.make_sequence(ids, p, text, k, pooling, salt, adapter) for k in range(p.n)]
            except FlexSarathiError as exc:
                if on_error == "raise":  # which of the prompts, where the message does not say
                    if not str(exc).startswith(f"prompt {i}"):
                        exc.args = (f"prompt {i}: {exc}",)
                    raise
                refused.append((i, str(exc)))
        return groups, refused

    def _run(self, groups: dict[int, list], failed: int, use_tqdm: bool,
             on_error: str, stop: Callable[[], bool] | None) -> Iterator[tuple[int, RequestOutput]]:
        engine, scheduler = self.engine, self.engine.scheduler
        seqs = [seq for group in groups.values() for seq in group]
        request_of = {seq.seq_id: i for i, group in groups.items() for seq in group}
        progress = _Progress(seqs, [group[0] for group in groups.values()], use_tqdm,
                             engine.engine_config.task)
        passes, left = 0, {i: len(group) for i, group in groups.items()}
        counted = _scheduler_counts(scheduler)  # this call's counts are the differences
        foreign = engine.has_unfinished()  # another generate_iter's batch: add_requests refuses, it stays
        try:
            # inside the try: a Ctrl-C as the batch is added still leaves nothing queued
            engine.add_requests(list(groups.values()))  # a prompt is prefilled once for its n completions
            while engine.has_unfinished():
                if self._closing:
                    unfinished = sum(1 for n in left.values() if n)
                    raise FlexSarathiError(f"this LLM was closed while generate ran: {unfinished} of its "
                                           f"{len(left)} prompts did not finish")
                finished = engine.step()
                passes += 1
                done = []
                for seq in finished:
                    i = request_of[seq.seq_id]
                    left[i] -= 1
                    if not left[i]:
                        done.append(i)
                progress.update(finished, len(done))
                for i in done:
                    output = engine.to_output(groups[i])
                    if output.error is not None:  # failed in a pass (non-finite logits)
                        failed += 1
                        if on_error == "raise":
                            raise FlexSarathiError(f"prompt {i}: {output.error}")
                    with self._turns.suspended():  # as above; the loop's next check of _closing ends it
                        yield i, output
                engine.raise_held_interrupt()  # a Ctrl-C as the step ended: after its finished requests
                if stop is not None and stop():
                    break
        except GeneratorExit:  # the caller stopped iterating: a Ctrl-C held for it reaches it now
            engine.raise_held_interrupt()
            raise
        finally:
            engine.interrupt_held = False  # any other exception on its way out ends the call already
            if not foreign:
                engine.abort_all()  # a caller that stopped iterating leaves nothing queued
            progress.close()
            self.last_stats = _stats(len(groups), failed, progress.prompt_tokens, progress.generated,
                                     passes, progress.elapsed, engine.memory.report())
            self.last_stats.update({k: n - counted[k] for k, n in _scheduler_counts(scheduler).items()},
                                   running=engine.batch_running)

    def _encode(self, prompt: Prompt, index: int, whole: bool = False) -> tuple[list[int], str | None]:
        """(token ids, text or None) of a prompt: a string, a list of token ids, or vLLM's prompt
        dicts ({"prompt": text} / {"prompt_token_ids": ids}). whole: a text of more tokens than the
        context holds is encoded too (else refused before it is tokenized)."""
        if isinstance(prompt, dict):
            prompt = _from_prompt_dict(prompt, index)
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise FlexSarathiError(f"prompt {index} is text, but this model has no tokenizer.json; "
                                       "give prompts as lists of token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: the tokenizer would fail on it obscurely
                raise FlexSarathiError(f"prompt {index} is not valid Unicode text ({exc.reason} at character "
                                       f"{exc.start})") from None
            try:
                return self.engine.tokenizer.encode(prompt, whole=whole), prompt
            except FlexSarathiError as exc:  # longer than the context could hold
                raise FlexSarathiError(f"prompt {index}: {exc}") from None
        if isinstance(prompt, (list, tuple)):
            return [int(t) if _is_integer(t) else t for t in prompt], None  # numpy ints as Python ints
        raise FlexSarathiError(f"prompt {index} must be a string or a list of token ids, "
                               f"got {type(prompt).__name__}")


def _from_prompt_dict(prompt: dict, index: int) -> str | list:
    """vLLM's TextPrompt / TokensPrompt: {"prompt": text} or {"prompt_token_ids": ids}, and optionally
    "cache_salt" (a non-empty string: its prefix-cache blocks are shared with requests of that salt only)."""
    kinds = [k for k in ("prompt", "prompt_token_ids") if k in prompt]
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
    if len(kinds) != 1 or unknown:
        raise FlexSarathiError(f"prompt {index} is a dict: it takes exactly one of \"prompt\" (text) or "
                               f"\"prompt_token_ids\" (token ids), and \"cache_salt\", got keys {sorted(prompt)}")
    salt = prompt.get("cache_salt")
    if "cache_salt" in prompt and not (isinstance(salt, str) and salt):
        raise FlexSarathiError(f"prompt {index}: \"cache_salt\" must be a non-empty string, got {salt!r}")
    value = prompt[kinds[0]]
    if not isinstance(value, str if kinds[0] == "prompt" else (list, tuple)):
        raise FlexSarathiError(f"prompt {index}: {kinds[0]!r} must be "
                               f"{'a string' if kinds[0] == 'prompt' else 'a list of token ids'}, "
                               f"got {type(value).__name__}")
    return value


def _check_llm_arguments(model, policy, hardware, seed, kv_block_size, engine_options: dict) -> tuple:
    """(model, policy, hardware) with paths (pathlib too) as strings; FlexSarathiError naming an
    argument of LLM(...) whose kind is wrong, before anything is opened."""
    model, policy, hardware = (os.fspath(v) if isinstance(v, os.PathLike) else v for v in (model, policy, hardware))
    if not isinstance(model, (str, OpenedModel)):
        raise FlexSarathiError("LLM(model=...) must be a checkpoint folder, a .gguf file, a Hugging Face repo name or "
                               f"dummy:<name>; got {type(model).__name__}")
    if policy is not None and not isinstance(policy, (str, Policy)):
        raise FlexSarathiError('LLM(policy=...) must be a Policy, a policy JSON file, "auto" or None; '
                               f"got {type(policy).__name__}")
    if hardware is not None and not isinstance(hardware, (str, HardwareSpec)):
        raise FlexSarathiError("LLM(hardware=...) must be a HardwareSpec, a preset name (t4, a100-40g, ...) or a "
                               f"profile JSON file; got {type(hardware).__name__}")
    if not _is_integer(seed):
        raise FlexSarathiError(f"LLM(seed=...) must be an integer, got {seed!r}")
    if kv_block_size is not None and (not _is_integer(kv_block_size) or kv_block_size < 1):
        raise FlexSarathiError(f"LLM(kv_block_size=...) must be None or an integer >= 1, got {kv_block_size!r}")
    cap = engine_options.get("max_logprobs", -1)
    if not _is_integer(cap) or cap < -1:
        raise FlexSarathiError(f"LLM(max_logprobs=...) must be an integer >= -1 (-1: no limit), got {cap!r}")
    unknown = sorted(set(engine_options) - {f.name for f in dataclasses.fields(EngineConfig)} - {"budget"})
    if unknown:
        raise FlexSarathiError(f"LLM() got unknown option(s) {unknown}: the options are LLM's own arguments and "
                               "EngineConfig's fields (flexsarathi/engine/llm_engine.py)")
    if "budget" in engine_options:  # EngineConfig's, but LLM makes it from hardware=
        raise FlexSarathiError("LLM() takes no budget=: the tier budgets are hardware='s (a HardwareSpec, a preset "
                               "or a profile JSON; HardwareSpec.with_memory sets capacities)")
    return model, policy, hardware


def _refused_output(prompt: str | None, error: str, task: str = "generate"):
    """The output of a request turned away before any pass (on_error="record"): no sequence, so no
    request id (-1)."""
    if task in POOLING_TASKS:
        kind = ClassificationRequestOutput if task == "classify" else EmbeddingRequestOutput
        return kind(request_id=-1, prompt=prompt, prompt_token_ids=[], outputs=None, error=error, refused=True)
    return RequestOutput(request_id=-1, prompt=prompt, prompt_token_ids=[], outputs=[], error=error, refused=True)


# An embedding request's SamplingParams: it samples nothing (the engine plans its KV for one token more).
_PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0)


def _per_prompt_lora(lora_request, count: int) -> list:
    """One LoRARequest (or None) per prompt from generate's lora_request; FlexSarathiError where a
    list of them is not one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if not isinstance(lora_request, (list, tuple)):
        raise FlexSarathiError(f"lora_request must be a LoRARequest, a list of them (None for the base model) or "
                               f"None, got {type(lora_request).__name__}")
    if len(lora_request) != count:
        raise FlexSarathiError(f"lora_request has {len(lora_request)} entries for {count} prompts: give one per "
                               f"prompt, or one LoRARequest for all")
    return list(lora_request)


def _check_pooling_arguments(prompts, pooling_params, on_error: str) -> tuple[list, list[PoolingParams]]:
    """The prompts and one PoolingParams per prompt; FlexSarathiError naming a misused argument."""
    prompts, _ = _check_arguments(prompts, None, on_error, "embed")
    given = PoolingParams() if pooling_params is None else pooling_params
    poolings = [given] * len(prompts) if isinstance(given, PoolingParams) else given
    if not isinstance(poolings, (list, tuple)) or not all(isinstance(p, PoolingParams) for p in poolings):
        raise FlexSarathiError("embed(pooling_params=...) must be a PoolingParams or a list of them, "
                               f"got {type(pooling_params).__name__}")
    if len(poolings) != len(prompts):
        raise FlexSarathiError(f"got {len(prompts)} prompts but {len(poolings)} PoolingParams")
    return prompts, list(poolings)


def _one_conversation(messages) -> bool:
    """Whether LLM.chat's `messages` is one conversation (a list of message objects) rather than a
    list of conversations."""
    return not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], (list, tuple))


def _per_conversation(sampling_params, count: int):
    """LLM.chat's sampling_params as generate takes them: one for all, or a list of one per conversation."""
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != count:
            raise FlexSarathiError(f"LLM.chat(sampling_params=...) holds {len(sampling_params)} entries for "
                                   f"{count} conversations: give one, or one per conversation")
        return list(sampling_params)
    return sampling_params


def _check_workload(workload, policy) -> None:
    """LLM(workload=...) is what policy="auto" searches for: a Workload, and only with "auto" (else
    it would be ignored)."""
    if workload is None:
        return
    if not isinstance(workload, Workload):
        raise FlexSarathiError("LLM(workload=...) must be a policy_search.Workload or None, "
                               f"got {type(workload).__name__}")
    if policy != "auto":
        raise FlexSarathiError('LLM(workload=...) is what policy="auto" searches a policy for; with policy='
                               f'{policy!r} it would change nothing: leave it out, or pass policy="auto"')


def _check_arguments(prompts, sampling_params, on_error: str,
                     call: str = "generate") -> tuple[list, list[SamplingParams]]:
    """The prompts and one SamplingParams per prompt; FlexSarathiError naming a misused argument
    of `call` (generate, embed)."""
    if on_error not in ("raise", "record"):
        raise FlexSarathiError(f'{call}(on_error=...) must be "raise" or "record", got {on_error!r}')
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and _is_integer(prompts[0])):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise FlexSarathiError(f"{call}(prompts=...) must be a string, a list of token ids, or a list "
                               f"of those; got {type(prompts).__name__}")
    prompts = list(prompts)
    params = sampling_params if sampling_params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    elif isinstance(params, (list, tuple)):
        params = list(params)
        bad = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise FlexSarathiError("generate(sampling_params=...) must be a SamplingParams or a list "
                                   f"of them; the list holds a {type(bad).__name__}")
    else:
        raise FlexSarathiError("generate(sampling_params=...) must be a SamplingParams or a list of "
                               f"them, got {type(params).__name__} (e.g. SamplingParams(**your_dict))")
    if len(params) != len(prompts):
        raise FlexSarathiError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
    return prompts, params


def _is_integer(value) -> bool:
    """A token id, a seed: Python's or numpy's integers (a tokenizer's output), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _scheduler_counts(scheduler) -> dict[str, int]:
    """The scheduler's running totals, by their names in LLM.last_stats."""
    return {"prefill_tokens_computed": scheduler.num_prefill_tokens, "preemptions": scheduler.num_preemptions,
            "prefix_cache_hit_tokens": scheduler.num_cached_tokens}


def _stats(requests: int, failed: int, prompt_tokens: int, generated: int, passes: int, seconds: float,
           memory: dict) -> dict:
    return {"requests": requests, "failed": failed, "prompt_tokens": prompt_tokens,
            "generated_tokens": generated, "passes": passes, "seconds": seconds,
            "tokens_per_s": generated / seconds if seconds else 0.0, "memory": memory}


class _Progress:
    """A tqdm bar over generated tokens that advances every pass: its total is every sequence's
    token allowance (max_tokens, capped by the context), less what sequences that stop early
    leave unused; the postfix has requests done and prompt / generated tokens per second (a
    request's prompt counted once, by its first sequence, however many completions share it)."""

    def __init__(self, seqs: list, firsts: list, enabled: bool, task: str = "generate"):
        self.unfinished = set(seqs)
        self.firsts = set(firsts)
        self.requests, self.done = len(firsts), 0
        self.prompt_tokens = self.generated = 0
        self.start = time.perf_counter()
        self.elapsed = 0.0
        total = sum(s.max_len - s.num_prompt_tokens for s in seqs)
        if task in POOLING_TASKS:  # nothing is generated: the bar counts prompt tokens
            total = sum(s.num_prompt_tokens for s in seqs)
        self.task = task
        self.bar = tqdm(total=total, desc=task, unit="tok", disable=not enabled)

    def update(self, finished: list, requests_done: int) -> None:
        for seq in finished:
            self.unfinished.discard(seq)
            self.prompt_tokens += seq.num_prompt_tokens if seq in self.firsts else 0
            self.generated += len(seq.output_token_ids)
            if self.task not in POOLING_TASKS:
                self.bar.total -= seq.max_len - seq.num_tokens  # tokens it will never generate
        prompt = generated = 0
        for seq in self.unfinished & self.firsts:
            prompt += min(seq.num_computed, seq.num_prompt_tokens)
        for seq in self.unfinished:
            generated += len(seq.output_token_ids)
        self.done += requests_done
        self.elapsed = time.perf_counter() - self.start
        total_generated = self.generated + generated
        counted = self.prompt_tokens + prompt if self.task in POOLING_TASKS else total_generated
        self.bar.update(counted - self.bar.n)
        if not self.bar.disable:
            seconds = self.elapsed or 1e-9
            generated = "" if self.task in POOLING_TASKS else f", gen {total_generated / seconds:.1f} tok/s"
            self.bar.set_postfix_str(f"req {self.done}/{self.requests}, prompt "
                                     f"{(self.prompt_tokens + prompt) / seconds:.1f} tok/s{generated}", refresh=False)

    def close(self) -> None:
        self.elapsed = time.perf_counter() - self.start
        self.bar.close()
