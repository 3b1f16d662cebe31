"""Log-probs and entropies read chunk by chunk (issue #30): the same values and gradients as the
full-logits formula they replace (upcast (B, T, V), ``/ temperature``, ``log_softmax``), in
fp32 and bf16, for the padded, packed and shared-prompt layouts, with and without
``logits_to_keep``."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_rlhf.algorithms import gathered_logprobs
from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models import forward
from fsdp_rlhf.models.attention import use_varlen_attention
from fsdp_rlhf.models.forward import position_ids_from_mask, response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_causal_lm
from tests.ppo_batches import ppo_layout_batch


def _reference(logits, labels, temperature):
    """The formula before issue #30: one fp32 copy of the logits, then log_softmax."""
    z = (logits.float() if logits.dtype == torch.bfloat16 else logits) / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gathered_rows_values_and_grads_match_log_softmax(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    # (3, 4) labels read from rows of the 10 flattened positions, one row twice, some never
    index = torch.tensor([[0, 1, 2, 2], [5, 6, 9, 8], [3, 4, 7, 1]])
    labels = torch.randint(0, 11, (3, 4), generator=g)
    w_lp, w_ent = torch.randn(3, 4, generator=g, dtype=torch.float64), 0.3
    lp, ent = gathered_logprobs(
        logits,
        labels,
        index,
        temperature=temperature,
        with_entropy=True,
        chunk_size=chunk_size,
    )
    ((lp * w_lp).sum() + w_ent * ent.sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    rows = logits.reshape(-1, 11)[index]
    ref_lp, ref_ent = _reference(rows, labels, temperature)
    ((ref_lp * w_lp).sum() + w_ent * ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(got, logits.grad)
    assert got.reshape(-1, 11)[[0, 1, 2]].abs().sum() > 0


def test_gathered_rows_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 2, 2], [6, 1, 3]])
    labels = torch.tensor([[1, 5, 0], [2, 2, 4]])

    def fn(x):
        lp, ent = gathered_logprobs(
            x, labels, index, temperature=0.8, with_entropy=True, chunk_size=2
        )
        return lp, ent

    assert torch.autograd.gradcheck(fn, (logits,))


def test_a_half_precision_chunk_is_upcast_and_never_the_whole():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 4, 1000, generator=g) * 4).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 1000, (3, 4), generator=g)
    lp, ent = gathered_logprobs(logits, labels, with_entropy=True, chunk_size=5)
    assert lp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = _reference(logits.detach(), labels, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def _old_response_logprobs(model, ids, mask, T, temperature):
    """models.forward.response_logprobs before issue #30 (padded layout)."""
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits
    return _reference(logits[:, -T - 1 : -1], ids[:, -T:], temperature)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["padded", "packed", "shared", "no_logits_to_keep"])
def test_response_logprobs_equal_the_full_logits_formula(tiny_qwen2, layout, dtype, monkeypatch):
    torch.manual_seed(0)
    old = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu").to(dtype)
    new = copy.deepcopy(old)
    g = torch.Generator().manual_seed(3)
    if layout == "shared":  # two groups of two rows sharing their prompt
        ids, mask, rmask = ppo_layout_batch(
            g, old.config.vocab_size, [5, 5, 2, 2], [6, 3, 4, 1], 7, 6
        )
        ids[1, :7], ids[3, :7] = ids[0, :7], ids[2, :7]
    else:
        ids, mask, rmask = ppo_layout_batch(
            g, old.config.vocab_size, [7, 3, 5, 1], [6, 2, 4, 1], 7, 6
        )
    if layout == "packed":
        use_varlen_attention(new)
    if layout == "no_logits_to_keep":  # a remote-code model whose forward lacks the keyword
        monkeypatch.setitem(forward._KEEPS_LOGITS, type(new), False)
    T, weights = rmask.shape[1], torch.arange(1.0, 5.0)[:, None] * rmask
    ref_lp, ref_ent = _old_response_logprobs(old, ids, mask, T, 0.7)
    ((ref_lp + 0.1 * ref_ent) * weights).sum().backward()
    lp, ent = response_logprobs(
        new,
        forward_inputs(
            ids,
            mask,
            packed=layout == "packed",
            group_size=2 if layout == "shared" else 1,
            response_len=T,
        ),
        T,
        temperature=0.7,
        with_entropy=True,
    )
    ((lp + 0.1 * ent) * weights).sum().backward()
    on = rmask.bool()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lp[on], ref_lp[on], **tol)
    torch.testing.assert_close(ent[on], ref_ent[on], **tol)
    ref_grads, grads = _grads(old), _grads(new)
    assert ref_grads.keys() == grads.keys() and "lm_head.weight" in grads
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(
            grad, ref_grads[name], rtol=tol["rtol"], atol=tol["atol"] * scale, msg=name
        )
