"""Rule rewards from ``--remote_rm_url``: a local ``.py`` file or an HTTP endpoint.

A ``.py`` file must define ``reward_func(queries, prompts, labels)`` (OpenRLHF's convention):
``queries`` are prompt + response texts, ``prompts`` the prompt texts, ``labels`` the values of
``--label_key`` (or None). It returns one float per query (list or tensor), or a dict whose
``"rewards"`` entry is that.

An HTTP endpoint gets ``POST {"query": [...], "prompts": [...], "labels": [...]}`` and must
answer ``{"rewards": [...]}``; requests are batched, time out, and are retried with backoff.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_rlhf.errors import UserError

log = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str], list[Any]], torch.Tensor]


def _as_tensor(out: Any, n: int, source: str) -> torch.Tensor:
    if isinstance(out, dict):
        if "rewards" not in out:
            raise ValueError(f"{source}: reward result has no 'rewards' entry: {sorted(out)}")
        out = out["rewards"]
    t = torch.as_tensor(out, dtype=torch.float32).reshape(-1)
    if t.numel() != n:
        raise ValueError(f"{source}: expected {n} rewards, got {t.numel()}")
    return t


def load_python_reward(path: str) -> RewardFn:
    """Import ``reward_func`` from a file; fails early with the file named."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--remote_rm_url {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"fsdp_rlhf_reward_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - user code; report it in one line
        raise UserError(f"--remote_rm_url {path}: import failed: {type(e).__name__}: {e}") from e
    fn = module.__dict__.get("reward_func")
    if not callable(fn):
        raise UserError(f"--remote_rm_url {path}: defines no reward_func(queries, prompts, labels)")

    def call(queries: list[str], prompts: list[str], labels: list[Any]) -> torch.Tensor:
        return _as_tensor(fn(queries, prompts, labels), len(queries), path)

    return call


def _post(url: str, payload: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def http_reward(
    url: str, *, batch_size: int = 64, timeout_s: float = 60.0, retries: int = 5
) -> RewardFn:
    """A reward function calling ``url`` in batches, retrying transient failures."""

    def one_batch(payload: dict[str, Any], n: int) -> torch.Tensor:
        delay = 1.0
        for attempt in range(retries + 1):
            try:
                return _as_tensor(_post(url, payload, timeout_s), n, url)
            except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as e:
                if attempt == retries:
                    msg = f"reward server {url} failed {retries + 1} times: {e}"
                    raise RuntimeError(msg) from e
                log.warning("reward server %s: %s; retry %d in %.0fs", url, e, attempt + 1, delay)
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def call(queries: list[str], prompts: list[str], labels: list[Any]) -> torch.Tensor:
        parts = []
        for i in range(0, len(queries), batch_size):
            sl = slice(i, i + batch_size)
            payload = {"query": queries[sl], "prompts": prompts[sl], "labels": list(labels[sl])}
            parts.append(one_batch(payload, len(queries[sl])))
        return torch.cat(parts) if parts else torch.zeros(0)

    return call


def build_rule_reward(url: str) -> RewardFn:
    if url.startswith(("http://", "https://")):
        return http_reward(url)
    if url.endswith(".py"):
        return load_python_reward(url)
    raise UserError(f"--remote_rm_url {url}: expected a .py file or an http(s):// URL")
