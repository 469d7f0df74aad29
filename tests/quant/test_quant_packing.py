import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quant import pack_4bit, unpack_4bit


def test_every_byte_value_round_trips():
    packed = torch.arange(256, dtype=torch.uint8)
    codes = unpack_4bit(packed)  # [512]
    assert codes.max() <= 15
    assert torch.equal(pack_4bit(codes), packed)


def test_split_half_layout():
    # byte i holds code i (low nibble) and code i + ceil(n / 2) (high nibble)
    codes = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    assert pack_4bit(codes).tolist() == [1 | 4 << 4, 2 | 5 << 4, 3]
    assert unpack_4bit(pack_4bit(codes), 5).tolist() == [1, 2, 3, 4, 5]


@settings(max_examples=100, deadline=None)
@given(
    leading=st.lists(st.integers(1, 3), max_size=2),
    length=st.integers(1, 129),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_codes_round_trip(leading, length, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*leading, length), dtype=torch.uint8, generator=generator)
    packed = pack_4bit(codes)
    assert packed.shape == (*leading, (length + 1) // 2)
    assert torch.equal(unpack_4bit(packed, length), codes)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="uint8"):
        pack_4bit(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="uint8"):
        unpack_4bit(torch.zeros(4, dtype=torch.int16))
    with pytest.raises(ValueError, match="hold 7 or 8 codes, not 5"):
        unpack_4bit(torch.zeros(4, dtype=torch.uint8), 5)
