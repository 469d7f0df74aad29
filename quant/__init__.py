"""Group-wise weight and KV quantization: pure tensor math, no engine knowledge.

`quantize(x, QuantConfig(bits=4, group_size=64))` -> `QTensor` (about 4.5 bits per value);
`dequantize(q)` reads it back within half a step per value; `quantized_linear(x, q)` is
`F.linear(x, dequantize(q))`, fused on CUDA.
"""
from quant.config import QuantConfig
from quant.fused import quantized_linear
from quant.group_params import UnrepresentableGroups
from quant.groupwise import dequantize, quantize
from quant.packing import pack_4bit, unpack_4bit
from quant.qtensor import QTensor

__all__ = ["QuantConfig", "QTensor", "quantize", "dequantize", "pack_4bit", "unpack_4bit", "quantized_linear",
           "UnrepresentableGroups"]
