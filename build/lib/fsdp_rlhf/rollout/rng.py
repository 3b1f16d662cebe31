"""A generation RNG kept apart from the training RNG.

vLLM seeds Python, NumPy and torch's global generators when it builds an engine, and its sampler
(like HF ``generate``) draws from torch's global generator. Swapping the global states in and out
around every engine call keeps the training RNG stream (dropout, data order) exactly as if no
generation had happened, and makes generation reproducible from its own seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class GlobalRngState:
    """Snapshot of every global generator an engine may touch."""

    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: torch.Tensor | None  # this rank's current device only: the one it samples on

    @classmethod
    def capture(cls) -> GlobalRngState:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state(self.torch_cuda)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


class GenerationRng:
    """Global-RNG state used only while an engine runs.

    Args:
        seed: seed of the generation stream. Ranks that must sample identically (one
            tensor-parallel engine) pass the same seed.
    """

    def __init__(self, seed: int) -> None:
        outer = GlobalRngState.capture()
        _seed_all(seed)
        self._state = GlobalRngState.capture()
        outer.restore()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the body on the generation RNG; the caller's RNG is restored afterwards."""
        outer = GlobalRngState.capture()
        self._state.restore()
        try:
            yield
        finally:
            self._state = GlobalRngState.capture()
            outer.restore()
