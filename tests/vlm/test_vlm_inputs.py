"""A vision-language model's rows packed into one row (``models.inputs``: each segment its own
M-RoPE positions, every segment's images in order) give the padded rows' log-probs and
gradients, for a tiny Qwen2.5-VL and Qwen3-VL (fp32, one process): rows with images of three
sizes and a text-only row."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.vlm]
pytest.importorskip("torchvision")  # the processor needs it (make install has it)

T = 5  # response tokens


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vlm(request, tmp_path_factory):
    from fsdp_rlhf.data.vision import VisionProcessor
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    path = str(build_vl_model(tmp_path_factory.mktemp(request.param), request.param))
    return path, VisionProcessor.from_pretrained(path)


def _logprobs_and_grads(model, inputs, weights):
    """Response log-probs (B, T) and each parameter's gradient of sum(weights * log-probs)."""
    from fsdp_rlhf.models.forward import response_logprobs

    model.zero_grad()
    lp, _ = response_logprobs(model, inputs, T)
    (lp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


def test_packed_rows_with_images_match_padded_rows(vlm):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.testing.tiny_vlm import mixed_image_rows

    path, vision = vlm
    model = load_causal_lm(path, BackendConfig(), torch.device("cpu"))
    ids, mask, images = mixed_image_rows(vision, T)
    valid = mask[:, -T:].bool()
    weights = torch.randn(valid.shape, generator=torch.Generator().manual_seed(1)) * valid
    padded = forward_inputs(ids, mask, images=images, vision=vision.tokens)
    lp_pad, g_pad = _logprobs_and_grads(model, padded, weights)

    use_varlen_attention(model, "cpu")
    assert model.config.vision_config._attn_implementation == "sdpa"  # the tower keeps its own
    packed = forward_inputs(ids, mask, packed=True, images=images, vision=vision.tokens)
    assert packed.kwargs["input_ids"].shape == (1, int(mask.sum()))
    assert packed.kwargs["image_grid_thw"].shape == (3, 3)
    lp_packed, g_packed = _logprobs_and_grads(model, packed, weights)

    torch.testing.assert_close(lp_packed[valid], lp_pad[valid], rtol=0, atol=1e-5)
    assert g_packed.keys() == g_pad.keys()
    assert any(".visual." in n for n in g_pad)  # the tower's gradients are compared too
    for name, g in g_pad.items():
        err = (g_packed[name] - g).abs().max() / g.abs().max().clamp(min=1e-12)
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"

    # the text positions alone (what packed rows of a text model carry) are not the model's
    from dataclasses import replace

    from fsdp_rlhf.models.forward import response_logprobs

    with torch.no_grad():
        lp_text, _ = response_logprobs(model, replace(packed, image_positions=None), T)
    assert (lp_text - lp_pad)[valid].abs().max() > 1e-4
