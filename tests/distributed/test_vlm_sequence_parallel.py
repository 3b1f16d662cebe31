"""A vision-language model under Ulysses sequence parallelism on 2 gloo ranks (fp32): every rank
merges the image features into the whole rows' embeddings, then its language model takes its
slice of them and of the M-RoPE positions (``models.ulysses.slice_language_inputs``; Qwen3-VL's
deepstack features with them). SP=2 gives the unsplit forward's log-probs (the causal model)
and values (the scalar-head model of critics and reward models, ``models.vision_head``), losses
and gradients (the vision tower's included) within 1e-5 relative, on padded and packed rows
with images of three sizes and a text-only row, for a tiny Qwen2.5-VL and Qwen3-VL. Runs under
``make test-sp``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.sp]
pytest.importorskip("torchvision")  # the processor needs it (make install has it)

T = 5  # response tokens
CASES = [(kind, layout) for kind in ("policy", "values") for layout in ("padded", "packed")]


def _fresh(path: str, kind: str, layout: str):
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.attention import use_varlen_attention
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model

    if kind == "policy":
        model = load_causal_lm(path, BackendConfig(), torch.device("cpu"))
    else:
        model = load_scalar_model(path, BackendConfig(), torch.device("cpu"))
        torch.manual_seed(0)  # the same head on every call
        torch.nn.init.normal_(model.score.weight, std=0.1)
    if layout == "packed":
        use_varlen_attention(model, "cpu")
    model.train()  # dropout is 0: train mode only takes the backward paths
    return model


def _split(model, sp):
    from fsdp_rlhf.config import FSDPConfig
    from fsdp_rlhf.distributed.fsdp import build_mesh, shard_model
    from fsdp_rlhf.models.ulysses import use_ulysses_attention

    use_ulysses_attention(model)
    mesh = build_mesh(torch.device("cpu"), 2)
    return shard_model(model, mesh, FSDPConfig(), bf16=False, grad_reduce="mean", dp_size=1)


def _run(model, vision, kind: str, layout: str, sp=None):
    """Response log-probs (B, T) and a policy-gradient loss, or values (B, L) and a value
    loss, at the attended tokens."""
    from fsdp_rlhf.models.forward import response_logprobs, token_values
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.testing.tiny_vlm import mixed_image_rows

    ids, mask, images = mixed_image_rows(vision, T)
    inputs = forward_inputs(
        ids, mask, packed=layout == "packed", images=images, vision=vision.tokens, sp=sp
    )
    g = torch.Generator().manual_seed(1)
    if kind == "values":
        valid = mask.float()
        values = token_values(model, inputs)
        target = torch.randn(valid.shape, generator=g)
        return values * valid, ((values - target) ** 2 * valid).sum() / valid.sum()
    valid = mask[:, -T:].float()
    adv = torch.randn(valid.shape, generator=g) * valid
    lp, _ = response_logprobs(model, inputs, T)
    return lp * valid, -(lp * adv).sum() / valid.sum()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _compare(rank: int, world: int, path: str) -> dict:
    from fsdp_rlhf.data.vision import VisionProcessor
    from fsdp_rlhf.distributed.layout import build_layout

    sp = build_layout(2).sp
    vision = VisionProcessor.from_pretrained(path)
    out = {}
    for case in CASES:
        ref_model = _fresh(path, *case)
        ref, ref_loss = _run(ref_model, vision, *case)
        ref_loss.backward()
        ref_grads = {
            n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None
        }
        model = _split(_fresh(path, *case), sp)
        got, loss = _run(model, vision, *case, sp)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        out[case] = (_rel(got.detach(), ref.detach()), loss.item(), ref_loss.item())
        out[(*case, "names")] = sorted(grads) == sorted(ref_grads)
        out[(*case, "tower")] = sum(".visual." in n for n in grads)
        out[(*case, "grads")] = max((_rel(grads[n], g), n) for n, g in ref_grads.items())
    return out


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_sp2_equals_the_unsplit_vlm_forward_and_backward(arch, tmp_path):
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    path = str(build_vl_model(tmp_path / arch, arch))
    per_rank = run_distributed(_compare, 2, path)
    for rank in range(2):
        res = per_rank[rank]
        print(arch, rank, res)
        for case in CASES:
            rel, loss, ref_loss = res[case]
            assert rel < 1e-5, (rank, case, rel)
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (rank, case, loss, ref_loss)
            assert res[(*case, "names")] and res[(*case, "tower")] > 0, (rank, case)
            worst, name = res[(*case, "grads")]
            assert worst < 1e-5, (rank, case, name, worst)
