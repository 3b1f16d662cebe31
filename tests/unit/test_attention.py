"""The padded attention kernel (models.attention.padded_sdpa) against HF's SDPA, and
``--torch_compile`` (models.compile) against eager: same outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models import attention
from fsdp_rlhf.models.attention import PADDED_ATTENTION
from fsdp_rlhf.models.forward import response_logprobs, sequence_scores
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model
from tests.ppo_batches import ppo_layout_batch


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny import build_model

    path = tmp_path_factory.mktemp("tiny_gqa_attn")
    return str(build_model(path, "qwen2", num_heads=2, num_kv_heads=1, seed=3))


def _ppo_batch(vocab: int):
    """Left-padded prompts: the first positions of short rows attend to nothing."""
    g = torch.Generator().manual_seed(1)
    return ppo_layout_batch(g, vocab, [7, 3, 5, 1], [6, 2, 4, 1], 7, 6, 0)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_fixture", ["tiny_qwen2", "tiny_gqa"])
def test_padded_kernel_matches_sdpa_on_left_padded_batches(model_fixture, request):
    torch.manual_seed(0)
    ours = load_causal_lm(request.getfixturevalue(model_fixture), BackendConfig(), "cpu")
    assert ours.config._attn_implementation == PADDED_ATTENTION
    ref = copy.deepcopy(ours)
    ref.set_attn_implementation("sdpa")
    ids, mask, rmask = _ppo_batch(ours.config.vocab_size)
    T = rmask.shape[1]
    outs = []
    for model in (ref, ours):
        lp, _ = response_logprobs(model, forward_inputs(ids, mask), T)
        # the whole row, padding included, feeds the loss: a NaN anywhere would reach the grads
        (lp * torch.arange(1.0, 5.0)[:, None]).sum().backward()
        outs.append(lp)
    on = rmask.bool()
    torch.testing.assert_close(outs[1][on], outs[0][on], rtol=1e-5, atol=1e-5)
    grads_ref, grads = _grads(ref), _grads(ours)
    assert grads.keys() == grads_ref.keys() and grads
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_padded_kernel_is_sdpa_without_a_backward(tiny_qwen2, monkeypatch):
    calls = []
    real = attention._explicit_wanted
    monkeypatch.setattr(
        attention, "_explicit_wanted", lambda *a: calls.append(real(*a)) or calls[-1]
    )
    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    ids, mask, rmask = _ppo_batch(model.config.vocab_size)
    with torch.no_grad():
        response_logprobs(model, forward_inputs(ids, mask), rmask.shape[1])
    assert calls and not any(calls)
    response_logprobs(model, forward_inputs(ids, mask), rmask.shape[1])
    assert all(calls[-2:])  # both layers, with grad: the explicit kernel


@pytest.mark.long
def test_torch_compile_matches_eager(tiny_qwen2):
    from fsdp_rlhf.models.compile import compile_blocks

    torch.manual_seed(0)
    eager = load_scalar_model(tiny_qwen2, BackendConfig(), "cpu", value_head_prefix="score")
    eager.config.pad_token_id = 0
    compiled = copy.deepcopy(eager)
    assert compile_blocks(compiled) == 2 * 4  # 2 layers x (attention, MLP, 2 norms)
    ids, mask, _ = _ppo_batch(eager.config.vocab_size)
    for model in (eager, compiled):
        for rows in (slice(0, 4), slice(1, 3)):  # a second shape: recompiled, not wrong
            sequence_scores(model, forward_inputs(ids[rows], mask[rows])).sum().backward()
    a, b = (sequence_scores(m, forward_inputs(ids, mask)) for m in (eager, compiled))
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for name, g in _grads(eager).items():
        torch.testing.assert_close(_grads(compiled)[name], g, rtol=1e-3, atol=1e-5, msg=name)


def test_torch_compile_takes_a_new_sequence_length_without_recompiling(tiny_qwen2):
    """The first compile is already dynamic in the sequence dimension: a recompile at the
    second length stalled a later step of each rank (bench GRPO, 20 recompiles per run)."""
    from fsdp_rlhf.models.compile import compile_blocks

    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    compile_blocks(model)
    ids = torch.randint(
        2, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0)
    )
    model(input_ids=ids[:, :9]).logits.sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for length in (13, 23):
            model(input_ids=ids[:, :length]).logits.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_query_that_attends_to_nothing_gives_finite_outputs_in_every_dtype(dtype):
    """The explicit attention's mask floor is the input dtype's min: a float64 one, taken into a
    float32 softmax, was -inf, and a left-padding query's row NaN (then NaN gradients)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=dtype) for _ in range(3))
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    allowed[..., 0, :] = False  # a left-padding position: no key
    q.requires_grad_(True)
    out = attention._masked_attention(q, k, v, allowed, 8**-0.5, 0.0, explicit=True)
    out.sum().backward()
    assert out.dtype == dtype
    assert out.isfinite().all() and q.grad.isfinite().all()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[..., 1:, :].detach(), k, v, attn_mask=allowed[..., 1:, :], scale=8**-0.5
    )
    torch.testing.assert_close(out[..., 1:, :].detach(), ref)
