"""Multi-turn rollouts against an ``--env_file`` environment or an ``--agent_func_path`` agent:
driving the engine across turns and assembling the trajectories (one PPO step's generation).
The PPO glue (the engine's wake-up, the step's statistics, building the runner from the config)
is :mod:`fsdp_rlhf.trainers.ppo.multiturn`.

Per turn, ONE batched ``generate`` over the token histories of all live trajectories, then one
``env.step`` per trajectory (in parallel, each under ``--env_timeout_s``). Tokens are never
re-tokenised: the model's tokens are kept as sampled (``response_mask`` 1, the engine's
log-probs kept) and each observation is tokenised once, on its own, wrapped in the chat
template's markers of a user turn, and appended (``response_mask`` 0, log-prob 0). The chat
templates we ship are append-only for these turns (tests/unit/test_multiturn_template.py), so
the stream equals the template's rendering of the whole conversation.

A trajectory ends when the environment says ``done``, after ``--max_turns`` model turns, when
another full turn would not fit in ``--max_total_len`` (the observation is then not appended),
or on a tool error (the failing call adds reward 0). A model turn cut by ``--generate_max_len``
does not end it (the environment decides, as in verl): the observation then starts with the
template's end-of-turn marker, which the model never wrote. ``finish_reasons`` are those of
each trajectory's last model turn. Its score is the SUM of the rewards ``step`` returned; an
environment that only grades the final answer returns 0 before.

Downstream, the response is ``[model turn | observation | model turn | ...]`` with holes in
``response_mask``: the estimators skip masked tokens (the next state of a model token is the
next model token, as verl does), losses and KL average over model tokens only, and the forwards
attend to every token through ``RolloutOutput.response_attention_mask``.

A vision-language prompt's images go to the engine with every turn's history (which starts
with the prompt's expanded image placeholders); the observations stay text, and the
trajectory's row carries the prompt's images like a single-turn row.

Router replay (``--router_replay``): every turn's engine call reports the experts it routed
each position of its sequence (the history in prefill, its model turn in decode) to; the
trajectory keeps, for each position, the routing of the FIRST call that computed it
(:meth:`Trajectory.add_routing`). So each model token takes the routing of the turn that
generated it, and each observation token (and the last token of the turn before it) the
prefill routing of the next turn's call, which read it first; the trajectory's last token was
never run through the engine's model and routes for itself in training, as in single-turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fsdp_rlhf.data.prompts import Prompt
from fsdp_rlhf.distributed.env import all_reduce_scalars
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.metrics import PhaseTimer
from fsdp_rlhf.rollout.engine import RolloutOutput, SamplingConfig, pad_token_rows
from fsdp_rlhf.rollout.env import Environment, NewPrompt
from fsdp_rlhf.rollout.routing import pad_routing

# (histories, sampling[, images=...]) -> one turn's responses
Generate = Callable[..., RolloutOutput]

OBSERVATION_ROLE = "user"  # every chat template knows it; "tool" is not universal
_PLACEHOLDER = "\u2063assistant-turn\u2063"


class ObservationTokens:
    """Token ids of one observation turn, tokenised on their own.

    With a chat template, the text is what the template renders after a finished assistant
    turn: the end of that turn (unless the model's own end-of-turn token already wrote it),
    the observation as a user message, and the generation prompt of the next assistant turn.
    Without one, the raw observation.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, observation: str, turn_end: str) -> str:
        """``turn_end``: the decoded last token of the model's turn (e.g. ``<|im_end|>``)."""
        if not self.tokenizer.chat_template:
            return observation
        messages = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": _PLACEHOLDER},
            {"role": OBSERVATION_ROLE, "content": observation},
        ]
        full = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        after = full.index(_PLACEHOLDER) + len(_PLACEHOLDER)
        if turn_end and full.startswith(turn_end, after):
            after += len(turn_end)
        return full[after:]

    def ids(self, observation: str, turn_end: str) -> list[int]:
        text = self.text(observation, turn_end)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@dataclass
class Trajectory:
    """One sample's conversation as token lists; ``response`` holds every turn after the
    prompt, ``mask`` 1 on model tokens, ``logprobs`` the engine's (0 on env tokens) and
    ``versions`` the weight version of each model token when the engine reports them
    (asynchronous training; -1 on env tokens)."""

    prompt_ids: list[int]
    history: list[dict]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    score: float = 0.0
    turns: int = 0
    env_tokens: int = 0
    error: bool = False
    finish: str = "stop"
    done: bool = False
    slot: int = 0  # its index in the environment's batch
    # (positions, Lm, k) the engine's experts of positions 0.. (router replay; None: none yet)
    routing: np.ndarray | None = None
    images: Any = None  # a vision-language prompt's images (PromptImages), sent every turn

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response)

    def add_model_turn(
        self, ids: list[int], logprobs: list[float], finish: str, versions: list[int] | None = None
    ) -> None:
        self.response += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions if versions is not None else [0] * len(ids)
        self.turns += 1
        self.finish = finish

    def add_routing(self, call: np.ndarray) -> None:
        """One engine call's routing of this trajectory's first ``len(call)`` positions:
        positions no earlier call computed are taken from it (see the module docstring)."""
        have = 0 if self.routing is None else len(self.routing)
        if len(call) < have:
            raise ValueError(f"an engine call routed {len(call)} positions, {have} already held")
        new = np.ascontiguousarray(call[have:])
        self.routing = new if self.routing is None else np.concatenate([self.routing, new])

    def add_observation(self, ids: list[int]) -> None:
        self.response += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.env_tokens += len(ids)


@dataclass(frozen=True)
class TurnBudget:
    max_turns: int
    max_total_len: int
    generate_max_len: int

    def fits_turn(self, length: int) -> bool:
        """Whether a history of ``length`` tokens still takes one full model turn."""
        return length + self.generate_max_len <= self.max_total_len


def turn_seed(seed: int | None, turn: int) -> int | None:
    """A distinct sampling seed per turn (the engine derives per-request seeds from it)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, turn]).generate_state(1)[0])


class MultiTurnRollout:
    """Runs the turns of one step's trajectories; see the module docstring."""

    def __init__(self, env: Environment, tokenizer, budget: TurnBudget, timer: PhaseTimer) -> None:
        self.env, self.tokenizer, self.budget, self.timer = env, tokenizer, budget, timer
        self.observations = ObservationTokens(tokenizer)
        self._versioned = False  # the engine reported token versions (asynchronous training)
        self._routing_like: torch.Tensor | None = None  # the engine reported routed experts

    def run(
        self,
        generate: Generate,
        prompts: Sequence[Prompt],
        sampling: SamplingConfig,
        prompt_ids: Sequence[Sequence[int]] | None = None,
        images: Sequence[Any] | None = None,
    ) -> tuple[RolloutOutput, list[Trajectory]]:
        """``sampling.n`` trajectories per prompt, prompt-major like ``engine.generate``.

        A vision-language actor's prompts come with ``prompt_ids`` (their image placeholders
        expanded) and ``images`` (each prompt's ``PromptImages``): every turn's history starts
        with those ids and goes to the engine with the prompt's images (the environments'
        observations are text)."""
        n = sampling.n
        self._routing_like = None
        ids = prompt_ids if prompt_ids is not None else [p.ids for p in prompts]
        trajs = [
            Trajectory(list(ids[i]), [{"role": "user", "content": p.text, "label": p.label}])
            for i, p in enumerate(prompts)
            for _ in range(n)
        ]
        for slot, t in enumerate(trajs):
            t.slot = slot
            if images is not None:
                t.images = images[slot // n]
        self.env.start(sampling)
        self._reset(trajs, [prompts[i // n] for i in range(len(trajs))])
        for turn in range(self.budget.max_turns):
            live = [t for t in trajs if not t.done]
            for t in live:
                if not self.budget.fits_turn(t.length):
                    t.done = True
            live = [t for t in live if not t.done]
            # the ranks of a TP block generate together: all run a turn (some with no
            # trajectory left) until none is left anywhere. Collective.
            if all_reduce_scalars({"live": float(len(live))}, "max")["live"] == 0:
                break
            turn_sampling = replace(sampling, n=1, seed=turn_seed(sampling.seed, turn))
            histories = [t.prompt_ids + t.response for t in live]
            with self.timer("rollout"):
                if images is None:
                    out = generate(histories, turn_sampling)
                else:
                    out = generate(histories, turn_sampling, images=[t.images for t in live])
            actions = self._add_model_turns(live, out)
            self._step(live, actions, last_turn=turn == self.budget.max_turns - 1)
        return self._output(trajs, sampling.n), trajs

    def _reset(self, trajs: list[Trajectory], prompts: list[Prompt]) -> None:
        with self.timer("env"):
            results = self.env.reset([p.text for p in prompts], [p.label for p in prompts])
        for t, r in zip(trajs, results, strict=True):
            if r.error is not None:
                t.error, t.done = True, True
            elif isinstance(r.value, NewPrompt):
                if t.images is not None:
                    raise UserError(
                        "the environment's reset replaced a prompt that holds images; a "
                        "vision-language prompt can only be extended (return a string)"
                    )
                ids = self.tokenizer(r.value.text, add_special_tokens=False)["input_ids"]
                # left-truncated (like prompts) so that one full model turn still fits
                room = self.budget.max_total_len - self.budget.generate_max_len
                t.prompt_ids = ids[-room:]
                t.history[0]["content"] = r.value.text
            elif r.value:
                t.prompt_ids += self.tokenizer(r.value, add_special_tokens=False)["input_ids"]

    def _add_model_turns(self, live: list[Trajectory], out: RolloutOutput) -> list[str]:
        actions = []
        self._versioned = out.token_versions is not None
        width = out.prompt_ids.shape[1]  # sequences(): prompts left-padded to this width
        if out.routed_experts is not None:  # (0, 1, Lm, k): the store's dtype and shape
            self._routing_like = out.routed_experts[:0, :1]
        for i, t in enumerate(live):
            keep = out.response_mask[i].bool()
            ids = out.response_ids[i][keep].tolist()
            lps = out.engine_logprobs[i][keep].tolist()
            versions = out.token_versions[i][keep].tolist() if self._versioned else None
            if out.routed_experts is not None:  # positions 0 .. history + turn - 2
                start = width - t.length
                t.add_routing(out.routed_experts[i, start : width + len(ids) - 1].numpy())
            t.add_model_turn(ids, lps, out.finish_reasons[i], versions)
            action = self.tokenizer.decode(ids, skip_special_tokens=True)
            t.history.append({"role": "assistant", "content": action})
            actions.append(action)
        return actions

    def _step(self, live: list[Trajectory], actions: list[str], last_turn: bool) -> None:
        with self.timer("env"):
            results = self.env.step(
                [list(t.history) for t in live], actions, [t.slot for t in live]
            )
        for t, r in zip(live, results, strict=True):
            if r.error is not None:
                t.error, t.done = True, True
                continue
            observation, reward, done = r.value
            t.score += reward
            if done or last_turn:
                t.done = True
                continue
            if self.env.raw_observations:  # it carries its own chat markup
                ids = self.tokenizer(observation, add_special_tokens=False)["input_ids"]
            else:
                turn_end = self.tokenizer.decode(t.response[-1:]) if t.response else ""
                ids = self.observations.ids(observation, turn_end)
            if not self.budget.fits_turn(t.length + len(ids)):
                t.done = True
                continue
            t.add_observation(ids)
            t.history.append({"role": OBSERVATION_ROLE, "content": observation})

    def _output(self, trajs: list[Trajectory], n: int) -> RolloutOutput:
        pad_id = self.tokenizer.pad_token_id
        out = RolloutOutput.from_lists(
            [t.prompt_ids for t in trajs],
            [t.response for t in trajs],
            [t.finish for t in trajs],
            [t.logprobs for t in trajs],
            pad_id=pad_id,
            n=n,
        )
        loss_mask, _ = pad_token_rows([t.mask for t in trajs], 0, left=False)
        versions = None
        if self._versioned:
            versions, _ = pad_token_rows([t.versions for t in trajs], -1, left=False)
            versions = versions.reshape(out.response_ids.shape)
        return replace(
            out,
            response_mask=loss_mask.reshape(out.response_ids.shape),
            response_attention_mask=out.response_mask,
            token_versions=versions,
            routed_experts=self._routed_experts(trajs, out),
        )

    def _routed_experts(self, trajs: list[Trajectory], out: RolloutOutput) -> torch.Tensor | None:
        """(N, P + T, Lm, k) the trajectories' routing laid out like ``out.sequences()``
        (None without router replay); a trajectory no call ran (a failed reset) routes for
        itself everywhere."""
        like = self._routing_like
        if like is None:
            return None
        empty = like[:, 0].numpy()  # (0, Lm, k)
        return pad_routing(
            [t.routing if t.routing is not None else empty for t in trajs],
            [len(t.prompt_ids) for t in trajs],
            out.prompt_ids.shape[1],
            out.response_ids.shape[1],
            like.dtype,
        )


def trajectory_stats(trajs: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
    """(N,) per-trajectory tensors for the step's metrics: scores, turns, env tokens, errors."""
    return {
        "scores": torch.tensor([t.score for t in trajs], dtype=torch.float32),
        "turns": torch.tensor([float(t.turns) for t in trajs]),
        "env_tokens": torch.tensor([float(t.env_tokens) for t in trajs]),
        "errors": torch.tensor([float(t.error) for t in trajs]),
    }
