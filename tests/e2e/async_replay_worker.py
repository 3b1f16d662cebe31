"""Two ranks of an asynchronous job with router replay, run by torchrun from
test_async_router_replay.py: a partial rollout of an MoE model whose weights change
mid-generation, the engine recording the experts it routed every token to.

As async_partial_worker.py (rank 1 generates step by step and loads version 1 after
SWITCH_AFTER engine steps, requests in flight; rank 0 moves the weights), with
``router_replay``, and version 1 the weights moved by SCALE (argv[3]) x a normal draw (0: the
same weights loaded again). Rank 1 also assembles the routing the other way (a position
computed again under the new weights keeps the recomputation's experts) and sends it beside
the batch. Rank 0 writes to OUT (argv[2]) the batch, and each token's log-prob under both
versions: routing for itself, replaying the batch's routing, and replaying the other
assembly.
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
from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups
from fsdp_rlhf.rollout.routing import assemble_routing, no_expert, pad_routing
from fsdp_rlhf.rollout.streaming import stream_rollout
from fsdp_rlhf.testing.partial import switch_weights_after
from fsdp_rlhf.trainers.experience import experience_from_rollout
from fsdp_rlhf.trainers.ppo.async_queue import BatchPart

SWITCH_AFTER = 6  # engine steps under version 0
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23], [30, 31]]


def main(model_path: str, out: str, scale: float) -> None:
    split = SplitWorld(world_size=2, rollout_ranks=1, tp_size=1)
    rank = int(os.environ["RANK"])
    env, store = init_split_world(split, timeout_min=5)
    bridge = Bridge.connect(store, rank, 2, Patience(300.0), split.describe)
    link = WeightLink.build(bridge, store, [1], env.device, 5)
    if rank == 0:
        train_side(model_path, bridge, link, out, scale)
    else:
        rollout_side(model_path, env, bridge, link)


def _stream(model):
    return [(n, p.detach()) for n, p in model.named_parameters()]


def train_side(model_path: str, bridge: Bridge, link: WeightLink, out: str, scale: float) -> None:
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.moe import MoEHooks, routing_scope

    before = load_causal_lm(model_path, BackendConfig(), torch.device("cpu"))
    after = load_causal_lm(model_path, BackendConfig(), torch.device("cpu"))
    weight_broadcast.publish(link, _stream(before), sender=True)
    assert bridge.recv_object(1, Channel.EXPERIENCE) == "in flight"
    torch.manual_seed(0)
    with torch.no_grad():
        for p in after.parameters():
            p.add_(torch.randn_like(p) * scale)
    weight_broadcast.publish(link, _stream(after), sender=True)
    msg = bridge.recv_object(1, Channel.EXPERIENCE)
    exp = BatchPart.from_message(msg, torch.device("cpu")).rows
    recomputed = msg["recomputed_routing"]
    T = exp.response_len
    inputs = forward_inputs(exp.input_ids, exp.attention_mask, response_len=T)
    logprobs, metrics = {}, {}
    for version, model in ((0, before), (1, after)):
        hooks = MoEHooks.attach(model)
        for name, routing in (("own", None), ("first", exp.routed_experts), ("last", recomputed)):
            replay = routing_scope(hooks, routing, inputs, collect=routing is not None)
            with torch.no_grad(), replay:
                lp, _ = response_logprobs(model, inputs, T)
            logprobs[(version, name)] = (lp * exp.response_mask).detach()
            if routing is not None:
                metrics[(version, name)] = hooks.pop_metrics()
    torch.save({"rows": vars(exp), "logprobs": logprobs, "metrics": metrics}, out)


class _BothAssemblies:
    """The engine, also assembling the rollout's routing with each recomputation kept."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.recomputed = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def take_routing(self, sequences, keys=None):
        records = list(self.engine._routing.recorder.records)
        fill = no_expert(self.engine._routing.store)
        self.recomputed = assemble_routing(records, sequences, fill)
        return self.engine.take_routing(sequences, keys=keys)


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
            router_replay=True,
        )
    engine.update_weights(weight_broadcast.receive(link))
    poll = switch_weights_after(engine, bridge, link, SWITCH_AFTER)

    sampling = SamplingConfig(max_new_tokens=24, temperature=1.0, n=2, seed=11)
    both = _BothAssemblies(engine)
    streamed = stream_rollout(both, PROMPTS, sampling, rank_in_engine=0, pad_id=0, poll=poll)
    out = streamed.output
    exp = experience_from_rollout(out, torch.device("cpu"))
    msg = BatchPart(1, exp, [0, 1, 2, 3], {}).to_message()
    msg["recomputed_routing"] = pad_routing(
        both.recomputed,
        [len(PROMPTS[i]) for i in streamed.kept for _ in range(sampling.n)],
        out.prompt_ids.shape[1],
        out.response_ids.shape[1],
        out.routed_experts.dtype,
    )
    bridge.send_object(msg, 0, Channel.EXPERIENCE)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
