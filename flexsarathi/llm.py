"""`LLM`: the offline batch API, in vLLM's vocabulary.

    llm = LLM("path/to/checkpoint")          # or "dummy:opt-1.3b"
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
"""
from __future__ import annotations

import time
from typing import Sequence as Seq

from tqdm.auto import tqdm

from flexsarathi.engine import LLMEngine, RequestOutput
from flexsarathi.errors import FlexSarathiError
from flexsarathi.sampling import SamplingParams
from offload.memory import TierBudget
from policy_search.policy import Policy

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, dtype=None, device=None, policy: Policy | str | None = None,
                 seed: int = 0, kv_block_size: int | None = None, hardware=None, offload_dir: str | None = None,
                 compress_weight: bool | None = None, compress_kv: bool | None = None,
                 direct_io: bool = True, workload=None, **engine_options):
        """model: a checkpoint folder or `dummy:<name>`. policy: a Policy, a policy JSON file,
        "auto" (searched by policy_search for `hardware` and `workload`, a policy_search.Workload,
        default prompt 512 / output 32), or None (everything on the compute device). hardware: a HardwareSpec, a preset name (`t4`,
        `a100-80g`, ...) or a profile JSON: its memory limits are the tier budgets the engine
        enforces. offload_dir: where disk-tier weights, KV and activations live (default
        ~/.cache/flexsarathi/offload; placed weights are reused across runs). engine_options go
        to LLMEngine (weight_quant, kv_bits, kv_value_group: the compression formats)."""
        spec = None
        if hardware is not None:
            from policy_search import HardwareSpec

            spec = hardware if isinstance(hardware, HardwareSpec) else HardwareSpec.resolve(hardware)
        if policy == "auto":
            policy = self._search_policy(model, spec, workload, dtype)
        elif isinstance(policy, str):
            policy = Policy.load(policy)
        policy = policy or Policy()
        overrides = {k: v for k, v in (("compress_weight", compress_weight), ("compress_kv", compress_kv))
                     if v is not None}
        if overrides:
            policy = policy.replace(**overrides)
        budget = TierBudget(**{tier: int(b) for tier, b in spec.budgets().items()}) if spec else None
        self.engine = LLMEngine(model, dtype=dtype, device=device, policy=policy, seed=seed,
                                kv_block_size=kv_block_size, budget=budget, offload_dir=offload_dir,
                                direct_io=direct_io, **engine_options)
        self.last_stats: dict = {}

    @staticmethod
    def _search_policy(model: str, hardware, workload, dtype) -> Policy:
        from policy_search import ModelSpec, Workload, search

        if hardware is None:
            raise FlexSarathiError('policy="auto" needs hardware= (a preset such as "t4", or a profile '
                                   'written by `flexsarathi profile`)')
        import torch

        compute = str(dtype or ("float16" if torch.cuda.is_available() else "float32")).removeprefix("torch.")
        bytes_per_value = 4 if compute in ("float32", "fp32", "float") else 2
        spec = ModelSpec.from_name(model, bytes_per_value=bytes_per_value)
        policy, est = search(spec, hardware, workload or Workload(prompt_len=512, gen_len=32))
        return policy

    def close(self) -> None:
        """Release the engine: I/O threads, disk-store files, KV pools, working buffers. Also
        called on leaving a `with LLM(...) as llm:` block. Idempotent."""
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
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One output per prompt, in prompt order. Prompts are strings or lists of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise FlexSarathiError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        if not prompts:
            return []
        engine = self.engine
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids, text = self._encode(prompt, i)
            engine.validate_prompt(ids, i)
            seqs.append(engine.make_sequence(ids, p, text))
        scheduler = engine.new_scheduler(seqs)
        for seq in seqs:
            scheduler.add(seq)
        start, generated, passes = time.perf_counter(), 0, 0
        with tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while scheduler.has_unfinished():
                finished = engine.step(scheduler)
                passes += 1
                generated += sum(len(s.output_token_ids) for s in finished)
                if finished:
                    bar.update(len(finished))
                    bar.set_postfix(tok_s=f"{generated / (time.perf_counter() - start):.1f}")
        elapsed = time.perf_counter() - start
        self.last_stats = {"requests": len(seqs), "generated_tokens": generated, "passes": passes,
                           "seconds": elapsed, "tokens_per_s": generated / elapsed if elapsed else 0.0,
                           "memory": engine.memory.report()}
        return [engine.to_output(seq) for seq in seqs]

    def _encode(self, prompt: Prompt, index: int) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise FlexSarathiError(f"prompt {index} is text, but this model has no tokenizer.json; "
                                       "give prompts as lists of token ids")
            return self.engine.tokenizer.encode(prompt), prompt
        if isinstance(prompt, (list, tuple)):
            return list(prompt), None
        raise FlexSarathiError(f"prompt {index} must be a string or a list of token ids, "
                               f"got {type(prompt).__name__}")
