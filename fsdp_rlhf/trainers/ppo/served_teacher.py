"""A served teacher (``--teacher_url``): an OpenAI-compatible vLLM server scores every token of
each prompt + response through its completions endpoint's ``prompt_logprobs`` (vLLM's
extension: the log-prob of each prompt token under the model, raw logits at temperature 1, and
with ``prompt_logprobs = k`` its top-k tokens too).

A teacher too large to colocate runs on machines of its own (``vllm serve TEACHER
--max-logprobs K``); every rank sends its own rows, ``--teacher_batch_size`` sequences per
request, each request bounded by ``--teacher_timeout_s`` and tried ``--teacher_retries`` times
before the run stops with one line naming the URL and what it answered. ``prepare`` asks the
server once before any model loads: its model, its context (``max_model_len``) and whether it
tokenizes like the student.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_rlhf.errors import UserError

log = logging.getLogger("fsdp_rlhf")

# what a probe sends to the server's tokenizer besides the special tokens
PROBE_TEXT = " the quick brown fox, 12345 \u00e9t\u00e9 \u4f60\u597d\n\tend"


class TeacherServerError(UserError):
    """The served teacher did not answer as expected (the line names the URL and the answer)."""


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _answer(body: bytes | str, limit: int = 300) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _request(url: str, payload: dict | None, timeout: float) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _failure(e: Exception, timeout: float) -> str:
    """What the server answered (or why nothing came back), in a few words."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}: {_answer(e.read())}"
    reason = getattr(e, "reason", e)
    if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
        return f"no answer within {timeout:g} s"
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON ({e.msg})"
    return f"{type(reason).__name__}: {reason}"


@dataclass
class ServedTeacher:
    """A connection to one teacher server; ``model`` and ``max_model_len`` as it reports them."""

    url: str
    model: str
    max_model_len: int | None
    batch_size: int = 16
    timeout_s: float = 120.0
    retries: int = 3

    @classmethod
    def connect(cls, url: str, *, batch_size=16, timeout_s=120.0, retries=3) -> ServedTeacher:
        """Ask ``url``'s ``/v1/models`` which model it serves (one line when it cannot say)."""
        base = _base(url)
        answer = _call(f"{base}/v1/models", None, timeout_s, retries, url)
        try:
            (entry,) = answer["data"]
            model, context = str(entry["id"]), entry.get("max_model_len")
        except (KeyError, TypeError, ValueError):
            raise TeacherServerError(
                f"--teacher_url {url}: /v1/models answered {_answer(json.dumps(answer))}, not "
                "one served model"
            ) from None
        return cls(base, model, context, batch_size, timeout_s, retries)

    def check(self, total_len: int, tokenizer) -> None:
        """The server must hold a whole sequence plus the one token a completion generates,
        and tokenize like ``tokenizer`` (the student's): one line otherwise."""
        if self.max_model_len is not None and self.max_model_len <= total_len:
            raise UserError(
                f"--teacher_url {self.url}: its model {self.model} takes at most "
                f"{self.max_model_len} tokens (max_model_len), but the teacher scores sequences "
                f"of up to {total_len} tokens plus the one a completion generates; serve it with "
                f"--max-model-len {total_len + 1} or more, or lower the lengths"
            )
        probe = " ".join(tokenizer.all_special_tokens) + PROBE_TEXT
        payload = {"model": self.model, "prompt": probe, "add_special_tokens": False}
        answer = _call(f"{self.url}/tokenize", payload, self.timeout_s, self.retries, self.url)
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        mine = tokenizer.encode(probe, add_special_tokens=False)
        if theirs != mine:
            raise UserError(
                f"--teacher_url {self.url}: its model {self.model} tokenizes otherwise than "
                f"--pretrain ({_answer(str(theirs), 120)} against {_answer(str(mine), 120)} for "
                "the special tokens and a probe text): the teacher scores the student's token "
                "ids, so it needs the student's tokenizer (cross-tokenizer distillation is not "
                "implemented)"
            )

    def score(
        self, sequences: list[list[int]], topk: int = 0
    ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        """Per sequence: the log-prob of each of its tokens after the first (``len - 1``), and
        with ``topk`` the ``topk`` most likely ``(id, log-prob)`` at each of those positions."""
        out = []
        for start in range(0, len(sequences), self.batch_size):
            batch = sequences[start : start + self.batch_size]
            payload = {
                "model": self.model,
                "prompt": batch,
                "max_tokens": 1,  # vLLM generates at least one token; it is not read
                "temperature": 1.0,
                "prompt_logprobs": topk,
            }
            answer = _call(
                f"{self.url}/v1/completions", payload, self.timeout_s, self.retries, self.url
            )
            out.extend(self._parse(answer, batch, topk))
        return out

    def _parse(self, answer: Any, batch: list[list[int]], topk: int):
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != len(batch):
                raise ValueError(f"{len(choices)} choices for {len(batch)} prompts")
            pairs = zip(choices, batch, strict=True)
            return [_read_choice(c["prompt_logprobs"], ids, topk) for c, ids in pairs]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise TeacherServerError(
                f"--teacher_url {self.url}: /v1/completions answered without the prompt "
                f"log-probs asked for ({type(e).__name__}: {e}): {_answer(json.dumps(answer))}"
            ) from None


def _read_choice(entries: list, ids: list[int], topk: int):
    if len(entries) != len(ids):
        raise ValueError(f"{len(entries)} prompt log-probs for {len(ids)} tokens")
    logprobs, tops = [], []
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        logprobs.append(float(entry[str(token)]["logprob"]))
        if topk:
            ranked = sorted(
                ((v["rank"], int(k), float(v["logprob"])) for k, v in entry.items()),
                key=lambda r: r[0],
            )
            tops.append([(i, lp) for rank, i, lp in ranked if rank <= topk][:topk])
    return logprobs, tops


def _call(url: str, payload: dict | None, timeout: float, retries: int, shown: str) -> Any:
    """POST (or GET without ``payload``) with retries and backoff; one line after the last."""
    for attempt in range(retries):
        try:
            return _request(url, payload, timeout)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            what = _failure(e, timeout)
            client_error = isinstance(e, urllib.error.HTTPError) and 400 <= e.code < 500
            if attempt == retries - 1 or client_error:  # a 4xx will not change on a retry
                raise TeacherServerError(
                    f"--teacher_url {shown}: {urllib.parse.urlparse(url).path or url} failed "
                    f"after {attempt + 1} attempt{'s' if attempt else ''}: {what}"
                ) from None
            delay = min(2.0**attempt, 10.0)
            log.warning("teacher server %s: %s; retry %d in %.0fs", shown, what, attempt + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def sequences_of(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The attended tokens of each (N, L) row (prompt left-padded, response right-padded)."""
    rows = zip(input_ids.cpu(), attention_mask.cpu(), strict=True)
    return [row[mask.bool()].tolist() for row, mask in rows]


def response_positions(attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
    """(N, T) index into each row's attended tokens of its response columns (-1: padding), so
    that ``scores[i][pos - 1]`` is the log-prob of response token ``pos`` (its first entry
    predicts the sequence's second token)."""
    mask = attention_mask.bool()
    pos = mask.long().cumsum(-1) - 1
    pos = pos.where(mask, -1)
    return pos[:, -response_len:]
