"""Environments for multi-turn rollouts (``--env_file``): loading, the contract, guarded calls.

An environment file defines either

* ``reset(prompt, label) -> observation`` and ``step(history, action) -> (observation, reward,
  done)``: ``history`` is the conversation so far as messages, the first one
  ``{"role": "user", "content": prompt, "label": label}``, then ``{"role": "assistant"}`` and
  ``{"role": "user"}`` (observation) turns; ``action`` is the model's newest turn (text, also
  the last message of ``history``). ``reset`` returns a string appended to the prompt (e.g. a
  tool list) or None. ``step`` returns the observation (None or "" when there is none), a float
  reward and whether the trajectory ends; or
* only ``reward_func(queries, prompts, labels)`` (OpenRLHF's single-turn rule reward): it is
  called as a one-step environment whose step ends the trajectory.

OpenRLHF agent files (``--agent_func_path``) run through the same contract; see
:mod:`fsdp_rlhf.rollout.agent`.

Every call runs with a time limit (``--env_timeout_s``) in a daemon thread, all trajectories of
a turn in parallel: a call that raises, times out or returns something malformed ends its
trajectory as a tool error (:class:`EnvResult` ``error``), and the first such error of the run
is logged once with the file named. A timed-out call keeps running in its thread (Python cannot
kill it); its result is ignored.

The file is imported and executed in every training process, with the trainer's rights.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from fsdp_rlhf.errors import UserError, exception_line, user_code_error, user_code_where

log = logging.getLogger("fsdp_rlhf")


def import_user_file(path: str, flag: str) -> ModuleType:
    """Import a user's ``.py`` file; a missing file or a failing import is one line naming
    ``flag`` and the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{flag} {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"fsdp_rlhf_user_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - user code; report it in one line
        raise user_code_error(flag, path, e, "import failed:") from e
    return module


@dataclass(frozen=True)
class EnvResult:
    """One guarded call: ``value`` (reset: the observation; step: ``(obs, reward, done)``)
    or ``error`` (one line), and the call's wall time."""

    value: Any = None
    error: str | None = None
    seconds: float = 0.0


def _call_all(
    fn: Callable,
    calls: Sequence[tuple],
    timeout_s: float,
    check: Callable[[Any], Any],
    path: str,
) -> list[EnvResult]:
    """Run ``fn(*args)`` for every args tuple in parallel threads, each under ``timeout_s``.
    An error names ``path:line`` of the user's file ``path`` where it was raised."""
    slots: list[EnvResult | None] = [None] * len(calls)

    def run(i: int, args: tuple) -> None:
        start = time.perf_counter()
        try:
            slots[i] = EnvResult(value=check(fn(*args)), seconds=time.perf_counter() - start)
        except Exception as e:  # noqa: BLE001 - user code: the trajectory ends, the run goes on
            error = f"{user_code_where(path, e)}: {exception_line(e)}"
            slots[i] = EnvResult(error=error, seconds=time.perf_counter() - start)

    threads = [threading.Thread(target=run, args=(i, a), daemon=True) for i, a in enumerate(calls)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, timeout_s - (time.perf_counter() - start)))
    return [
        s
        if s is not None
        else EnvResult(error=f"{path}: timed out after {timeout_s:g}s", seconds=timeout_s)
        for s in slots
    ]


def _check_observation(obs: Any) -> str:
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"observation must be a str or None, got {type(obs).__name__}")
    return obs or ""


def _check_step(out: Any) -> tuple[str, float, bool]:
    if not isinstance(out, tuple) or len(out) != 3:
        raise TypeError(f"step must return (observation, reward, done), got {out!r:.80}")
    obs, reward, done = out
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step returned a non-finite reward {reward}")
    return _check_observation(obs), reward, bool(done)


@dataclass(frozen=True)
class NewPrompt:
    """A ``reset`` result that replaces the prompt text instead of extending it (an OpenRLHF
    agent's initial observation)."""

    text: str


class Environment:
    """The loaded ``--env_file``; ``reset``/``step`` over a batch of trajectories.

    ``reset`` starts a batch: trajectory ``i`` of it is slot ``i``; ``step`` names the slots
    of the trajectories it continues (an environment holding per-trajectory state needs them).
    ``raw_observations``: observations are appended verbatim (they carry their own chat
    markup) instead of being wrapped as a user turn of the chat template.
    """

    flag = "--env_file"
    raw_observations = False

    def __init__(self, path: str, reset: Callable, step: Callable, timeout_s: float) -> None:
        self.path, self._reset, self._step, self.timeout_s = path, reset, step, timeout_s
        self.reported = False

    def start(self, sampling: Any) -> None:
        """Called before each batch's ``reset`` with its sampling settings."""

    def reset(self, prompts: Sequence[str], labels: Sequence[Any]) -> list[EnvResult]:
        calls = self._reset_calls(prompts, labels)
        return self._report(
            _call_all(self._reset, calls, self.timeout_s, self._check_reset, self.path)
        )

    def step(
        self,
        histories: Sequence[list[dict]],
        actions: Sequence[str],
        slots: Sequence[int] | None = None,
    ) -> list[EnvResult]:
        calls = self._step_calls(histories, actions, slots)
        return self._report(_call_all(self._step, calls, self.timeout_s, _check_step, self.path))

    # the arguments of each reset / step call, and the check of a reset's result
    def _reset_calls(self, prompts: Sequence[str], labels: Sequence[Any]) -> list[tuple]:
        return list(zip(prompts, labels, strict=True))

    def _step_calls(self, histories, actions, slots) -> list[tuple]:
        return list(zip(histories, actions, strict=True))

    _check_reset = staticmethod(_check_observation)

    def trajectory_logs(self) -> list[dict[str, float]] | None:
        """Per-slot numbers the environment reported for the last batch (None: none kept)."""
        return None

    def _report(self, results: list[EnvResult]) -> list[EnvResult]:
        first = next((r.error for r in results if r.error is not None), None)
        if first is not None and not self.reported:
            self.reported = True  # once per run: a broken tool would flood the log
            log.warning("%s %s (trajectory ended, reward 0)", self.flag, first)
        return results


def _single_turn(reward_func: Callable) -> tuple[Callable, Callable]:
    """``reward_func(queries, prompts, labels)`` as a one-step environment."""

    def reset(prompt: str, label: Any) -> None:
        return None

    def step(history: list[dict], action: str) -> tuple[None, float, bool]:
        first = history[0]
        rewards = reward_func([first["content"] + action], [first["content"]], [first["label"]])
        if isinstance(rewards, dict):
            rewards = rewards["rewards"]
        return None, float(list(rewards)[0]), True

    return reset, step


def load_environment(path: str, timeout_s: float) -> Environment:
    """Import ``--env_file``; fails early naming the file when it defines neither contract."""
    module = import_user_file(path, "--env_file")
    names = module.__dict__
    reset, step, reward_func = names.get("reset"), names.get("step"), names.get("reward_func")
    if callable(reset) and callable(step):
        return Environment(path, reset, step, timeout_s)
    if callable(reward_func) and reset is None and step is None:
        return Environment(path, *_single_turn(reward_func), timeout_s)
    raise UserError(
        f"--env_file {path}: defines neither reset(prompt, label) and step(history, action) "
        "nor reward_func(queries, prompts, labels)"
    )
