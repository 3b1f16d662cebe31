"""The teacher of on-policy distillation (docs/distillation.md): a frozen model that scores every
token the student sampled, colocated or served.

Colocated (``--teacher_pretrain``) it is one more frozen FSDP2 model on every training rank,
like the reference: bf16 shards under ``--bf16``, offloaded to host memory between its forwards
with ``--teacher_offload``, its forwards built from the same parts as the actor's (packed or
padded rows, a VLM's images, the sequence-parallel slice; an MoE teacher routes for itself).
Served (``--teacher_url``) an OpenAI-compatible vLLM server answers the same question
(:mod:`~fsdp_rlhf.trainers.ppo.served_teacher`). Either way the teacher scores at temperature 1
(as verl and vLLM's ``prompt_logprobs`` do) the token ids the student's chat template rendered;
only tokens the student generated count (``response_mask``: not a multi-turn environment's).

``check_teacher`` runs in ``prepare``, before any model loads; ``Teacher.score`` fills
``exp.teacher_logprobs`` (and with a top-k loss ``exp.teacher_topk_*``).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.env import DistEnv
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.distributed.offload import offload_model, onload_model
from fsdp_rlhf.errors import UserError
from fsdp_rlhf.models.inputs import InputSpec
from fsdp_rlhf.models.load import load_causal_lm, load_tokenizer, model_context, text_config
from fsdp_rlhf.models.vision import prepare_policy
from fsdp_rlhf.trainers.experience import Experience, batched_logprobs, batched_topk
from fsdp_rlhf.trainers.micro_batches import MicroBatching
from fsdp_rlhf.trainers.ppo.served_teacher import (
    ServedTeacher,
    response_positions,
    sequences_of,
)

log = logging.getLogger("fsdp_rlhf")


def context_problem(cfg: PPOConfig, context: int | None, what: str) -> str | None:
    """Why a teacher of ``context`` tokens cannot score this run's sequences (None: it can)."""
    need = cfg.total_len
    if context is None or need <= context:
        return None
    return (
        f"{what}: its context is {context} tokens (max_position_embeddings), less than the "
        f"{need} tokens per sequence it must score (the prompt and every response token); lower "
        "--prompt_max_len / --generate_max_len or use a teacher with a longer context"
    )


def check_teacher(cfg: PPOConfig) -> ServedTeacher | None:
    """``prepare``'s checks of the teacher (the rules table compares a colocated teacher's
    tokenizer): its context, and a served one's reachability, context and tokenizer. Returns
    the served teacher's connection (None: colocated or none)."""
    d = cfg.distill
    if d.teacher_pretrain:
        context = model_context(d.teacher_pretrain, cfg.backend.trust_remote_code)
        if problem := context_problem(cfg, context, f"--teacher_pretrain {d.teacher_pretrain}"):
            raise UserError(problem)
        return None
    if not d.teacher_url:
        return None
    served = connect(cfg)
    served.check(cfg.total_len, load_tokenizer(cfg.models.pretrain, cfg.backend))
    log.info("teacher: %s at %s (max_model_len %s)", served.model, served.url, served.max_model_len)
    return served


def connect(cfg: PPOConfig) -> ServedTeacher:
    d = cfg.distill
    return ServedTeacher.connect(
        d.teacher_url,
        batch_size=d.teacher_batch_size,
        timeout_s=d.teacher_timeout_s,
        retries=d.teacher_retries,
    )


def load_teacher(cfg: PPOConfig, env: DistEnv, parallel: ParallelLayout, load) -> nn.Module:
    """``--teacher_pretrain`` as a frozen causal LM sharded like the reference (``load``:
    ``ppo.setup.load_ppo_model``); never with LoRA adapters (the actor's alone)."""
    no_ckpt = dataclasses.replace(cfg.backend, gradient_checkpointing=False)
    dtype = torch.bfloat16 if cfg.backend.bf16 else torch.float32
    path = cfg.distill.teacher_pretrain

    def teacher_model(weights: bool) -> nn.Module:
        model = load_causal_lm(path, no_ckpt, env.device, dtype, weights=weights)
        prepare_policy(model)  # a VLM teacher: placeholders suppressed, as in the actor
        return model

    return load(teacher_model, cfg, env, False, "--teacher_pretrain", parallel)


def teacher_spec(model: nn.Module | None, actor: InputSpec) -> InputSpec:
    """The parts of the teacher's forwards: the actor's (rows, images, sequence-parallel slice),
    with the actor's shared prompt passes only when the teacher's attention takes them."""
    from fsdp_rlhf.models.inputs import row_layout
    from fsdp_rlhf.models.shared_prefix import sharing_blocker

    if model is None or actor.group_size == 1:
        return actor
    packed = actor.rows == "packed"
    if sharing_blocker(model, packed) is None:
        return actor
    log.info("shared prompt prefix: off for the teacher (%s)", sharing_blocker(model, packed))
    return dataclasses.replace(actor, rows=row_layout(packed, 1), group_size=1)


class Teacher:
    """Scores a batch's sampled tokens (and with a top-k loss the teacher's top-k tokens)."""

    def __init__(
        self,
        cfg: PPOConfig,
        env: DistEnv,
        model: nn.Module | None,
        spec: InputSpec,
    ) -> None:
        self.cfg, self.device, self.model, self.spec = cfg, env.device, model, spec
        self.topk = cfg.distill.distill_topk if cfg.distill.topk else 0
        self.served = connect(cfg) if model is None else None
        # the student's output rows: a teacher whose embeddings are padded further (the same
        # tokenizer) could rank a padding row, which the student cannot score
        text = text_config(cfg.models.pretrain, cfg.backend.trust_remote_code)
        self.student_vocab = getattr(text, "vocab_size", None)

    def score(self, exp: Experience, micro: MicroBatching | int) -> None:
        """``exp.teacher_logprobs`` (N, T), and with top-k ``exp.teacher_topk_logprobs`` /
        ``exp.teacher_topk_ids`` (N, T, k); 0 off the response mask."""
        if self.served is not None:
            self._score_served(exp)
        else:
            self._score_colocated(exp, micro)
        if self.topk and self.student_vocab:  # no mass on rows the student lacks
            outside = exp.teacher_topk_ids >= self.student_vocab
            exp.teacher_topk_logprobs = exp.teacher_topk_logprobs.masked_fill(outside, -1e4)
            exp.teacher_topk_ids = exp.teacher_topk_ids.masked_fill(outside, 0)

    def _score_colocated(self, exp: Experience, micro: MicroBatching | int) -> None:
        offload = self.cfg.distill.teacher_offload
        onload_model(self.model, self.device)
        try:
            exp.teacher_logprobs = batched_logprobs(self.model, exp, micro, 1.0, self.spec)
            if self.topk:
                lp, ids = batched_topk(self.model, exp, micro, self.topk, self.spec)
                exp.teacher_topk_logprobs, exp.teacher_topk_ids = lp, ids
        finally:
            if offload:
                offload_model(self.model, self.device)

    def _score_served(self, exp: Experience) -> None:
        mask = exp.response_mask
        N, T = mask.shape
        k = self.topk
        scores = self.served.score(sequences_of(exp.input_ids, exp.attention_mask), k)
        positions = response_positions(exp.attention_mask, T).cpu()
        logprobs = torch.zeros(N, T)
        top_lp = torch.full((N, T, k), -1e4)  # a rank the server left out: no mass
        top_ids = torch.zeros(N, T, k, dtype=torch.long)
        for i, (lps, tops) in enumerate(scores):
            cols = (positions[i] >= 1).nonzero().squeeze(1)
            at = positions[i][cols] - 1  # entry j of a sequence's scores predicts token j + 1
            logprobs[i, cols] = torch.tensor(lps)[at]
            if k:
                ids, lp = _ranked(tops, k)
                top_ids[i, cols], top_lp[i, cols] = ids[at], lp[at]
        exp.teacher_logprobs = logprobs.to(mask.device) * mask
        if k:
            exp.teacher_topk_logprobs = top_lp.to(mask.device)
            exp.teacher_topk_ids = top_ids.to(mask.device)


def _ranked(tops: list[list[tuple[int, float]]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, k) ids and log-probs of a sequence's top-k per position (padded with no mass)."""
    ids = torch.zeros(len(tops), k, dtype=torch.long)
    lp = torch.full((len(tops), k), -1e4)
    for j, entry in enumerate(tops):
        if entry:
            ids[j, : len(entry)] = torch.tensor([t for t, _ in entry])
            lp[j, : len(entry)] = torch.tensor([v for _, v in entry])
    return ids, lp
