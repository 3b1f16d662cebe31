"""The 2026 features' CUDA paths on one GPU (issue #45): Ulysses attention with the SDPA and
flash-attn kernels inside it (its all-to-alls on a 1-rank NCCL group), an MoE actor's update
with ``--adam_offload`` (routers on the GPU, parameters and Adam on the host), and a
vision-language model's training forward and backward through its vision tower."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.suite import require

pytestmark = pytest.mark.gpu


def _device() -> torch.device:
    from fsdp_rlhf.distributed.env import init_distributed

    return init_distributed().device


def _ulysses_against_whole_rows(model_path: str, inner: str, device: torch.device) -> dict:
    """bf16 logits and gradients of a padded batch (left padding), plain attention against
    Ulysses around ``inner`` on a 1-rank group: the same kernels on the same rows."""
    import torch.distributed as dist

    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.ulysses import ULYSSES_ATTENTION, UlyssesContext, register_ulysses

    register_ulysses()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(model_path, BackendConfig(), device, dtype=dtype).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (4, 256), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    mask[3, :101] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    on = mask.bool()
    out = {}
    for name in ("whole", "ulysses"):
        model.zero_grad(set_to_none=True)
        if name == "whole":
            model.set_attn_implementation(inner)
            logits = model(ids, attention_mask=mask, position_ids=pos).logits
        else:
            model.set_attn_implementation(ULYSSES_ATTENTION)
            ctx = UlyssesContext(dist.group.WORLD, 1, ids.shape[1], inner, on)
            logits = model(ids, position_ids=pos, sequence_parallel=ctx).logits
        logits[on].float().logsumexp(-1).mean().backward()
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        out[name] = (logits[on].float().detach(), grad)
    gap = (out["ulysses"][0] - out["whole"][0]).abs().max().item()
    rel = ((out["ulysses"][1] - out["whole"][1]).norm() / out["whole"][1].norm()).item()
    return {"logit_gap": gap, "grad_rel": rel}


@pytest.mark.parametrize("kernel", ["sdpa", "flash_attention_2"])
def test_ulysses_forward_backward(kernel, tmp_path, detail):
    """Issue #45, finding 1 (flash inside Ulysses raised at the first attention call)."""
    from tests.gpu.suite import build_odd_model

    require("cuda", *(["flash_attn"] if kernel == "flash_attention_2" else []))
    device = _device()
    r = _ulysses_against_whole_rows(build_odd_model(tmp_path / "m"), kernel, device)
    tol = 2e-2 if device.type == "cuda" else 1e-4
    assert r["logit_gap"] < tol * 10 and r["grad_rel"] < tol, r
    detail(f"{kernel} inside Ulysses (1-rank NCCL all-to-alls), bf16: max |logit diff| "
           f"{r['logit_gap']:.2e}, grad rel diff {r['grad_rel']:.2e}")  # fmt: skip


def _moe_update_with_adam_offload(model_path: str, device: torch.device) -> dict:
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.env import init_distributed
    from fsdp_rlhf.distributed.fsdp import clip_grad_norm_
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.moe import MoEHooks
    from fsdp_rlhf.optim import build_optimizer
    from fsdp_rlhf.trainers.ppo.setup import load_ppo_model

    flags = ["--pretrain", model_path, "--bf16", "--adam_offload", "--zero_stage", "3",
             "--aux_loss_coef", "0.01"]  # fmt: skip
    cfg = build_config(PPOConfig, flags)[0]
    env = init_distributed()

    def load(weights: bool):
        return load_causal_lm(model_path, cfg.backend, env.device, weights=weights)

    actor = load_ppo_model(load, cfg, env, trainable=True, what="the MoE actor")
    hooks = MoEHooks.attach(actor)
    optim = build_optimizer(actor, cfg.actor_optim)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 400, (4, 64), generator=g).to(device)
    mask = torch.ones_like(ids)
    with hooks.routing(replay=None, valid=mask.bool(), collect=True):
        lp, _ = response_logprobs(actor, forward_inputs(ids, mask), 32)
        loss = -lp.mean() + 0.01 * hooks.aux_loss()
        loss.backward()
    norm = clip_grad_norm_(list(actor.parameters()), 1.0)
    optim.step()
    metrics = hooks.pop_metrics()
    places = {p.to_local().device.type for p in actor.parameters()}
    return {"loss": loss.item(), "grad_norm": float(norm), "metrics": metrics, "params": places}


def test_moe_actor_update_with_adam_offload(tmp_path, detail):
    """Issue #45, finding 4: the routing statistics lived on the parameters' device (the host
    under CPUOffloadPolicy) while the routers run on the GPU."""
    from fsdp_rlhf.testing.tiny import build_family

    require("cuda")
    path = str(build_family(tmp_path / "moe", "qwen3_moe", seed=4))
    r = _moe_update_with_adam_offload(path, _device())
    assert r["params"] == {"cpu"} and r["metrics"]["moe/expert_load_max_mean"] >= 1.0, r
    load = r["metrics"]["moe/expert_load_max_mean"]
    detail(f"loss {r['loss']:.3f}, grad norm {r['grad_norm']:.3f}, expert load max/mean "
           f"{load:.2f}; params and Adam on the host")  # fmt: skip


def _vlm_training_step(model_path: str, device: torch.device) -> dict:
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.data.vision import VisionProcessor
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.vision import ImageBatch, vision_tower
    from fsdp_rlhf.testing.tiny_vlm import COLOURS, solid_image

    vision = VisionProcessor.from_pretrained(model_path)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(model_path, BackendConfig(), device, dtype=dtype).to(device)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what"}]}]
    ids = vision.tokenizer(vision.render(prompt, True), add_special_tokens=False)["input_ids"]
    rows, images = [], []
    for colour in ("red", "blue"):
        inputs = vision.process([solid_image(COLOURS[colour])])
        rows.append(vision.expand(ids, inputs.tokens(2)) + [9, 10])
        images.append(inputs)
    x = torch.tensor(rows, device=device)
    mask = torch.ones_like(x)
    built = forward_inputs(x, mask, images=ImageBatch(images), vision=vision.tokens)
    lp, _ = response_logprobs(model, built, 2)
    (-lp.float().mean()).backward()
    tower = vision_tower(model)
    tower_grads = [p.grad for p in tower.parameters() if p.grad is not None]
    finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    return {"lp": lp.detach().float().cpu(), "tower_grads": len(tower_grads), "finite": finite}


def test_vlm_training_forward_backward(tmp_path, detail):
    """A Qwen2.5-VL's log-probs and gradients through its vision tower, on the GPU."""
    pytest.importorskip("torchvision")
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    require("cuda")
    r = _vlm_training_step(str(build_vl_model(tmp_path / "vl")), _device())
    assert r["finite"] and r["tower_grads"] > 0, r
    assert not torch.allclose(r["lp"][0], r["lp"][1]), "the pixels do not reach the log-probs"
    detail(f"log-probs {r['lp'].tolist()}, {r['tower_grads']} vision-tower grads, all finite")


def test_async_rollout_rank_memory_plan_on_this_device(big_model, detail):
    """Issue #45, finding 3, on the real device: an --async_train rollout rank plans its engine
    alone (no trainer models on its GPU); the colocated plan is shown beside it."""
    from fsdp_rlhf.config import PPOConfig
    from fsdp_rlhf.config_base import build_config
    from fsdp_rlhf.distributed.memory_plan import resolve_vllm_utilization

    argv = ["--pretrain", big_model, "--remote_rm_url", "r.py", "--bf16", "--async_train",
            "--vllm_num_engines", "2"]  # fmt: skip
    cfg = build_config(PPOConfig, argv)[0]
    total = torch.cuda.mem_get_info()[1]
    colocated, _ = resolve_vllm_utilization(cfg, 1, total)
    util, line = resolve_vllm_utilization(cfg, 1, total, engine_only=True)
    assert util >= colocated and util == 0.9, line
    detail(f"rollout rank: {util:g} (colocated plan: {colocated:g}); {line}")
