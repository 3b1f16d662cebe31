"""Rule rewards from ``--remote_rm_url``: a local ``.py`` file or an HTTP endpoint.

A ``.py`` file must define ``reward_func(queries, prompts, labels)`` (OpenRLHF's convention):
``queries`` are prompt + response texts, ``prompts`` the prompt texts, ``labels`` the values of
``--label_key`` (or None). It returns one float per query (list or tensor), or a dict whose
``"rewards"`` entry is that.

An HTTP endpoint gets ``POST {"query": [...], "prompts": [...], "labels": [...]}`` and must
answer ``{"rewards": [...]}``; requests are batched, time out, and are retried with backoff.
With ``--remote_rm_auth_env NAME`` each request carries ``Authorization: Bearer $NAME``, so the
token never appears in flags, ``config.yaml`` or logs; a URL is logged with its credentials
and query string masked (:func:`redact_url`).

A ``.py`` file is imported and executed in every training process, with the trainer's rights.
Each way a source can fail stops the run with one line: a ``reward_func`` that raises names its
file's ``path:line`` (the user's own frames follow, fsdp-rlhf's only with ``--debug``), a
server that keeps failing names its (masked) URL, the number of tries and the last error, and
non-finite rewards name the source.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import torch

from fsdp_rlhf.config_base import redact_url
from fsdp_rlhf.errors import Fault, UserError, user_code_error
from fsdp_rlhf.rollout.env import import_user_file
from fsdp_rlhf.trainers.guards import check_finite_scores

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
    # NaN/Inf would spread through advantage whitening to every sample of the batch.
    return check_finite_scores(t, None, source)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list:
    """Decode only the response tokens of each row (where ``response_mask`` is set).

    Multiplying ids by the mask instead would turn padding into token id 0, which is an
    ordinary token in many vocabularies (``!`` in Qwen2, Llama-3 and GPT-2), so short responses
    would reach the reward function with ``!!!`` appended.
    """
    keep = response_mask.bool().cpu()
    ids = response_ids.cpu()
    rows = [row[m].tolist() for row, m in zip(ids, keep, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def load_python_reward(path: str) -> RewardFn:
    """Import ``reward_func`` from a file; fails early with the file named."""
    module = import_user_file(path, "--remote_rm_url")
    fn = module.__dict__.get("reward_func")
    if not callable(fn):
        raise UserError(f"--remote_rm_url {path}: defines no reward_func(queries, prompts, labels)")

    source = f"rule reward file {path}"

    def call(queries: list[str], prompts: list[str], labels: list[Any]) -> torch.Tensor:
        try:
            out = fn(queries, prompts, labels)
        except Exception as e:  # noqa: BLE001 - the user's code: its line, not our frames
            raise user_code_error("rule reward file", path, e, "reward_func raised") from e
        try:
            return _as_tensor(out, len(queries), source)
        except ValueError as e:  # a malformed result is the user's to fix
            raise UserError(str(e)) from None

    return call


def _post(url: str, payload: dict[str, Any], timeout: float, headers: dict[str, str]) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def auth_headers(auth_env: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}`` from the environment variable ``auth_env``."""
    if not auth_env:
        return {}
    token = os.environ.get(auth_env, "")
    if not token:
        raise UserError(f"--remote_rm_auth_env {auth_env}: the variable is not set or empty")
    return {"Authorization": f"Bearer {token}"}


def http_reward(
    url: str,
    *,
    batch_size: int = 64,
    timeout_s: float = 60.0,
    retries: int = 5,
    auth_env: str | None = None,
) -> RewardFn:
    """A reward function calling ``url`` in batches, retrying transient failures."""
    headers = auth_headers(auth_env)
    shown = redact_url(url)
    source = f"HTTP reward endpoint {shown}"

    def one_batch(payload: dict[str, Any], n: int) -> torch.Tensor:
        delay = 1.0
        for attempt in range(retries + 1):
            try:
                return _as_tensor(_post(url, payload, timeout_s, headers), n, source)
            except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
                # str(e) of urllib errors can quote the full URL: mask it there too.
                err = (str(e) or type(e).__name__).replace(url, shown)
                if attempt == retries:
                    msg = f"{source}: {retries + 1} tries failed, the last with: {err}"
                    raise Fault(msg) from None
                log.warning(
                    "reward server %s: %s; retry %d in %.0fs", shown, err, attempt + 1, delay
                )
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


def build_rule_reward(url: str, auth_env: str | None = None) -> RewardFn:
    """The reward function for ``--remote_rm_url`` (``auth_env``: ``--remote_rm_auth_env``)."""
    if url.startswith(("http://", "https://")):
        return http_reward(url, auth_env=auth_env)
    if auth_env:
        raise UserError("--remote_rm_auth_env applies only to an http(s) --remote_rm_url")
    if url.endswith(".py"):
        return load_python_reward(url)
    raise UserError(f"--remote_rm_url {redact_url(url)}: expected a .py file or an http(s):// URL")
