"""Padding-free forwards (`--packing_samples`): packing layout, and scores and gradients equal to
the padded forward, with both attention kernels and with grouped-query attention."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_rlhf.config import BackendConfig
from fsdp_rlhf.models import attention
from fsdp_rlhf.models.attention import (
    FLASH_ATTENTION,
    VARLEN_ATTENTION,
    use_varlen_attention,
    varlen_attention_impl,
)
from fsdp_rlhf.models.forward import sequence_scores
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_scalar_model
from fsdp_rlhf.models.packing import pack_rows
from tests.ppo_batches import ppo_layout_batch


def test_pack_rows_layout_for_left_and_right_padding():
    ids = torch.tensor([[5, 6, 7, 0], [0, 0, 8, 9], [1, 2, 3, 4]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert packed.last_index.tolist() == [2, 4, 8]
    assert packed.max_len == 4
    with pytest.raises(ValueError, match="no tokens"):
        pack_rows(ids, torch.zeros_like(mask))
    inputs = packed.model_inputs()
    # flash-attn's varlen kernel rejects int64 offsets
    assert inputs["cu_seq_lens_q"].dtype == inputs["cu_seq_lens_k"].dtype == torch.int32
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and inputs["max_length_q"] == 4


@pytest.mark.parametrize(
    "device_type,flash_attn,importable,expected",
    [
        ("cuda", True, True, FLASH_ATTENTION),
        ("cuda", True, False, VARLEN_ATTENTION),
        ("cuda", False, True, VARLEN_ATTENTION),
        ("cpu", True, True, VARLEN_ATTENTION),
        ("cpu", False, False, VARLEN_ATTENTION),
    ],
)
def test_varlen_attention_choice(device_type, flash_attn, importable, expected):
    assert varlen_attention_impl(device_type, flash_attn, importable) == expected


def test_packing_keeps_flash_attention_2_of_a_flash_loaded_model(tiny_qwen2, monkeypatch):
    """--flash_attn --packing_samples on CUDA: HF's flash varlen path, not the Python loop."""
    from fsdp_rlhf.models.load import load_causal_lm

    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: True)
    flash = copy.deepcopy(model)
    flash.config._attn_implementation = FLASH_ATTENTION  # as models.load picks it on CUDA
    use_varlen_attention(flash, "cuda")
    assert flash.config._attn_implementation == FLASH_ATTENTION
    use_varlen_attention(model, "cuda")  # loaded without --flash_attn
    assert model.config._attn_implementation == VARLEN_ATTENTION
    monkeypatch.setattr(attention, "flash_attn_importable", lambda: False)
    use_varlen_attention(flash, "cuda")
    assert flash.config._attn_implementation == VARLEN_ATTENTION


@pytest.mark.gpu
def test_flash_attention_packed_logprobs_match_padded_sdpa_on_cuda(tiny_llama):
    pytest.importorskip("flash_attn")
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm

    cuda = torch.device("cuda")
    backend = BackendConfig(bf16=True, flash_attn=True)
    packed = load_causal_lm(tiny_llama, backend, cuda).to(cuda, torch.bfloat16)
    use_varlen_attention(packed, "cuda")
    assert packed.config._attn_implementation == FLASH_ATTENTION
    padded = copy.deepcopy(packed)
    padded.set_attn_implementation("sdpa")
    ids, mask, rmask = _ppo_batch(packed.config.vocab_size, pad=0)
    ids, mask, rmask = ids.to(cuda), mask.to(cuda), rmask.to(cuda)
    T = rmask.shape[1]
    ref, _ = response_logprobs(padded, forward_inputs(ids, mask), T)
    got, _ = response_logprobs(packed, forward_inputs(ids, mask, packed=True), T)
    on = rmask.bool()
    torch.testing.assert_close(got[on].float(), ref[on].float(), rtol=0, atol=5e-2)


def _batch(vocab: int, pad: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (5, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # right padding
    mask[3, :6] = 0  # left padding
    mask[4, 2:] = 0  # a 2-token sequence
    return ids.masked_fill(mask == 0, pad), mask


@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny import build_model

    path = tmp_path_factory.mktemp("tiny_gqa")
    return str(build_model(path, "qwen2", num_heads=2, num_kv_heads=1, seed=3))


@pytest.mark.parametrize("explicit_max_len", [512, 0])  # explicit attention; SDPA kernels
@pytest.mark.parametrize("model_fixture", ["tiny_qwen2", "tiny_gqa"])
def test_packed_scores_and_grads_match_padded(
    model_fixture, explicit_max_len, request, monkeypatch
):
    monkeypatch.setattr(attention, "CPU_EXPLICIT_ATTENTION_MAX_LEN", explicit_max_len)
    path = request.getfixturevalue(model_fixture)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    padded = load_scalar_model(path, BackendConfig(), cpu, value_head_prefix="score")
    padded.config.pad_token_id = 0
    packed = copy.deepcopy(padded)
    use_varlen_attention(packed)
    ids, mask = _batch(padded.config.vocab_size, pad=0)
    a, b = (
        sequence_scores(padded, forward_inputs(ids, mask)),
        sequence_scores(packed, forward_inputs(ids, mask, packed=True)),
    )
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    (a * torch.arange(1.0, 6.0)).sum().backward()
    (b * torch.arange(1.0, 6.0)).sum().backward()
    for (name, p), q in zip(padded.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def _ppo_batch(vocab: int, pad: int, P: int = 7, T: int = 6):
    """PPO layout: prompts left-padded to P, responses right-padded to T (EOS then pads)."""
    g = torch.Generator().manual_seed(1)
    return ppo_layout_batch(g, vocab, [7, 3, 5, 1], [6, 2, 4, 1], P, T, pad)


# tiny_llama: 9 query / 3 KV heads and tied embeddings, as published small Llamas
@pytest.mark.parametrize("model_fixture", ["tiny_qwen2", "tiny_gqa", "tiny_llama"])
def test_packed_response_logprobs_and_grads_match_padded(model_fixture, request):
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm

    torch.manual_seed(0)
    padded = load_causal_lm(request.getfixturevalue(model_fixture), BackendConfig(), "cpu")
    packed = copy.deepcopy(padded)
    use_varlen_attention(packed)
    ids, mask, rmask = _ppo_batch(padded.config.vocab_size, pad=0)
    T = rmask.shape[1]
    outs = []
    for model, flag in ((padded, False), (packed, True)):
        lp, ent = response_logprobs(
            model, forward_inputs(ids, mask, packed=flag), T, temperature=0.7, with_entropy=True
        )
        ((lp + 0.1 * ent) * rmask * torch.arange(1.0, 5.0)[:, None]).sum().backward()
        outs.append((lp * rmask, ent * rmask))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-5)
    assert (outs[0][0][rmask.bool()] < 0).all()  # real log-probs, not zeros
    for (name, p), q in zip(padded.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_packed_token_values_match_padded_at_attended_positions(tiny_qwen2):
    from fsdp_rlhf.models.forward import token_values
    from fsdp_rlhf.models.inputs import forward_inputs

    torch.manual_seed(0)
    padded = load_scalar_model(tiny_qwen2, BackendConfig(), "cpu", value_head_prefix="score")
    padded.config.pad_token_id = 0
    packed = copy.deepcopy(padded)
    use_varlen_attention(packed)
    ids, mask, _ = _ppo_batch(padded.config.vocab_size, pad=0)
    a = token_values(padded, forward_inputs(ids, mask))
    b = token_values(packed, forward_inputs(ids, mask, packed=True))
    assert b.shape == a.shape
    on = mask.bool()
    torch.testing.assert_close(b[on], a[on], rtol=1e-5, atol=1e-5)
    assert a[on].std() > 0  # values differ across positions: a misaligned gather would show


def test_entropy_keeps_no_graph_unless_its_gradient_is_wanted(tiny_qwen2):
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm

    model = load_causal_lm(tiny_qwen2, BackendConfig(), "cpu")
    ids, mask, rmask = _ppo_batch(model.config.vocab_size, pad=0)
    T = rmask.shape[1]
    lp, metric = response_logprobs(
        model, forward_inputs(ids, mask), T, with_entropy=True, entropy_grad=False
    )
    _, trained = response_logprobs(model, forward_inputs(ids, mask), T, with_entropy=True)
    assert lp.requires_grad and not metric.requires_grad and trained.requires_grad
    torch.testing.assert_close(metric, trained.detach())


@pytest.mark.parametrize("grad", [False, True])  # SDPA kernel, explicit kernel
def test_packed_sliding_window_layers_match_the_padded_forward(tmp_path, grad):
    """Gemma 3's local layers see their last ``sliding_window`` keys in packed forwards too
    (sequences here are twice the window of the tiny model)."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.testing.tiny import build_family

    model = load_causal_lm(str(build_family(tmp_path, "gemma3")), BackendConfig(), "cpu")
    assert model.config.sliding_window == 16
    g = torch.Generator().manual_seed(0)
    ids, mask, rmask = ppo_layout_batch(
        g, model.config.vocab_size, [12, 20, 7], [20, 14, 25], 20, 25
    )
    with torch.set_grad_enabled(grad):
        padded, _ = response_logprobs(model, forward_inputs(ids, mask), 25)
        use_varlen_attention(model, "cpu")
        packed, _ = response_logprobs(model, forward_inputs(ids, mask, packed=True), 25)
    on = rmask.bool()
    torch.testing.assert_close(packed[on], padded[on], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True])
def test_packed_linear_attention_restarts_at_each_sequence(tmp_path, grad):
    """Qwen3.5's gated-delta-net layers (transformers' PyTorch fallback, no kernel package)
    carry no state from one packed sequence into the next: packed equals padded."""
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.testing.tiny import build_family

    model = load_causal_lm(str(build_family(tmp_path, "qwen3_5")), BackendConfig(), "cpu")
    g = torch.Generator().manual_seed(1)
    ids, mask, rmask = ppo_layout_batch(g, model.config.vocab_size, [12, 20, 7], [9, 14, 5], 20, 14)
    with torch.set_grad_enabled(grad):
        padded, _ = response_logprobs(model, forward_inputs(ids, mask), 14)
        use_varlen_attention(model, "cpu")
        packed, _ = response_logprobs(model, forward_inputs(ids, mask, packed=True), 14)
    on = rmask.bool()
    torch.testing.assert_close(packed[on], padded[on], rtol=1e-4, atol=1e-4)
