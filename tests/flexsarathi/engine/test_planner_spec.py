"""The planner's ModelSpec of a model (flexsarathi.engine.planner_spec.planner_model_spec) prices what the engine
allocates: the same compute dtype and the same compressed KV-pool bytes, for 4- and 8-bit KV."""
import pytest

from flexsarathi.engine.llm_engine import EngineConfig, LLMEngine
from flexsarathi.engine.planner_spec import planner_model_spec
from offload.kv_cache import KVPool
from policy_search.policy import Policy


@pytest.mark.parametrize("kind", ["opt", "llama_tied_headdim"])  # head_dim 8 and 16: V groups capped
@pytest.mark.parametrize("bits", [4, 8])
def test_planner_prices_the_kv_pool_the_engine_allocates(tiny_checkpoint, tmp_path, kind, bits):
    folder, _ = tiny_checkpoint(kind)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=Policy(compress_kv=True), kv_bits=bits,
                                    offload_dir=str(tmp_path)))
    try:
        spec = planner_model_spec(folder, kv_bits=bits)
        c, bs = engine.config, engine.block_size
        assert spec.bytes_per_value == engine.dtype.itemsize  # one default-dtype rule
        assert spec.kv_format.bits == engine.kv_compression.bits == bits
        # One more block of slots in every layer: the pool's residual buffer cancels out.
        pool_bytes = [KVPool.nbytes_for(c.num_layers, blocks * bs, c.num_kv_heads, c.head_dim, engine.dtype,
                                        engine.kv_compression, num_residual=1) for blocks in (1, 2)]
        assert spec.num_layers * bs * spec.kv_bytes_per_token(True) == pool_bytes[1] - pool_bytes[0]
    finally:
        engine.close()


@pytest.mark.parametrize("policy", [
    Policy(gpu_batch_size=2, num_gpu_batches=2, prefill_budget=8),
    Policy(gpu_batch_size=3, scheduler="block", act_gpu=0.0, act_cpu=1.0),
    Policy(gpu_batch_size=2, num_gpu_batches=2, compress_kv=True, kv_admission="reserve", prefill_budget=16),
])
def test_engine_reserves_the_planners_worst_pass_working_set(tiny_checkpoint, tmp_path, policy):
    """The engine's fail-early check reserves policy_search.working_set's bytes for the largest pass."""
    from flexsarathi.engine.sampling import SamplingParams
    from policy_search.working_set import worst_pass_bytes

    folder, _ = tiny_checkpoint("llama_gqa_untied")
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    try:
        prompts, max_tokens = [[1] * n for n in (5, 9, 3, 12)], 6
        seqs = [engine.make_sequence(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
        before = engine.memory.peak("gpu")
        engine.add_requests([[seq] for seq in seqs])
        reserved = engine.memory.peak("gpu") - engine.memory.in_use("gpu")
        assert engine.memory.peak("gpu") > before
        spec = planner_model_spec(folder)
        pool_slots = {tier: pool.num_slots for tier, pool in engine.kv_pools.items()}  # a fresh engine's
        assert reserved == worst_pass_bytes(spec, policy, min(policy.max_running, len(seqs)), [len(p) for p in prompts],
                                            [len(p) + max_tokens for p in prompts], pool_slots)
    finally:
        engine.close()


# every weight a whole number of 4-bit groups (no padding, as in real models' shapes)
@pytest.mark.parametrize("kind", ["opt_blocks64", "llama_blocks64"])
@pytest.mark.parametrize("fractions", [(0.9, 0.1, 0.0), (0.6, 0.2, 0.2), (0.0, 1.0, 0.0)])
@pytest.mark.parametrize("compress", [False, True])
def test_weight_working_buffers_are_what_the_planner_prices(tiny_checkpoint, tmp_path, kind, fractions, compress):
    """The working buffers hold a layer's rows off the gpu tier (w_off_gpu of it per buffer), as the
    planner's memory model prices them (policy_search/cost_model.py). A weight cut between the GPU
    and another tier was buffered whole, so a searched policy that split one (opt-6.7b on a T4,
    w_gpu 0.94: 256 MiB of buffers where 45 MiB were priced) did not fit the engine's budget."""
    folder, _ = tiny_checkpoint(kind)
    w_gpu, w_cpu, w_disk = fractions
    policy = Policy(w_gpu=w_gpu, w_cpu=w_cpu, w_disk=w_disk, compress_weight=compress)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    try:
        spec = planner_model_spec(folder)
        layer = spec.largest_layer_weight_bytes(compress)
        planned = policy.weight_buffers * (1 - w_gpu) * layer
        plan = engine.weights.plan
        # the engine cuts at whole rows (64-row blocks in the CPU int4 kernel's layout): one unit of
        # rows per weight either way
        rounding = policy.weight_buffers * sum((64 if p.kernel_layout else 1) * p.row_bytes
                                               for p in plan.layer(0).tensors)
        reserved = engine.memory.in_use_by_what("gpu").get("weight working buffers", 0)
        assert reserved == plan.num_slots * plan.slot_bytes
        assert reserved <= planned + rounding
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe_dense_layer", "mixtral", "llama_blocks64", "opt"])
@pytest.mark.parametrize("w_gpu", [0.0, 1.0])
def test_gpu_tier_weights_are_what_the_planner_prices(tiny_checkpoint, tmp_path, kind, w_gpu):
    """Norms, biases and (MoE) the routers and shared-expert gates stay on the compute device,
    uncompressed, whatever the placement; the other matrices go where the weight fractions say.
    The planner's gpu tier (ModelSpec.layer_resident_bytes + w_gpu x layer_placed_bytes per layer)
    is the engine's reservation for them to the byte. (A Qwen3-30B-A3B policy searched for 4 GiB
    was refused by 7.5 MiB: the planner had priced its 48 fp32 routers as 4-bit matrices placed
    by the fractions.)"""
    folder, _ = tiny_checkpoint(kind)
    policy = Policy(w_gpu=w_gpu, w_cpu=1.0 - w_gpu, w_disk=0.0)
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    try:
        spec = planner_model_spec(folder)
        reserved = engine.memory.in_use_by_what("gpu").get("weights (gpu tier)", 0)
        planned = spec.num_layers * (spec.layer_resident_bytes + w_gpu * spec.layer_placed_bytes(False))
        assert reserved == pytest.approx(planned, abs=0.5)
        assert (spec.resident_params > 0) == (spec.num_experts > 0)
    finally:
        engine.close()


@pytest.mark.parametrize("compress_kv", [False, True])
def test_planner_prices_the_whole_kv_cache_the_engine_reserves(tiny_checkpoint, tmp_path, compress_kv):
    """A closed batch of 3 requests of 21 + 6 tokens: the engine reserves whole blocks for each
    lifetime (16 tokens, 64 for a 4-bit pool) and, for a 4-bit pool, each running sequence's open K
    block in full precision; the planner's kv_cache_bytes charges those bytes exactly."""
    from flexsarathi.engine.sampling import SamplingParams
    from policy_search import Workload
    from policy_search.cost_model import kv_cache_bytes
    from policy_search.passes import run_shape

    folder, _ = tiny_checkpoint("llama_gqa_untied")
    policy = Policy(gpu_batch_size=3, scheduler="block", compress_kv=compress_kv, kv_admission="reserve")
    engine = LLMEngine(EngineConfig(folder, device="cpu", policy=policy, offload_dir=str(tmp_path)))
    try:
        engine.add_requests([[engine.make_sequence([1 + i] * 21, SamplingParams(max_tokens=6, ignore_eos=True))]
                             for i in range(3)])
        reserved = engine.memory.report()["gpu"]["by_what"]["KV cache"]
        engine.abort_all()
    finally:
        engine.close()
    workload = Workload(prompt_len=21, gen_len=6, num_requests=3)
    assert kv_cache_bytes(run_shape(policy, workload), policy, planner_model_spec(folder)) == reserved
