"""OpenRLHF agent files (``--agent_func_path``) as multi-turn environments, run unchanged.

An OpenRLHF agent file imports ``AgentInstanceBase`` and ``MultiTurnAgentExecutor`` from
``openrlhf.utils.agent``, defines an ``AgentInstance`` (one per trajectory) with async
``reset(states)`` and ``step(states)``, and ``AgentExecutor = MultiTurnAgentExecutor(...)``
bound to it. The file is imported with stand-ins for those classes (OpenRLHF need not be
installed); its ``AgentInstance`` then runs inside our multi-turn rollout
(:mod:`fsdp_rlhf.rollout.multiturn`), which generates the turns:

==============================  ==========================================================
OpenRLHF                        here
==============================  ==========================================================
``reset({"observation":         called with the rendered prompt and the label; the returned
prompt, "label"})``             ``observation`` replaces the prompt if it differs
``step({"observation_text",     ``observation_text``: the text so far (prompt, then every
"action_text", "label",         action and feedback); ``action_text``: the model's turn,
"sampling_params"})``           decoded without special tokens
``rewards``                     summed over the steps: the trajectory's score
``environment_feedback``        appended verbatim (it carries its own chat markup), not
                                trained on
``done``                        ends the trajectory (so do ``--max_turns`` and
                                ``--max_total_len``)
``extra_logs``                  the last step's numbers, logged as ``agent/<key>``
``scores``                      not used: dynamic filtering sees the summed ``rewards``
``sampling_params``             passed in read-only; a different one returned is ignored
                                (warned once): every turn samples with the run's settings
``environment_images``          refused (no vision-language models): the trajectory ends
                                as a tool error
==============================  ==========================================================

Refused when the file is loaded, by name and with the reason: an ``AgentExecutor`` that
overrides ``execute`` (it would drive the inference engine itself, e.g. through an
OpenAI-compatible server: here the trainer owns generation), one not built on
``MultiTurnAgentExecutor``, an ``AgentInstance`` not derived from ``AgentInstanceBase``, and
imports of other OpenRLHF modules.

The coroutines of all trajectories run on one event loop in a background thread (as OpenRLHF
runs them on its engine's loop); every call is bounded by ``--env_timeout_s``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
import threading
import types
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

from fsdp_rlhf.errors import UserError
from fsdp_rlhf.rollout.env import Environment, NewPrompt, import_user_file

log = logging.getLogger("fsdp_rlhf")

FLAG = "--agent_func_path"
SHIMMED = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")


# ---------------------------------------------------------------- openrlhf.utils.agent stand-ins


class AgentInstanceBase(ABC):
    """Stand-in for OpenRLHF's ``AgentInstanceBase``: one instance per trajectory."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        """An agent file's instance takes OpenRLHF's constructor arguments; the base keeps
        none of them (its subclass must define ``__init__``, as in OpenRLHF)."""

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, state_dict: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase:
    """Stand-in for OpenRLHF's ``AgentExecutorBase``."""

    async def execute(self, *args, **kwargs):
        raise NotImplementedError("fsdp-rlhf generates the turns itself; execute is not called")


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Stand-in for OpenRLHF's ``MultiTurnAgentExecutor``: only records the instance class."""

    def __init__(self, agent_instance_cls):
        self.agent_instance_cls = agent_instance_cls


class SingleTurnAgentExecutor(AgentExecutorBase):
    """Stand-in for OpenRLHF's reward-function executor (refused: ``--remote_rm_url``)."""

    def __init__(self, *args, **kwargs):
        """Takes OpenRLHF's arguments and keeps none: the loader refuses this executor by its
        class (an agent file using it is a reward function, ``--remote_rm_url``)."""


def _shim_modules() -> dict[str, types.ModuleType]:
    root = types.ModuleType("openrlhf")
    utils = types.ModuleType("openrlhf.utils")
    agent = types.ModuleType("openrlhf.utils.agent")
    root.__path__, utils.__path__ = [], []  # packages, so that the import system descends
    root.utils, utils.agent = utils, agent
    for cls in (
        AgentInstanceBase,
        AgentExecutorBase,
        MultiTurnAgentExecutor,
        SingleTurnAgentExecutor,
    ):
        setattr(agent, cls.__name__, cls)
    return {"openrlhf": root, "openrlhf.utils": utils, "openrlhf.utils.agent": agent}


@contextmanager
def openrlhf_stand_ins():
    """``openrlhf.utils.agent`` resolves to the stand-ins while the agent file is imported;
    ``sys.modules`` is restored afterwards."""
    before = {name: sys.modules.get(name) for name in SHIMMED}
    sys.modules.update(_shim_modules())
    try:
        yield
    finally:
        for name, module in before.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# ---------------------------------------------------------------- loading


def load_agent_class(path: str) -> type:
    """Import the agent file and return its ``AgentInstance`` class; refuses what cannot be
    mapped (see the module docstring) with one line naming it."""
    with openrlhf_stand_ins():
        try:
            module = import_user_file(path, FLAG)
        except UserError as e:
            if "openrlhf" in str(e):
                raise UserError(
                    f"{e} (only openrlhf.utils.agent's AgentInstanceBase and "
                    "MultiTurnAgentExecutor are provided to agent files)"
                ) from None
            raise
    executor_cls = getattr(module, "AgentExecutor", None)
    if not isinstance(executor_cls, type):
        raise UserError(f"{FLAG} {path}: defines no AgentExecutor class (OpenRLHF's contract)")
    if issubclass(executor_cls, SingleTurnAgentExecutor):
        raise UserError(
            f"{FLAG} {path}: AgentExecutor is a SingleTurnAgentExecutor, OpenRLHF's executor "
            "for reward functions; use --remote_rm_url FILE.py (reward_func) instead"
        )
    if executor_cls.execute is not AgentExecutorBase.execute:
        raise UserError(
            f"{FLAG} {path}: AgentExecutor overrides execute(), i.e. drives the inference "
            "engine itself; not supported (fsdp-rlhf generates the turns in-process). Put the "
            "logic in an AgentInstance's reset/step with AgentExecutor = "
            "MultiTurnAgentExecutor(AgentInstance)"
        )
    if not issubclass(executor_cls, MultiTurnAgentExecutor):
        raise UserError(
            f"{FLAG} {path}: AgentExecutor must derive from MultiTurnAgentExecutor (bound to an "
            "AgentInstance class)"
        )
    try:
        executor = executor_cls()
    except Exception as e:  # noqa: BLE001 - user code; one line
        raise UserError(f"{FLAG} {path}: AgentExecutor() failed: {type(e).__name__}: {e}") from e
    instance_cls = getattr(executor, "agent_instance_cls", None)
    if not (isinstance(instance_cls, type) and issubclass(instance_cls, AgentInstanceBase)):
        raise UserError(
            f"{FLAG} {path}: AgentExecutor's agent class must derive from AgentInstanceBase, "
            f"got {instance_cls!r}"
        )
    return instance_cls


# ---------------------------------------------------------------- the environment


def _number(value: Any) -> float:
    """A float from a number, a bool or a one-element tensor/array (``torch.tensor(1.0)``)."""
    if hasattr(value, "item"):
        value = value.item()
    return float(value)


def _log_numbers(extra: Any) -> dict[str, float]:
    if not isinstance(extra, dict):
        return {}
    out = {}
    for key, value in extra.items():
        try:
            out[str(key)] = _number(value)
        except (TypeError, ValueError):
            continue  # text or multi-element values are not metrics
    return out


class AgentEnvironment(Environment):
    """An OpenRLHF ``AgentInstance`` class behind :class:`Environment`'s contract."""

    flag = FLAG
    raw_observations = True

    def __init__(self, path: str, instance_cls: type, timeout_s: float) -> None:
        super().__init__(path, self._reset_one, self._step_one, timeout_s)
        self.instance_cls = instance_cls
        self.instances: list[Any] = []
        self.texts: list[str] = []
        self.labels: list[Any] = []
        self.logs: list[dict[str, float]] = []
        self.sampling_params: Any = None
        self.warned_sampling = False
        self.loop = asyncio.new_event_loop()
        thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="agent-loop")
        thread.start()

    def start(self, sampling) -> None:
        """OpenRLHF hands vLLM's SamplingParams to ``step``; agents get these read-only
        values under the same attribute names."""
        self.sampling_params = types.SimpleNamespace(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            n=1,
            logprobs=1 if sampling.return_logprobs else None,
        )

    def _run(self, value: Any) -> Any:
        """Await ``value`` on the agents' loop (OpenRLHF's methods are async); plain values
        (a synchronous method) pass through."""
        if not inspect.isawaitable(value):
            return value
        future = asyncio.run_coroutine_threadsafe(_awaited(value), self.loop)
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            future.cancel()  # the call is reported as timed out; stop its coroutine
            raise

    def _reset_calls(self, prompts: Sequence[str], labels: Sequence[Any]) -> list[tuple]:
        """A new batch: one agent instance per slot, created by its reset call."""
        n = len(prompts)
        self.instances, self.texts = [None] * n, list(prompts)
        self.labels, self.logs = list(labels), [{} for _ in range(n)]
        return [(i, p, label) for i, (p, label) in enumerate(zip(prompts, labels, strict=True))]

    def _step_calls(self, histories, actions, slots) -> list[tuple]:
        if slots is None:
            raise ValueError("an agent environment needs the trajectories' slots")
        return list(zip(slots, actions, strict=True))

    _check_reset = staticmethod(lambda value: value)  # _reset_one checks it

    def trajectory_logs(self) -> list[dict[str, float]]:
        return self.logs

    def _reset_one(self, slot: int, prompt: str, label: Any) -> NewPrompt | None:
        instance = self.instance_cls()
        self.instances[slot] = instance
        out = self._run(instance.reset({"observation": prompt, "label": label}))
        observation = out.get("observation") if isinstance(out, dict) else None
        if not isinstance(observation, str):
            raise TypeError(f"reset must return {{'observation': str}}, got {out!r:.80}")
        self.texts[slot] = observation
        return None if observation == prompt else NewPrompt(observation)

    def _step_one(self, slot: int, action: str) -> tuple[str, float, bool]:
        states = {
            "observation_text": self.texts[slot],
            "action_text": action,
            "label": self.labels[slot],
            "sampling_params": self.sampling_params,
        }
        out = self._run(self.instances[slot].step(states))
        if not isinstance(out, dict):
            raise TypeError(f"step must return a dict, got {type(out).__name__}")
        if out.get("environment_images"):
            raise ValueError("environment_images: images need a vision-language model (no VLM)")
        returned = out.get("sampling_params")
        changed = returned is not None and returned is not self.sampling_params
        if changed and not self.warned_sampling:
            self.warned_sampling = True
            log.warning(
                "%s %s: step returned other sampling_params; ignored (every turn samples "
                "with the run's --temperature/--top_p/--generate_max_len)",
                FLAG,
                self.path,
            )
        feedback = out.get("environment_feedback") or ""
        if not isinstance(feedback, str):
            raise TypeError(f"environment_feedback must be a str, got {type(feedback).__name__}")
        if "rewards" not in out or "done" not in out:
            raise KeyError(f"step must return 'rewards' and 'done', got keys {sorted(out)}")
        reward, done = _number(out["rewards"]), bool(_number(out["done"]))
        self.texts[slot] += action + feedback
        self.logs[slot] = _log_numbers(out.get("extra_logs"))
        return feedback, reward, done


async def _awaited(value):
    return await value


def load_agent(path: str, timeout_s: float) -> AgentEnvironment:
    """``--agent_func_path``: import and check the file, then wrap its ``AgentInstance``."""
    return AgentEnvironment(path, load_agent_class(path), timeout_s)
