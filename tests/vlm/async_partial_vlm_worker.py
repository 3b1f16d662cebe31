"""Two ranks of an asynchronous job with a vision-language actor, run by torchrun from
test_vlm_async.py: a partial rollout of image prompts whose weights change mid-generation,
the vision tower's included.

As ``tests/e2e/async_partial_worker.py`` does for a text model: rank 0 (training side)
publishes version 0, waits until rank 1's requests are in flight, moves every weight and
publishes version 1; rank 1 (rollout side) drives a vLLM engine step by step with each
prompt's image, loads version 1 between two engine steps (its requests are preempted and
resume: their images are encoded again by the new tower) and sends the batch back over the
queue's message format. Rank 0 writes to OUT (argv[2]) the batch and each token's log-prob
under version 0, version 1, version 1's language model with version 0's vision tower (what a
stale image encoding would give) and version 1 with another prompt's image.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

from fsdp_rlhf.config import BackendConfig, PromptDataConfig, RolloutConfig
from fsdp_rlhf.data.prompts import tokenize_prompts
from fsdp_rlhf.distributed import weight_broadcast
from fsdp_rlhf.distributed.bridge import Bridge, Channel, Patience
from fsdp_rlhf.distributed.split_world import SplitWorld, group_environment, init_split_world
from fsdp_rlhf.distributed.weight_broadcast import WeightLink
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.models.load import load_causal_lm
from fsdp_rlhf.models.vision import ImageBatch, prepare_policy, vision_prefix
from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
from fsdp_rlhf.rollout.streaming import stream_rollout
from fsdp_rlhf.testing.partial import switch_weights_after
from fsdp_rlhf.testing.tiny_vlm import colour_rows
from fsdp_rlhf.trainers.experience import experience_from_rollout
from fsdp_rlhf.trainers.ppo.async_queue import BatchPart
from fsdp_rlhf.trainers.ppo.vision import StepImages

SWITCH_AFTER = 6  # engine steps under version 0
MAX_NEW = 20
N = 2
COLOURS = ["red", "blue", "green", "red"]


def main(model_path: str, out: str, image_dir: str) -> None:
    split = SplitWorld(world_size=2, rollout_ranks=1, tp_size=1)
    rank = int(os.environ["RANK"])
    env, store = init_split_world(split, timeout_min=5)
    bridge = Bridge.connect(store, rank, 2, Patience(300.0), split.describe)
    link = WeightLink.build(bridge, store, [1], env.device, 5)
    if rank == 0:
        train_side(model_path, bridge, link, out)
    else:
        rollout_side(model_path, env, bridge, link, image_dir)


def _stream(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


def _logprobs(model, exp, images: ImageBatch) -> torch.Tensor:
    vision = prepare_policy(copy.deepcopy(model))  # the tokens only; the hook is on `model`
    inputs = forward_inputs(exp.input_ids, exp.attention_mask, images=images, vision=vision)
    with torch.no_grad():
        lp, _ = response_logprobs(model, inputs, exp.response_len, temperature=1.0)
    return (lp * exp.response_mask).detach()


def train_side(model_path: str, bridge: Bridge, link: WeightLink, out: str) -> None:
    before = load_causal_lm(model_path, BackendConfig(), torch.device("cpu"))
    prepare_policy(before)  # placeholders suppressed, as the engine does
    after = copy.deepcopy(before)
    weight_broadcast.publish(link, _stream(before), sender=True)
    assert bridge.recv_object(1, Channel.EXPERIENCE) == "in flight"
    torch.manual_seed(0)
    with torch.no_grad():
        for p in after.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weight_broadcast.publish(link, _stream(after), sender=True)
    part = BatchPart.from_message(bridge.recv_object(1, Channel.EXPERIENCE), torch.device("cpu"))
    exp = part.rows
    # version 1's language model, version 0's vision tower: a stale image encoding
    stale = copy.deepcopy(after)
    tower = vision_prefix(after) + "."
    with torch.no_grad():
        old = dict(before.named_parameters())
        for name, p in stale.named_parameters():
            if name.startswith(tower):
                p.copy_(old[name])
    # each row with the image of the prompt after it: another colour
    shift = [(i + N) % exp.num_sequences for i in range(exp.num_sequences)]
    logprobs = {
        0: _logprobs(before, exp, exp.images),
        1: _logprobs(after, exp, exp.images),
        "stale_tower": _logprobs(stale, exp, exp.images),
        "other_image": _logprobs(after, exp, exp.images[shift]),
    }
    rows = {k: v for k, v in vars(exp).items() if k != "images"}
    torch.save({"rows": rows, "logprobs": logprobs}, out)


def rollout_side(model_path: str, env, bridge: Bridge, link: WeightLink, image_dir: str) -> None:
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine

    images = StepImages.from_pretrained(model_path, BackendConfig())
    vision = images.vision
    data = PromptDataConfig(input_key="prompt", apply_chat_template=True, prompt_max_len=48)
    rows = colour_rows(len(COLOURS), image_dir, names=COLOURS)
    prompts = tokenize_prompts(rows, vision.tokenizer, data, vision, "images")
    ids, prompt_images = images.encode(prompts)
    cfg = RolloutConfig(
        generate_max_len=MAX_NEW, vllm_enable_sleep=False, vllm_kvcache_space_gib=0.25
    )
    with group_environment(env):
        engine = VLLMEngine(
            model_path,
            cfg,
            groups=build_rollout_groups(1),
            prompt_max_len=48,
            dtype=torch.float32,
            seed=3,
            pad_token_id=0,
            streaming=True,
            vision=vision.tokens,
            max_images=1,
        )
    engine.update_weights(weight_broadcast.receive(link))
    poll = switch_weights_after(engine, bridge, link, SWITCH_AFTER)

    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=1.0, n=N, seed=11)
    streamed = stream_rollout(
        engine, ids, sampling, rank_in_engine=0, pad_id=0, poll=poll, images=prompt_images
    )
    exp = experience_from_rollout(streamed.output, torch.device("cpu"))
    exp.images = StepImages.rows([prompt_images[i] for i in streamed.kept], N)
    part = BatchPart(1, exp, streamed.kept, {})
    bridge.send_object(part.to_message(), 0, Channel.EXPERIENCE)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
