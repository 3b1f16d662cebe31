import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdp_rlhf.algorithms import masked_mean, masked_var, masked_whiten
from fsdp_rlhf.distributed.stats import (
    global_masked_mean,
    global_masked_var,
    global_masked_whiten,
    global_token_count,
)
from tests.unit.algorithms.helpers import SEEDS, make_gen, ragged_mask, randn


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_global_helpers_fall_back_to_local_without_process_group(seed):
    assert not dist.is_initialized()
    gen = make_gen(seed)
    mask = ragged_mask(5, 8, gen)
    values = randn(5, 8, gen=gen) * 2 + 3
    torch.testing.assert_close(global_masked_mean(values, mask), masked_mean(values, mask))
    torch.testing.assert_close(global_masked_var(values, mask), masked_var(values, mask))
    torch.testing.assert_close(global_masked_whiten(values, mask), masked_whiten(values, mask))
    torch.testing.assert_close(
        global_masked_whiten(values, mask, shift_mean=False),
        masked_whiten(values, mask, shift_mean=False),
    )
    assert global_token_count(mask) == int(mask.sum())
    assert global_token_count([mask, mask[:2]]) == int(mask.sum() + mask[:2].sum())


def test_global_whiten_keeps_float32_dtype():
    values = torch.randn(3, 4) * 1000 + 1e4
    mask = torch.ones(3, 4, dtype=torch.bool)
    out = global_masked_whiten(values, mask)
    assert out.dtype == torch.float32
    assert out.mean().abs().item() < 1e-4


def test_global_token_count_rejects_empty():
    with pytest.raises(ValueError):
        global_token_count([])


def test_import_pulls_in_no_model_or_inference_stack():
    code = (
        "import fsdp_rlhf.algorithms, sys; "
        "assert 'transformers' not in sys.modules and 'vllm' not in sys.modules"
    )
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root
    )
    assert result.returncode == 0, result.stderr
