"""Full-vocabulary logits of every prompt position, for tests that compare them to transformers or
across placements. The engine's public step, spelled out so the logit rows of each pass can be
kept: the real scheduler, batch builder and executor (chunked and batched as the policy says)."""
from __future__ import annotations

import torch

from flexsarathi.engine.micro_batch_builder import wants_prompt_logprobs
from flexsarathi.engine.sampling import SamplingParams

# prompt_logprobs makes every prompt row a logit row; one greedy token ends each request.
SCORE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)


def prompt_logits(llm, prompts: list[list[int]], lora_requests: list | None = None) -> list[torch.Tensor]:
    """[len(prompt), vocab] fp32 logits per prompt: row i predicts the token after position i.
    lora_requests: each prompt's LoRARequest or None (an LLM of enable_lora=True)."""
    engine = llm.engine
    adapters = lora_requests or [None] * len(prompts)
    seqs = [engine.make_sequence(ids, SCORE, lora_request=lora) for ids, lora in zip(prompts, adapters)]
    chunks: dict[int, dict[int, torch.Tensor]] = {seq.seq_id: {} for seq in seqs}  # id -> start -> rows
    engine.add_requests([[seq] for seq in seqs])
    while engine.has_unfinished():  # LLMEngine.step
        plan = engine.scheduler.schedule()
        outputs = engine.forward(plan)
        for item, rows in outputs:
            if wants_prompt_logprobs(item):  # a recomputed chunk (after a preemption) replaces its first run
                chunks[item.seq.seq_id][item.start] = rows[:item.num_tokens].cpu()
        engine.scheduler.postprocess(plan, *engine.sample(outputs))
    return [torch.cat([rows for _, rows in sorted(chunks[seq.seq_id].items())]) for seq in seqs]
