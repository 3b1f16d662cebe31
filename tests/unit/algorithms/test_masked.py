import math

import pytest
import torch

from fsdp_rlhf.algorithms import masked_mean, masked_sum, masked_var, masked_whiten
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn


def _valid(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    flat_v, flat_m = values.flatten().tolist(), mask.flatten().tolist()
    return [v for v, m in zip(flat_v, flat_m, strict=True) if m]


def _ref_mean_var(xs: list[float], unbiased: bool) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    denom = len(xs) - 1 if unbiased else len(xs)
    return mean, sum((x - mean) ** 2 for x in xs) / denom


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_stats_match_reference(seed):
    gen = make_gen(seed)
    mask = ragged_mask(6, 11, gen)
    values = randn(6, 11, gen=gen) * 3 + 1
    xs = _valid(values, mask)
    for unbiased in (True, False):
        mean, var = _ref_mean_var(xs, unbiased)
        assert masked_var(values, mask, unbiased=unbiased).item() == pytest.approx(var, rel=1e-10)
    assert masked_sum(values, mask).item() == pytest.approx(sum(xs), rel=1e-10, abs=1e-12)
    assert masked_mean(values, mask).item() == pytest.approx(mean, rel=1e-10)


@pytest.mark.parametrize("seed", SEEDS[:4])
def test_masked_mean_along_dim(seed):
    gen = make_gen(seed)
    mask = ragged_mask(5, 9, gen)
    values = randn(5, 9, gen=gen)
    per_row = masked_mean(values, mask, dim=-1)
    row_sums = masked_sum(values, mask, dim=-1)
    for row in range(5):
        xs = _valid(values[row], mask[row])
        expected = sum(xs) / len(xs) if xs else 0.0
        assert per_row[row].item() == pytest.approx(expected, abs=1e-12)
        assert row_sums[row].item() == pytest.approx(sum(xs), abs=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_whiten_reference_and_moments(seed):
    gen = make_gen(seed)
    mask = ragged_mask(6, 10, gen)
    values = randn(6, 10, gen=gen) * 5 - 2
    xs = _valid(values, mask)
    mean, var = _ref_mean_var(xs, unbiased=True)
    out = masked_whiten(values, mask, eps=0.0)
    for row in range(6):
        for t in range(10):
            expected = (values[row, t].item() - mean) / math.sqrt(var) if mask[row, t] else 0.0
            assert out[row, t].item() == pytest.approx(expected, abs=1e-10)
    assert masked_mean(out, mask).item() == pytest.approx(0.0, abs=1e-10)
    assert masked_var(out, mask).item() == pytest.approx(1.0, rel=1e-10)


def test_whiten_without_shift_keeps_mean_direction():
    gen = make_gen(0)
    mask = ragged_mask(4, 8, gen)
    values = randn(4, 8, gen=gen) + 10.0
    out = masked_whiten(values, mask, shift_mean=False, eps=0.0)
    std = masked_var(values, mask).sqrt()
    torch.testing.assert_close(out, values / std * mask)
    assert masked_mean(out, mask).item() > 1.0


def test_padding_garbage_does_not_leak():
    gen = make_gen(1)
    mask = ragged_mask(4, 8, gen)
    values = randn(4, 8, gen=gen)
    dirty = values.masked_fill(~mask, float("nan"))
    dirty[~mask & (torch.arange(8) % 2 == 0)] = float("inf")
    for fn in (masked_sum, masked_mean, masked_var):
        torch.testing.assert_close(fn(dirty, mask), fn(values, mask))
    torch.testing.assert_close(masked_whiten(dirty, mask), masked_whiten(values, mask))


def test_empty_mask_is_finite():
    values = torch.randn(3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert masked_mean(values, mask).item() == 0.0
    assert torch.isfinite(masked_whiten(values, mask)).all()
