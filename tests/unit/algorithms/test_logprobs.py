import math

import pytest
import torch

from fsdp_rlhf.algorithms import entropy_from_logits, logprobs_from_logits
from tests.unit.algorithms.helpers import SEEDS, make_gen, randn


def _inputs(seed: int, batch: int = 3, length: int = 7, vocab: int = 13):
    gen = make_gen(seed)
    logits = randn(batch, length, vocab, gen=gen) * 4
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    return logits, labels


@pytest.mark.parametrize("seed", SEEDS)
def test_logprobs_match_python_reference(seed):
    logits, labels = _inputs(seed)
    out = logprobs_from_logits(logits, labels, chunk_size=4)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = logits[b, t].tolist()
            lse = math.log(sum(math.exp(z) for z in row))
            assert out[b, t].item() == pytest.approx(row[labels[b, t]] - lse, abs=1e-10)


@pytest.mark.parametrize("seed", SEEDS[:6])
@pytest.mark.parametrize("chunk_size", [1, 5, 8, None])
def test_chunked_logprobs_equal_log_softmax_gather_with_grads(seed, chunk_size):
    logits, labels = _inputs(seed, batch=4, length=6, vocab=17)
    weights = torch.randn(4, 6, generator=make_gen(seed + 100), dtype=torch.float64)

    ref_logits = logits.clone().requires_grad_(True)
    ref = torch.log_softmax(ref_logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (ref * weights).sum().backward()

    test_logits = logits.clone().requires_grad_(True)
    out = logprobs_from_logits(test_logits, labels, chunk_size=chunk_size)
    (out * weights).sum().backward()

    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(test_logits.grad, ref_logits.grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_matches_reference_and_chunking(seed):
    logits, _ = _inputs(seed)
    probs = torch.softmax(logits, -1)
    ref = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    unchunked_in = logits.clone().requires_grad_(True)
    chunked_in = logits.clone().requires_grad_(True)
    unchunked = entropy_from_logits(unchunked_in, chunk_size=None)
    chunked = entropy_from_logits(chunked_in, chunk_size=2)
    torch.testing.assert_close(unchunked, ref)
    torch.testing.assert_close(chunked, ref)
    unchunked.sum().backward()
    chunked.sum().backward()
    torch.testing.assert_close(chunked_in.grad, unchunked_in.grad)
    assert unchunked_in.grad.abs().sum() > 0


def test_half_precision_is_upcast():
    logits, labels = _inputs(0, vocab=1000)
    out = logprobs_from_logits(logits.bfloat16(), labels, chunk_size=5)
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.bfloat16().double(), -1).gather(-1, labels.unsqueeze(-1))
    torch.testing.assert_close(out.double(), ref.squeeze(-1), atol=1e-5, rtol=1e-5)
    assert entropy_from_logits(logits.half(), chunk_size=5).dtype == torch.float32


def test_rejects_bad_arguments():
    logits, labels = _inputs(0)
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels[:, :-1])
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, labels, chunk_size=0)
