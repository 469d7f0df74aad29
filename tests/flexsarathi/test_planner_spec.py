"""The planner's ModelSpec of a model (flexsarathi.llm.planner_model_spec) prices what the engine
allocates: the same compute dtype and the same compressed KV-pool bytes, for 4- and 8-bit KV."""
import pytest

from flexsarathi.engine import LLMEngine
from flexsarathi.llm import planner_model_spec
from offload.kv_cache import KVPool
from policy_search.policy import Policy


@pytest.mark.parametrize("kind", ["opt", "llama_tied_headdim"])  # head_dim 8 and 16: V groups capped
@pytest.mark.parametrize("bits", [4, 8])
def test_planner_prices_the_kv_pool_the_engine_allocates(tiny_checkpoint, tmp_path, kind, bits):
    folder, _ = tiny_checkpoint(kind)
    engine = LLMEngine(folder, device="cpu", policy=Policy(compress_kv=True), kv_bits=bits,
                       offload_dir=str(tmp_path))
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
