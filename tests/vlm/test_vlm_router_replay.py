"""Router replay on vision-language MoE models: tiny Qwen3-VL-MoE (fp32) and Qwen3.5-MoE
(hybrid gated-delta-net/attention layers, a shared expert; bf16 in vLLM, whose CPU
gated-delta-net kernel is bf16-only), random weights, the real processor, real vLLM on CPU.

Prompts reach vLLM with each image's placeholder collapsed to one token; vLLM expands it to
one per image token again, as the trainer's rows hold it. The engine's recorded routing of a
sample must sit at the positions of the trainer's row, image-token positions included, and
be that of the sample's own image: the colour prompts are the same tokens with other images.

In-process checks (one rank): the trainer's own top-k at every routed position against what
the engine recorded (in fp32 both sides route alike wherever no tie is within rounding; the
control, another image's row of the same tokens, disagrees at the image positions), the
experts the trainer's routers use under replay (100% the engine's), and the log-prob gap
with and without replay.

End to end: GRPO on the colour images with --router_replay on the Qwen3.5-MoE VLM in bf16 under
torchrun, beside the same run without replay.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.e2e.helpers import read_metrics, torchrun

pytestmark = [pytest.mark.vlm, pytest.mark.slow]

MAX_NEW, N = 4, 4
ENGINE_DTYPE = {"qwen3_vl_moe": torch.float32, "qwen3_5_moe": torch.bfloat16}


def _capture(routers) -> list[list[torch.Tensor]]:
    """Forward hooks (after MoEHooks') keeping the experts each router's output names."""
    from fsdp_rlhf.models.routers import rule_of, split_output

    seen: list[list[torch.Tensor]] = [[] for _ in routers]
    for slot, router in enumerate(routers):

        def hook(module, args, output, slot=slot):
            seen[slot].append(split_output(rule_of(module), output)[2].detach().clone())

        router.register_forward_hook(hook)
    return seen


def _routed(seen, shape) -> torch.Tensor:
    """(B, L, Lm, k) experts of the last forward, from the hooks' flat (B * L, k) outputs."""
    out = torch.stack([s[-1] for s in seen], dim=1)  # (B * L, Lm, k)
    return out.reshape(*shape, *out.shape[1:]).sort(-1).values


def _checks(rank: int, world: int, model_path: str, image_dir: str, arch: str) -> dict:
    from fsdp_rlhf.config import BackendConfig, PromptDataConfig, RolloutConfig
    from fsdp_rlhf.data.prompts import tokenize_prompts
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.moe import MoEHooks, moe_routers, routing_scope
    from fsdp_rlhf.models.vision import VisionTokens, prepare_policy
    from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
    from fsdp_rlhf.rollout.routing import no_expert
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine
    from fsdp_rlhf.testing.tiny_vlm import colour_rows
    from fsdp_rlhf.trainers.ppo.vision import StepImages
    from tests.dist_utils import current_env

    env = current_env()
    images = StepImages.from_pretrained(model_path, BackendConfig())
    model = load_causal_lm(model_path, BackendConfig(), env.device)
    tokens = prepare_policy(model)
    engine = VLLMEngine(
        model_path,
        RolloutConfig(generate_max_len=MAX_NEW, enforce_eager=True, vllm_kvcache_space_gib=0.25),
        groups=build_rollout_groups(1),
        prompt_max_len=48,
        dtype=ENGINE_DTYPE[arch],
        seed=7,
        pad_token_id=0,
        vision=tokens,
        max_images=1,
        router_replay=True,
    )
    names = ["red", "blue", "green"]  # three prompts of the same tokens, other images
    rows = colour_rows(3, image_dir, names=names)
    data = PromptDataConfig(input_key="prompt", apply_chat_template=True, prompt_max_len=48)
    prompts = tokenize_prompts(rows, images.vision.tokenizer, data, images.vision, "images")
    ids, prompt_images = images.encode(prompts)
    sampled = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, n=N, seed=3)
    out = engine.generate(ids, sampled, prompt_images)
    engine.close()

    hooks = MoEHooks.attach(model)
    seen = _capture(moe_routers(model))
    seq, mask = out.sequences()
    T = out.response_ids.shape[1]
    batch = StepImages.rows(prompt_images, N)
    vision = VisionTokens.from_config(model.config)
    inputs = forward_inputs(seq, mask, images=batch, vision=vision)
    with torch.no_grad():
        own_lp, _ = response_logprobs(model, inputs, T)
    own = _routed(seen, seq.shape)
    with torch.no_grad(), routing_scope(hooks, out.routed_experts, inputs, collect=False):
        replayed_lp, _ = response_logprobs(model, inputs, T)
    used = _routed(seen, seq.shape)

    engine_routing = out.routed_experts.long().sort(-1).values
    fill = no_expert(out.routed_experts.dtype)
    has = (out.routed_experts != fill).all(-1).all(-1)  # (B, L) positions with routing
    image = (seq == tokens.image) & has
    same_own = (own == engine_routing).all(-1)  # (B, L, Lm) per position and layer
    same_used = (used == engine_routing).all(-1)
    # the control: each row against the engine's routing of the next prompt's row (the same
    # tokens, another image) at the image positions
    other = engine_routing.roll(N, dims=0)
    same_other = (own == other).all(-1)
    trained = out.response_mask.bool()
    engine_lp = out.engine_logprobs
    return {
        "prompt_lens": sorted({len(x) for x in ids}),
        "routed positions": int(has.sum()),
        "image positions": int(image.sum()),
        "unrouted real tokens": int((mask.bool() & ~has).sum()),  # each row's last token
        "replay uses the engine's (all)": float(same_used[has].float().mean()),
        "replay uses the engine's (image)": float(same_used[image].float().mean()),
        "trainer's own = engine's (all)": float(same_own[has].float().mean()),
        "trainer's own = engine's (image)": float(same_own[image].float().mean()),
        "control: another image's (image)": float(same_other[image].float().mean()),
        "gap replayed max": float((replayed_lp - engine_lp)[trained].abs().max()),
        "gap own max": float((own_lp - engine_lp)[trained].abs().max()),
        "gap replayed mean": float((replayed_lp - engine_lp)[trained].abs().mean()),
        "gap own mean": float((own_lp - engine_lp)[trained].abs().mean()),
    }


@pytest.mark.parametrize("arch", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_the_engines_routing_lines_up_with_the_trainers_rows_image_tokens_included(arch, tmp_path):
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model

    path = str(build_vl_model(tmp_path / arch, arch))
    (res,) = run_distributed(_checks, 1, path, str(tmp_path / "images"), arch)
    print(arch, res)
    rows = 3 * N
    assert res["image positions"] >= rows * 4, res  # every row's image tokens are routed
    assert res["unrouted real tokens"] == rows, res  # only each row's last token
    assert res["replay uses the engine's (all)"] == 1.0, res
    assert res["replay uses the engine's (image)"] == 1.0, res
    assert res["control: another image's (image)"] < 0.5, res  # the check sees a wrong image
    if ENGINE_DTYPE[arch] == torch.float32:  # the same routing but for near ties
        assert res["trainer's own = engine's (all)"] > 0.99, res
        assert res["trainer's own = engine's (image)"] > 0.99, res
        assert res["gap replayed max"] < 1e-4, res
    else:  # bf16 engine, fp32 trainer: rounding moves close calls
        assert res["trainer's own = engine's (all)"] > 0.98, res
        assert res["trainer's own = engine's (image)"] > 0.98, res
        assert res["gap replayed mean"] <= res["gap own mean"], res


GRPO_STEPS = 4


@pytest.mark.long  # make test-long; CI runs this model with replay in make test-flagship
def test_grpo_on_images_with_router_replay_on_the_qwen3_5_moe_vlm_in_bf16(tmp_path):
    """GRPO on the colour images, the tiny Qwen3.5-MoE VLM in bf16 (2 ranks, one vLLM engine
    each), with and without --router_replay, side by side: replayed, the trainer's log-probs
    of the engine's samples are closer to the engine's (every step follows a weight sync);
    the trainer's own top k agrees with the replayed experts on most token-layer routings
    (bf16 rounding moves close calls)."""
    from fsdp_rlhf.testing.tiny_vlm import build_vl_model, colour_rows, write_rows
    from tests.vlm.conftest import COLOUR_REWARD
    from tests.vlm.conftest import COLOUR_WORDS as WORDS
    from tests.vlm.test_vlm_grpo import grpo_flags

    model = str(build_vl_model(tmp_path / "model", "qwen3_5_moe", words=WORDS, seed=3))
    data = tmp_path / "data"
    write_rows(colour_rows(96, data / "images", seed=0), data / "prompts.jsonl")
    (data / "reward.py").write_text(COLOUR_REWARD)
    rows = {}
    for name, extra in (("plain", []), ("replay", ["--router_replay"])):
        args = grpo_flags(model, data, "prompts.jsonl", tmp_path / name, extra)
        args[args.index("--max_steps") + 1] = str(GRPO_STEPS)
        proc = torchrun(["ppo", *args, "--bf16", "--enforce_eager"], timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = read_metrics(tmp_path / name)
        assert [r["step"] for r in rows[name]] == list(range(1, GRPO_STEPS + 1))
    keys = ("rollout/logprob_diff/mean", "rollout/logprob_diff/max")
    print({n: [{k: r[k] for k in keys} for r in rs] for n, rs in rows.items()})
    print([r["moe/router_replay_agreement"] for r in rows["replay"]])

    def mean(name: str, key: str) -> float:
        return sum(r[key] for r in rows[name]) / GRPO_STEPS

    for r in rows["replay"]:
        assert r["rollout/logprob_diff/mean"] < 0.005, r
        assert r["moe/router_replay_agreement"] > 0.8, r
    assert "moe/router_replay_agreement" not in rows["plain"][0]
    for key in keys:
        assert mean("replay", key) < mean("plain", key), (key, rows)
