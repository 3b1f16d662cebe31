"""Shared random inputs for the algorithm tests: ragged masks and a seeded generator."""

from __future__ import annotations

import torch

SEEDS = list(range(12))


def make_gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ragged_mask(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Bool (B, T) mask mixing right padding, left padding, holes and one empty row."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row in range(batch):
        start = int(torch.randint(0, length // 3 + 1, (1,), generator=gen))
        end = int(torch.randint(start + 1, length + 1, (1,), generator=gen))
        mask[row, start:end] = True
        if end - start > 3 and torch.rand((), generator=gen) < 0.3:
            mask[row, start + 1] = False  # a hole inside the response
    mask[int(torch.randint(0, batch, (1,), generator=gen))] = False
    return mask


def valid_positions(mask: torch.Tensor, row: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if bool(mask[row, t])]


def randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)
