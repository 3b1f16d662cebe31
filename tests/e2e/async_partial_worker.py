"""Two ranks of an asynchronous job, run by torchrun from test_ppo_async.py: a partial rollout
whose weights change mid-generation.

Rank 0 (training side) holds the actor and publishes version 0, waits until rank 1's
requests are in flight, moves the weights and publishes version 1. Rank 1 (rollout side)
generates with a vLLM engine step by step and loads version 1 between two engine steps, with
its requests in flight, then sends the batch back over the bridge. Rank 0 writes what the
test checks to OUT (argv[2]): the batch, and each token's log-prob under both versions.
"""

from __future__ import annotations

import os
import sys

import torch

from fsdp_rlhf.config import RolloutConfig
from fsdp_rlhf.distributed import weight_broadcast
from fsdp_rlhf.distributed.bridge import Bridge, Channel, Patience
from fsdp_rlhf.distributed.split_world import SplitWorld, group_environment, init_split_world
from fsdp_rlhf.distributed.weight_broadcast import WeightLink
from fsdp_rlhf.models.forward import response_logprobs
from fsdp_rlhf.models.inputs import forward_inputs
from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
from fsdp_rlhf.rollout.streaming import stream_rollout
from fsdp_rlhf.testing.partial import switch_weights_after
from fsdp_rlhf.trainers.experience import experience_from_rollout
from fsdp_rlhf.trainers.ppo.async_queue import BatchPart

SWITCH_AFTER = 6  # engine steps under version 0
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23], [30, 31]]


def main(model_path: str, out: str) -> None:
    split = SplitWorld(world_size=2, rollout_ranks=1, tp_size=1)
    rank = int(os.environ["RANK"])
    env, store = init_split_world(split, timeout_min=5)
    bridge = Bridge.connect(store, rank, 2, Patience(300.0), split.describe)
    link = WeightLink.build(bridge, store, [1], env.device, 5)
    if rank == 0:
        train_side(model_path, bridge, link, out)
    else:
        rollout_side(model_path, env, bridge, link)


def _stream(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


def train_side(model_path: str, bridge: Bridge, link: WeightLink, out: str) -> None:
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    after = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    weight_broadcast.publish(link, _stream(before), sender=True)
    assert bridge.recv_object(1, Channel.EXPERIENCE) == "in flight"
    torch.manual_seed(0)
    with torch.no_grad():
        for p in after.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weight_broadcast.publish(link, _stream(after), sender=True)
    part = BatchPart.from_message(bridge.recv_object(1, Channel.EXPERIENCE), torch.device("cpu"))
    exp = part.rows
    T = exp.response_len
    logprobs = {}
    for version, model in ((0, before), (1, after)):
        lp, _ = response_logprobs(
            model, forward_inputs(exp.input_ids, exp.attention_mask), T, temperature=1.0
        )
        logprobs[version] = (lp * exp.response_mask).detach()
    torch.save({"rows": vars(exp), "logprobs": logprobs}, out)


def rollout_side(model_path: str, env, bridge: Bridge, link: WeightLink) -> None:
    from fsdp_rlhf.rollout.vllm.engine import VLLMEngine

    cfg = RolloutConfig(generate_max_len=24, vllm_enable_sleep=False)
    with group_environment(env):
        engine = VLLMEngine(
            model_path,
            cfg,
            groups=build_rollout_groups(1),
            prompt_max_len=8,
            dtype=torch.float32,
            seed=3,
            pad_token_id=0,
            streaming=True,
        )
    engine.update_weights(weight_broadcast.receive(link))
    poll = switch_weights_after(engine, bridge, link, SWITCH_AFTER)

    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, n=2, seed=11)
    streamed = stream_rollout(engine, PROMPTS, sampling, rank_in_engine=0, pad_id=0, poll=poll)
    exp = experience_from_rollout(streamed.output, torch.device("cpu"))
    bridge.send_object(BatchPart(1, exp, [0, 1, 2, 3], {}).to_message(), 0, Channel.EXPERIENCE)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
