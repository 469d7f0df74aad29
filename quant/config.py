"""`QuantConfig`: how a tensor is cut into groups and how many bits each value keeps."""
from __future__ import annotations

from dataclasses import dataclass

from policy_search.quant_format import WEIGHT_FORMAT

ALLOWED_BITS = (4, 8)


@dataclass(frozen=True)
class QuantConfig:
    bits: int = WEIGHT_FORMAT.bits  # bits per stored value: 4 (two values per byte) or 8
    group_size: int = WEIGHT_FORMAT.group_size  # consecutive values along `group_dim` that share one scale and minimum
    group_dim: int = -1  # for a Linear weight [out, in], -1 groups along the input dimension
    symmetric: bool = False  # False: min-max (asymmetric); True: zero-point fixed at the middle code
    # The minimum (the value of code 0) kept in fp32 instead of fp16. A pre-quantized checkpoint's
    # asymmetric groups read back `s * (q - z)` with an fp16 `s` and an integer zero point `z`: the
    # minimum `-s * z` needs up to 11 + 8 significant bits, exact in fp32 but not in fp16, and
    # `q * s + minimum` is then exact too (flexsarathi/formats/quantized_checkpoint.py).
    minimum_fp32: bool = False
    # 4 bits: byte j of a line holds codes 2j (low nibble) and 2j + 1 (high) instead of the split
    # halves of quant/packing.py: GPTQ's and compressed-tensors' int32 words read as bytes, so their
    # codes are stored without repacking (a layer of llama-2-7b repacked costs seconds on 2 cores).
    adjacent_pairs: bool = False
    # 4 bits: split halves within each group instead of each line: byte j of a group holds codes j
    # (low nibble) and j + group_size / 2 (high), the `qs` bytes of GGUF's Q4_0 and Q4_1 blocks, so
    # their codes are stored (or read from the file) as they are.
    group_halves: bool = False

    def __post_init__(self) -> None:
        if _not_int(self.bits) or self.bits not in ALLOWED_BITS:
            raise ValueError(f"QuantConfig.bits must be one of {ALLOWED_BITS}, got {self.bits!r}")
        if _not_int(self.group_size) or self.group_size < 1:
            raise ValueError(f"QuantConfig.group_size must be a positive integer, got {self.group_size!r}")
        if self.bits == 4 and self.group_size % 2:
            # Two 4-bit values share a byte and a byte never straddles two groups.
            raise ValueError(f"QuantConfig.group_size must be even for bits=4, got {self.group_size}")
        if _not_int(self.group_dim):
            raise ValueError(f"QuantConfig.group_dim must be an integer, got {self.group_dim!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"QuantConfig.symmetric must be a bool, got {self.symmetric!r}")
        if not isinstance(self.minimum_fp32, bool):
            raise ValueError(f"QuantConfig.minimum_fp32 must be a bool, got {self.minimum_fp32!r}")
        if self.adjacent_pairs is not False and (self.adjacent_pairs is not True or self.bits != 4):
            raise ValueError(f"QuantConfig.adjacent_pairs is a bool for bits=4 only, got {self.adjacent_pairs!r} "
                             f"with bits={self.bits}")
        if self.group_halves is not False and (self.group_halves is not True or self.bits != 4 or self.adjacent_pairs):
            raise ValueError(f"QuantConfig.group_halves is a bool for bits=4 without adjacent_pairs, got "
                             f"{self.group_halves!r} with bits={self.bits}, adjacent_pairs={self.adjacent_pairs}")

    @property
    def max_code(self) -> int:
        """Largest stored code; codes run over [0, max_code]."""
        return 2**self.bits - 1

    @property
    def zero_code(self) -> int:
        """The code that stands for 0.0 in symmetric mode (the middle code)."""
        return 2 ** (self.bits - 1)

    @property
    def minimum_bytes(self) -> int:
        """Bytes of one group's stored minimum: 4 (fp32) or 2 (fp16)."""
        return 4 if self.minimum_fp32 else 2

    @property
    def line_halves(self) -> bool:
        """4 bits in the default layout: split halves of each line (quant/packing.py)."""
        return self.bits == 4 and not self.adjacent_pairs and not self.group_halves

    @property
    def bytes_per_group(self) -> int:
        return self.group_size * self.bits // 8


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


# The engine's weight format: grouped along the input dimension (docs/DESIGN.md, "Quantization");
# bits and group size are the ones the planner prices (policy_search/quant_format.py).
WEIGHT_QUANT = QuantConfig(bits=WEIGHT_FORMAT.bits, group_size=WEIGHT_FORMAT.group_size, group_dim=-1)
