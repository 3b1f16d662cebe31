"""Delta weight sync's encodings, checksums and mirror on one process (no collectives)."""

from __future__ import annotations

import pytest
import torch

from fsdp_rlhf.distributed.delta_sync import (
    BucketLayout,
    Mirror,
    WeightSyncMismatch,
    checksum,
    choose_encoding,
    encode_bucket,
    encoded_bytes,
)


def _layout(dtype: torch.dtype, numel: int = 3000) -> BucketLayout:
    return BucketLayout.of(["w"], [(numel,)], [numel], 1, dtype)


def _changed(row: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    """``row`` with about ``frac`` of its elements moved by one unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    new = row.clone()
    bits = new.view(torch.int16 if row.element_size() == 2 else torch.int32)
    pick = torch.rand(row.numel(), generator=g) < frac
    bits[pick] += 1
    return new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("frac", [0.0, 0.002, 0.05, 0.6])
def test_delta_rebuilds_the_new_row_bit_for_bit(dtype, frac):
    layout = _layout(dtype)
    old = torch.zeros(layout.row, dtype=dtype)
    old[:3000] = torch.randn(3000).to(dtype)
    # values a float comparison would get wrong: -0.0 against 0.0, NaN against itself
    old[:4] = torch.tensor([0.0, -0.0, float("nan"), 1.0]).to(dtype)
    new = _changed(old, frac, seed=1)
    new[:4] = torch.tensor([-0.0, 0.0, float("nan"), 1.0]).to(dtype)
    mirror = Mirror()
    first = encode_bucket(old.clone(), None, None)
    assert first.encoding == "dense"
    list(mirror.apply(0, layout, first))
    delta = encode_bucket(new, old, None)
    ((name, got),) = mirror.apply(0, layout, delta)
    width = 2 if dtype == torch.bfloat16 else 4
    assert name == "w"
    assert torch.equal(got.view(torch.uint8), new[:3000].view(torch.uint8))
    changed = int(
        (new.view(torch.uint8).view(-1, width) != old.view(torch.uint8).view(-1, width))
        .any(1)
        .sum()
    )
    assert delta.changed == changed and changed >= 2  # the two zeros swapped signs
    assert delta.section == encoded_bytes(delta.encoding, layout.row, width, changed)
    assert delta.encoding == choose_encoding(layout.row, width, changed)


def test_encoding_choice_follows_the_sizes():
    row = 1 << 20
    # bf16: sparse costs 6 bytes per change, bitmap 1/8 byte per element + 2 per change
    assert choose_encoding(row, 2, 100) == "sparse"
    assert choose_encoding(row, 2, row // 20) == "bitmap"  # 5%: 0.3 B/elem against 0.225
    assert choose_encoding(row, 2, row) == "dense"
    assert choose_encoding(row, 4, row // 40) == "sparse"  # 2.5%: 0.2 against 0.225
    assert choose_encoding(row, 4, row // 2) == "bitmap"
    assert choose_encoding(row, 4, row - row // 40) == "dense"


def test_checksum_sees_any_one_changed_word():
    row = torch.randn(4096).to(torch.bfloat16)  # 8 KiB: two checksum rows
    base = checksum(row)
    words = row.view(torch.int64)
    for i in (0, 1, 511, 512, 1023):
        # -2**63 flips the top bit only: an even weight would wrap it to nothing
        for delta in (1, 1 << 40, -(1 << 62), -(1 << 63)):
            other = row.clone()
            other.view(torch.int64)[i] = words[i] + torch.tensor(delta)
            got = checksum(other)
            assert got[0] != base[0] and got[1] != base[1], (i, delta)
    swapped = row.clone()
    swapped.view(torch.int64)[[3, 700]] = words[[700, 3]]
    assert checksum(swapped) != base


def test_mirror_refuses_a_delta_that_does_not_fit():
    layout = _layout(torch.float32)
    old = torch.randn(layout.row)
    mirror = Mirror()
    with pytest.raises(WeightSyncMismatch, match="first sync must be full"):
        list(mirror.apply(0, layout, encode_bucket(_changed(old, 0.01, 2), old, None)))
    list(mirror.apply(0, layout, encode_bucket(old, None, None)))
    drifted = old.clone()
    drifted[7] += 1.0  # the engine side's copy is not what the sender last sent
    mirror.buffers[0][0].copy_(drifted)
    new = _changed(old, 0.01, 3)
    with pytest.raises(WeightSyncMismatch, match="checksum"):
        list(mirror.apply(0, layout, encode_bucket(new, old, None)))
