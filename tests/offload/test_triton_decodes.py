"""The GPU's decode route over a compressed KV pool (KVPool.attend_decode through
quant/triton_kv_attention.py, its indices from one DecodePlan per pass) run on the CPU in Triton's
interpreter (`triton_decodes_on_cpu`): the pool call against the gather route it replaces (sliding
windows included), and whole engines, every placement giving the all-on-device tokens. Run in a
subprocess: TRITON_INTERPRET=1 must be set before triton is imported. A GPU runs the compiled kernel
through the same code (tests/offload/test_cuda.py)."""
from __future__ import annotations

from tests.triton_interpreter import needs_triton, run_interpreted, without_a_gpu

pytestmark = [needs_triton, without_a_gpu]


_COUNTED = """
    from quant import triton_kv_attention
    calls = [0]
    _kernel = triton_kv_attention.decode_attention
    def _counted(*args, **kwargs):
        calls[0] += 1
        return _kernel(*args, **kwargs)
    triton_kv_attention.decode_attention = _counted
"""


def test_the_pool_attends_a_decode_as_the_gather_route_does():
    """KVPool.attend_decode_codes (its DecodePlan: visible range, sliding window, each sequence's
    row of the micro-batch) against gather_part + parts_to_attend + attention.attend on a pool filled
    through store; the group's rows are not the micro-batch's first ones."""
    out = run_interpreted(_COUNTED + """
    import torch
    from flexsarathi.models import attention
    from offload.kv_cache import KVCompression, triton_decodes_on_cpu
    from tests.offload.test_kv_cache import BS, DIM, HEADS, decode_case

    cpu = torch.device("cpu")
    for lengths, window in [([11, 4, 7], None), ([1, 12, 8], None), ([11, 4, 7], 5), ([15, 3, 9], 2)]:
        token_rows = torch.tensor([4, 1, 2])  # the group's rows of a 5-row micro-batch
        pool, gen, part, group = decode_case(KVCompression(bits=4, block_size=BS, value_group=8), lengths, window,
                                             token_rows)
        kv_len, slots = part.kv_len, part.kv_slots
        q = torch.randn(3, 1, 2 * HEADS, DIM, generator=gen)  # GQA: two query heads per KV head
        new_k, new_v = torch.randn(5, HEADS, DIM, generator=gen), torch.randn(5, HEADS, DIM, generator=gen)
        scale = DIM ** -0.5
        with triton_decodes_on_cpu():
            assert pool.attends_with_triton() and pool.attends_in_pool(group, part, cpu)
            codes, back = pool.quantize_v(new_v)
            windows = tuple(dict.fromkeys((None, window)))  # a plan for gemma3's two kinds of layer, read for one
            out, lse = pool.attend_decode_codes(1, q, pool.plan_decode(group, part, windows), (new_k, codes), scale,
                                                window)
            # V stored first (the executor's decode route): read from the pool, the same bits
            stored = pool.plan_store(slots[torch.arange(3), torch.tensor(lengths)], torch.arange(3))
            pool.store_v_first(1, new_v[token_rows], stored)
            first = pool.attend_decode_codes(1, q, pool.plan_decode(group, part, windows), (new_k, None), scale,
                                             window)
            assert torch.equal(first[0], out) and torch.equal(first[1], lse)
        context = pool.gather_part(1, part, cpu)
        [(k, v, rule)] = pool.parts_to_attend(group, part, context, new_k[token_rows], back[token_rows], True)
        want_out, want_lse = attention.attend(q, k, v, group.q_pos, kv_len, scale, window, 0, rule)
        assert out.shape == want_out.shape and lse.shape == want_lse.shape
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    print("calls", calls[0])
    """)
    assert out.split()[-1] == "8"  # each pool call took the kernel (two per case)


def test_every_placement_gives_the_all_on_device_tokens():
    """The reference runs the CPU's own route (quant/cpu_kv_attention.py); each placement here takes
    the Triton kernel for every decode over a compressed pool (its own parts; delegated CPU attention
    of host parts too, since every pool is on the CPU here): the same greedy tokens, and logprobs
    equal within fp32 rounding of a different summation order."""
    out = run_interpreted(_COUNTED + """
    import tempfile, torch
    from conftest import build_hf_model
    from flexsarathi import LLM, SamplingParams
    from offload.kv_cache import triton_decodes_on_cpu
    from policy_search import Policy

    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (3, 13, 7, 20, 5)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=1)  # interpreted: few steps
    base = dict(gpu_batch_size=2, prefill_budget=6, compress_kv=True)

    def run(folder, **placement):
        llm = LLM(folder, dtype="float32", policy=Policy(**base, **placement), kv_block_size=8,
                  cpu_matmul="dequantize", offload_dir=tempfile.mkdtemp())
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [o.token_ids for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

    placements = {"llama_gqa_untied": [{}, dict(kv_gpu=0.3, kv_cpu=0.4, kv_disk=0.3, cpu_attention=True),
                                       dict(num_gpu_batches=2, scheduler="block", w_gpu=0.5, w_cpu=0.5)],
                  "opt": [{}], "gemma3": [{}]}  # gemma3: one plan, each layer's own window
    for kind in placements:
        folder = tempfile.mkdtemp()
        build_hf_model(kind).save_pretrained(folder, safe_serialization=True)
        tokens, logprobs = run(folder)
        with triton_decodes_on_cpu():
            for placement in placements[kind]:
                before = calls[0]
                got, got_logprobs = run(folder, **placement)
                assert got == tokens, (kind, placement)
                diff = max(abs(a - b) for x, y in zip(got_logprobs, logprobs) for a, b in zip(x, y))
                # gemma3 (6 layers: one sequence's logprob moved 6e-4 at one step, 2e-6 before it): a new row's
                # 1e-6 difference took the other side of a 4-bit code's rounding (as test_policy_matrix allows)
                assert diff < (1e-3 if kind == "gemma3" else 1e-4), (kind, placement, diff)
                assert calls[0] > before, (kind, placement)
    print("ok")
    """)
    assert out.strip().endswith("ok")
