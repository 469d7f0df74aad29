"""The compressed paths against a reference that shares no code with them: tests/quant_spec.py, the
quantization format written from its specification in numpy (min-max asymmetric 4-bit, fp16 step
and minimum; policy_search/quant_format.py's groupings).

- Weights: transformers run on the checkpoint with every decoder-layer weight replaced by
  spec-quantize -> spec-dequantize gives the engine's compressed-weight logits (within the bound the
  uncompressed engine meets against transformers) and its greedy tokens.
- KV: every K block, V row and open (residual) block the engine's compressed pool holds after a run
  is the spec's quantization of the K and V the pass stored (bit for bit), and what the pool reads
  back is the spec's reading of those codes; the stored layer-0 K and V are transformers' own.
The placement matrix (test_policy_matrix.py) holds every other compressed placement to the
all-on-device compressed run.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flexsarathi import LLM, SamplingParams
from policy_search import Policy
from policy_search.quant_format import KV_FORMAT, WEIGHT_FORMAT
from tests import quant_spec
from tests.flexsarathi.models.test_models import hf_greedy, hf_logits
from tests.prompt_logits import prompt_logits

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# The uncompressed engine's fp32 logits against transformers' (tests/flexsarathi/models/test_models.py):
# the same weights multiplied in another order. With the same dequantized weights that is all there is.
LOGIT_ATOL = 1e-4


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (6, 19, 33)]


def _spec_dequantized(model):
    """A copy of the transformers model whose decoder-layer Linear weights ([out, in], grouped along
    the input dimension) are what the weight format reads back; embeddings, head, norms and biases
    stay exact, as the engine keeps them."""
    reference = copy.deepcopy(model)
    replaced = 0
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                module.weight.copy_(quant_spec.round_trip(module.weight, WEIGHT_FORMAT.group_size,
                                                          WEIGHT_FORMAT.bits))
                replaced += 1
    assert replaced >= 4 * reference.config.num_hidden_layers
    return reference


@pytest.mark.parametrize(("model", "placement"), [
    ("stories260K", {}),  # the real checkpoint, every weight on the compute device
    ("stories260K", dict(w_gpu=0.0, w_cpu=0.5, w_disk=0.5)),  # the codes streamed from host memory and disk
    ("opt", {}),  # rows of 32 and 64 inputs: groups shorter than the format's
    ("llama_gqa_untied", {}),
])
def test_compressed_weights_give_transformers_on_the_dequantized_weights(request, tiny_checkpoint, model,
                                                                         placement, tmp_path):
    if model == "stories260K":
        folder, hf = request.getfixturevalue("stories_dir"), request.getfixturevalue("stories_hf")
    else:
        folder, hf = tiny_checkpoint(model)
    reference = _spec_dequantized(hf)
    # cpu_matmul="dequantize": the dequantized fp32 weight times x, the reference's arithmetic (the int8
    # kernel, which also rounds x, is held to this route in test_engine_cpu_matmul.py).
    llm = LLM(folder, dtype="float32", policy=Policy(compress_weight=True, **placement), cpu_matmul="dequantize",
              offload_dir=str(tmp_path / "offload"))
    try:
        prompts = _prompts(llm.engine.config.vocab_size)
        original_gap = 0.0
        for ids, logits in zip(prompts, prompt_logits(llm, prompts)):
            torch.testing.assert_close(logits, hf_logits(reference, ids), atol=LOGIT_ATOL, rtol=0)
            original_gap = max(original_gap, (logits - hf_logits(hf, ids)).abs().max().item())
        assert original_gap > 100 * LOGIT_ATOL  # the weights really are the 4-bit ones
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert tokens == [hf_greedy(reference, ids, GREEDY.max_tokens) for ids in prompts]
    finally:
        llm.close()


# ---- the compressed KV pool's blocks against the format ---------------------------------------
KV_PROMPTS = ([5 + i % 100 for i in range(150)], [7 + (3 * i) % 90 for i in range(60)], [9, 4, 33, 2] * 5)
# fp32 K and V of layer 0 (one projection and the rotary embedding) against transformers': the
# same arithmetic in another order, ~1e-6 at these magnitudes.
KV_ATOL = 1e-5


@pytest.fixture(scope="module")
def head64(tmp_path_factory):
    """A llama whose heads have 64 dimensions (V's group is the format's 64, not the head size), two
    KV heads of four queries, and room for a few 64-token blocks (K's group)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=128, intermediate_size=192, head_dim=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    folder = tmp_path_factory.mktemp("head64")
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder), model


def _run_recording_stores(llm):
    """LLMEngine.step spelled out: every sequence's block table and residual row as it ran, and what
    the passes stored, {(layer, slot): (k, v)} ([kv_heads, head_dim] each, the last write wins; all
    requests run at once, so no slot is written by two sequences)."""
    engine = llm.engine
    seqs = [engine.make_sequence(ids, GREEDY) for ids in KV_PROMPTS]
    engine.add_requests([[seq] for seq in seqs])
    (pool,) = engine.kv_pools.values()
    stored, store = {}, pool.store

    def recording_store(layer, slots, k, v, residual_ids=None, v_codes=None, plan=None, v_stored=False):
        for slot, k_row, v_row in zip(slots.tolist(), k.detach().cpu().clone(), v.detach().cpu().clone()):
            stored[layer, slot] = (k_row, v_row)
        return store(layer, slots, k, v, residual_ids, v_codes=v_codes, plan=plan, v_stored=v_stored)

    pool.store = recording_store
    tables = {}
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        for item in plan.items:
            tables[item.seq.seq_id] = (list(item.seq.block_table), item.seq.residual_id)
        engine.scheduler.postprocess(plan, *engine.sample(engine.forward(plan)))
    return pool, seqs, tables, stored


def _layer0_kv(output) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' layer-0 K (rotated) and V of a one-sequence forward, [T, kv_heads, head_dim]."""
    cache = output["cache"] if "cache" in output else output.past_key_values  # renamed in transformers 5
    k, v = (cache.layers[0].keys, cache.layers[0].values) if hasattr(cache, "layers") else cache[0]
    return k[0].transpose(0, 1), v[0].transpose(0, 1)


def _check_keys(pool, layer: int, table, residual_id: int, k: torch.Tensor) -> torch.Tensor:
    """k: the stored keys [T, kvh, d] of one sequence in position order. Its complete blocks are the
    format's groups of one channel over the block's tokens; its open block is kept exact. Returns
    the keys as the format reads them back."""
    bs, (num_tokens, kvh, d) = pool.block_size, k.shape
    complete = num_tokens // bs
    expected = k.clone()
    for j in range(complete):
        groups = k[j * bs:(j + 1) * bs].permute(1, 2, 0).reshape(kvh * d, bs).numpy()  # [channel, token]
        codes, step, minimum = quant_spec.quantize_groups(groups, KV_FORMAT.bits)
        packed = pool.k_codes["data"][layer, table[j]].cpu().view(kvh * d, -1).numpy()
        assert np.array_equal(quant_spec.unpack_split_halves(packed), codes), (layer, j)
        assert np.array_equal(pool.k_codes["scale"][layer, table[j]].cpu().numpy(), step), (layer, j)
        assert np.array_equal(pool.k_codes["minimum"][layer, table[j]].cpu().numpy(), minimum), (layer, j)
        back = quant_spec.read_back(codes, step, minimum)
        expected[j * bs:(j + 1) * bs] = torch.from_numpy(back).view(kvh, d, bs).permute(2, 0, 1)
    open_positions = torch.arange(complete * bs, num_tokens)
    assert torch.equal(pool.k_residual[layer, residual_id].cpu()[open_positions % bs], k[open_positions])
    return expected


def _check_values(pool, layer: int, slots: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """v [T, kvh, d]: each token's head is cut into the format's V groups (64 values here)."""
    group = min(KV_FORMAT.value_group, v.shape[-1])
    assert group == v.shape[-1]  # one group per head: a head's line of codes is one group's split halves
    codes, step, minimum = quant_spec.quantize_groups(quant_spec.to_groups(v, group), KV_FORMAT.bits)
    num_tokens = v.shape[0]
    packed = pool.v_codes["data"][layer].cpu()[slots].view(-1, group // 2).numpy()  # [tokens * heads, bytes]
    assert np.array_equal(quant_spec.unpack_split_halves(packed), codes), layer
    assert np.array_equal(pool.v_codes["scale"][layer].cpu()[slots].reshape(-1).numpy(), step), layer
    assert np.array_equal(pool.v_codes["minimum"][layer].cpu()[slots].reshape(-1).numpy(), minimum), layer
    return quant_spec.from_groups(quant_spec.read_back(codes, step, minimum), (num_tokens, *v.shape[1:]))


def test_compressed_kv_blocks_are_the_formats_quantization_of_the_stored_keys_and_values(head64, tmp_path):
    """Prompts of 150, 60 and 20 tokens in chunks of at most 48, then 8 greedy tokens: K blocks
    completed by a prompt chunk over earlier chunks' rows (held in the residual block) and by a
    decode, and open blocks left at the end. Bounds: codes, steps and minimums equal, what the pool
    reads back equal; the stored layer-0 K and V within KV_ATOL of transformers'."""
    folder, hf = head64
    # On the CPU: the check is the CPU's quantization arithmetic, bit for bit (CUDA's fused multiply-adds
    # round some values differently: within the format's bounds, not its exact bits).
    llm = LLM(folder, dtype="float32", device="cpu", policy=Policy(compress_kv=True, prefill_budget=48, gpu_batch_size=4),
              offload_dir=str(tmp_path / "offload"))
    try:
        assert llm.engine.block_size == KV_FORMAT.block_size
        pool, seqs, tables, stored = _run_recording_stores(llm)
        bs, layers = pool.block_size, llm.engine.config.num_layers
        assert [(len(s.prompt_token_ids) + len(s.output_token_ids) - 1) // bs for s in seqs] == [2, 1, 0]
        for seq in seqs:
            table, residual_id = tables[seq.seq_id]
            ids = seq.prompt_token_ids + seq.output_token_ids[:-1]  # the last sampled token is never stored
            positions = torch.arange(len(ids))
            slots = torch.tensor(table)[positions // bs] * bs + positions % bs
            with torch.no_grad():
                hf_k, hf_v = _layer0_kv(hf(torch.tensor([ids]), use_cache=True))
            for layer in range(layers):
                k, v = (torch.stack(rows) for rows in zip(*(stored[layer, s] for s in slots.tolist())))
                if layer == 0:  # what the pass stored is the model's K (rotated) and V
                    torch.testing.assert_close(k, hf_k, atol=KV_ATOL, rtol=0)
                    torch.testing.assert_close(v, hf_v, atol=KV_ATOL, rtol=0)
                expected_k = _check_keys(pool, layer, table, residual_id, k)
                expected_v = _check_values(pool, layer, slots, v)
                complete = torch.tensor([len(ids) // bs * bs])
                got_k, got_v = pool.gather(layer, slots[None], torch.device("cpu"), torch.tensor([residual_id]),
                                           complete)
                assert torch.equal(got_k[0], expected_k) and torch.equal(got_v[0], expected_v), layer
    finally:
        llm.close()
