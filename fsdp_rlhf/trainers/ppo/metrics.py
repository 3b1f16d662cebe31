"""PPO step metrics with verl / MindSpeed RL names, reduced across ranks in three collectives."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_rlhf.algorithms import logprob_gap_by_staleness, rollout_mismatch_metrics
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.distributed.env import all_reduce_scalars
from fsdp_rlhf.distributed.stats import to_host
from fsdp_rlhf.errors import writing
from fsdp_rlhf.metrics import MetricLogger
from fsdp_rlhf.rollout.engine import RolloutOutput
from fsdp_rlhf.trainers.experience import Experience, truncated

Number = float | torch.Tensor


class StatCollector:
    """Global mean / max / min of per-sequence or per-token quantities.

    ``add("critic/values", values, mask)`` yields ``critic/values/{mean,max,min}`` over the valid
    entries of every rank: sums and counts are all-reduced (not means of means). Everything
    stays on the device until :meth:`reduce` (one host copy, three collectives).
    """

    def __init__(self) -> None:
        self.sums: dict[str, Number] = {}
        self.maxs: dict[str, Number] = {}
        self.mins: dict[str, Number] = {}
        self.only_maxs: dict[str, Number] = {}
        self.means: list[str] = []
        self.optional: set[str] = set()  # means left out when no rank counted anything

    def add(self, name: str, values: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        values = values.detach().float()
        valid = mask.bool() if mask is not None else torch.ones_like(values, dtype=torch.bool)
        self.sums[f"{name}/sum"] = values.where(valid, 0.0).sum()
        self.sums[f"{name}/count"] = valid.sum()
        # an empty selection gives -inf / inf, which the max / min over ranks ignore
        self.maxs[name] = values.where(valid, float("-inf")).amax() if values.numel() else -math.inf
        self.mins[name] = values.where(valid, float("inf")).amin() if values.numel() else math.inf

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        """Only ``name`` itself: the global mean of ``values``. Repeated calls accumulate (the
        rounds of dynamic sampling each report their responses)."""
        self._accumulate(name, values.detach().float().sum(), float(values.numel()))

    def add_weighted_mean(self, name: str, local_mean: Number, weight: Number) -> None:
        """Only ``name``: the global mean of per-rank means weighted by ``weight`` (their
        token counts, say), i.e. the mean over every rank's entries."""
        self._accumulate(name, local_mean * weight, weight)

    def add_sum_over_count(self, name: str, total: Number, count: Number) -> None:
        """Only ``name``: global ``sum(total) / sum(count)``, left out of :meth:`reduce` when
        the global count is 0 (a quantity of entries that may not exist this step)."""
        self._accumulate(name, total, count)
        self.optional.add(name)

    def _accumulate(self, name: str, total: Number, count: Number) -> None:
        self.sums[f"{name}/sum"] = self.sums.get(f"{name}/sum", 0.0) + total
        self.sums[f"{name}/count"] = self.sums.get(f"{name}/count", 0.0) + count
        if name not in self.means:
            self.means.append(name)

    def add_max(self, name: str, value: Number) -> None:
        """Only ``name``: the global max of ``value`` (a 0-d tensor or a number)."""
        self.only_maxs[name] = value

    def export(self) -> dict:
        """This rank's unreduced statistics as plain numbers, for :meth:`merge` on another
        process (asynchronous training's rollout ranks send theirs to a training rank)."""
        return {
            "sums": to_host(self.sums),
            "maxs": to_host(self.maxs),
            "mins": to_host(self.mins),
            "only_maxs": to_host(self.only_maxs),
            "means": list(self.means),
            "optional": sorted(self.optional),
        }

    def merge(self, part: dict) -> None:
        """Add another collector's :meth:`export` to this rank's statistics."""
        for k, v in part["sums"].items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for mine, theirs, pick in (
            (self.maxs, part["maxs"], max),
            (self.only_maxs, part["only_maxs"], max),
            (self.mins, part["mins"], min),
        ):
            for k, v in theirs.items():
                mine[k] = pick(float(mine[k]), v) if k in mine else v
        self.means += [m for m in part["means"] if m not in self.means]
        self.optional.update(part.get("optional", ()))

    def names(self) -> tuple[list[str], ...]:
        """The names this rank holds (for :meth:`include` on the others)."""
        return (
            sorted(self.sums), sorted(self.maxs), sorted(self.mins), sorted(self.only_maxs),
            list(self.means), sorted(self.optional),
        )  # fmt: skip

    def include(self, names: tuple[list[str], ...]) -> None:
        """Hold ``names`` (another rank's :meth:`names`) too, with values that change no
        reduction (0 summed, -inf for maxima, inf for minima): every rank must reduce the same
        names, though some statistics reach one rank only (a rollout rank's report)."""
        sums, maxs, mins, only_maxs, means, optional = names
        for keys, store, neutral in (
            (sums, self.sums, 0.0),
            (maxs, self.maxs, -math.inf),
            (mins, self.mins, math.inf),
            (only_maxs, self.only_maxs, -math.inf),
        ):
            for k in keys:
                store.setdefault(k, neutral)
        self.means += [m for m in means if m not in self.means]
        self.optional.update(optional)

    def reduce(self) -> dict[str, float]:
        host = to_host({**self.sums, **{f"max:{k}": v for k, v in self.maxs.items()}})
        host.update(to_host({f"only_max:{k}": v for k, v in self.only_maxs.items()}))
        host.update(to_host({f"min:{k}": v for k, v in self.mins.items()}))
        sums = all_reduce_scalars({k: host[k] for k in self.sums}, "sum")
        maxs = all_reduce_scalars({k: host[f"max:{k}"] for k in self.maxs}, "max")
        mins = all_reduce_scalars({k: host[f"min:{k}"] for k in self.mins}, "min")
        maxs.update(all_reduce_scalars({k: host[f"only_max:{k}"] for k in self.only_maxs}, "max"))

        def mean(name: str) -> float:
            count = sums[f"{name}/count"]
            return sums[f"{name}/sum"] / count if count else 0.0

        out = {
            name: mean(name)
            for name in self.means
            if name not in self.optional or sums[f"{name}/count"]
        }
        for name in self.maxs:
            out[f"{name}/mean"] = mean(name)
            out[f"{name}/max"] = maxs[name]
            out[f"{name}/min"] = mins[name]
        out.update({name: maxs[name] for name in self.only_maxs})
        return out


class RunningAverages:
    """Averages of loss statistics over micro-batches, then over ranks; names ending in
    ``_max`` are maxima instead (a mean of maxima would hide the outlier they exist to show).

    Statistics stay on the device (summed, or maxed, as they arrive): they come to the host
    once per :meth:`reduce`, not once per micro-batch."""

    def __init__(self) -> None:
        self.totals: dict[str, Number] = {}
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, stats: dict[str, Number]) -> None:
        for k, v in stats.items():
            v = v.detach() if isinstance(v, torch.Tensor) else float(v)
            if k not in self.totals:
                self.totals[k] = v
            elif k.endswith("_max"):
                self.totals[k] = torch.maximum(torch.as_tensor(self.totals[k]), torch.as_tensor(v))
            else:
                self.totals[k] = self.totals[k] + v
            self.counts[k] += 1

    def reduce(
        self,
        sum_keys: tuple[str, ...] = (),
        steps: int = 1,
        data_group: dist.ProcessGroup | None = None,
    ) -> dict[str, float]:
        """Means over micro-batches and ranks; ``sum_keys`` are summed over micro-batches and
        ranks and divided by ``steps`` instead (loss terms that are fractions of a step's
        global mean: ranks may run different numbers of micro-batches), over ``data_group``
        (the layout's: one rank per sequence-parallel group; None: every rank)."""
        host = to_host(self.totals)
        sums = {k: host.pop(k) / max(steps, 1) for k in sum_keys if k in host}
        means = {k: v / self.counts[k] for k, v in host.items() if not k.endswith("_max")}
        maxs = {k: v for k, v in host.items() if k.endswith("_max")}
        # every rank has the same keys (they follow the config), so the collectives match
        return {
            **all_reduce_scalars(means, "mean"),
            **all_reduce_scalars(maxs, "max"),
            **all_reduce_scalars(sums, "sum", data_group),
        }


def throughput(
    tokens_per_sample: float, num_samples_global: int, world_size: int, seconds: float
) -> float:
    """Tokens per second per device: MindSpeed RL's e2e/update/vllm_tps formula,
    (response_length_mean + prompt_length_mean) x global_batch x n / world_size / time."""
    if seconds <= 0:
        return 0.0
    return tokens_per_sample * num_samples_global / world_size / seconds


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Local sums for 1 - Var[returns - values] / Var[returns], reduced by the caller."""
    m = mask.bool()
    r, d = returns.double().where(m, 0.0), (returns - values).double().where(m, 0.0)
    return to_host(
        {"n": m.sum(), "r": r.sum(), "r2": (r * r).sum(), "d": d.sum(), "d2": (d * d).sum()}
    )


def reduce_explained_variance(
    local: dict[str, float], data_group: dist.ProcessGroup | None = None
) -> float:
    """The explained variance of the global batch from every data rank's local sums."""
    s = all_reduce_scalars(local, "sum", data_group)
    n = max(s["n"], 1.0)
    var_r = s["r2"] / n - (s["r"] / n) ** 2
    var_d = s["d2"] / n - (s["d"] / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else 0.0


def add_rollout_stats(stats: StatCollector, out: RolloutOutput) -> None:
    """One generation round's statistics: the share of responses cut by generate_max_len,
    and every generated sequence's length (for rollout_tps; with --dynamic_filtering also the
    rounds' dropped groups, which the batch statistics never see)."""
    stats.add_mean("response_length/clip_ratio", truncated(out.finish_reasons))
    lengths = out.prompt_mask.sum(-1) + out.response_tokens_mask.sum(-1)
    stats.add_mean("rollout/generated_length", lengths.float())


def collect_batch_stats(
    stats: StatCollector,
    exp: Experience,
    trainer_old_logprobs: bool = True,
    trained_version: int | None = None,
    max_lag: int = 0,
) -> None:
    """The batch's statistics. ``trained_version`` (asynchronous training: the policy version
    the step starts from; its tokens carry the versions that sampled them) adds the trainer's
    old log-probs against the behaviour log-probs by staleness, lags ``0 .. max_lag``."""
    mask = exp.response_mask
    stats.add("critic/score", exp.scores)
    stats.add("critic/rewards", (exp.rewards * mask).sum(-1))
    stats.add("critic/advantages", exp.advantages, mask)
    stats.add("critic/returns", exp.returns, mask)
    if exp.values is not None:
        stats.add("critic/values", exp.values, mask)
    stats.add("response_length", mask.sum(-1))
    prompt_mask = exp.attention_mask[:, : -exp.response_len]
    stats.add("prompt_length", prompt_mask.sum(-1).float())
    # without it (--use_rollout_logprobs_as_old) old_logprobs are the engine's: nothing to compare
    if trainer_old_logprobs:
        diff = (exp.engine_logprobs - exp.old_logprobs).abs()
        stats.add("rollout/logprob_diff", diff, mask)
        mismatch = rollout_mismatch_metrics(exp.old_logprobs, exp.engine_logprobs, mask)
        tokens = mask.sum()
        for name in ("mismatch_kl", "mismatch_k1", "mismatch_abs_diff"):
            stats.add_weighted_mean(f"rollout/{name}", mismatch[name], tokens)
        if trained_version is not None and exp.token_versions is not None:
            lag = trained_version - exp.token_versions
            gaps = logprob_gap_by_staleness(
                exp.old_logprobs, exp.engine_logprobs, lag, mask, max_lag
            )
            for k, (total, count) in gaps.items():
                stats.add_sum_over_count(f"rollout/logprob_diff/staleness_{k}", total, count)


def collect_distill_stats(stats: StatCollector, exp: Experience) -> None:
    """On-policy distillation (with a teacher): ``distill/reverse_kl``, the mean over response
    tokens of ``old_logprob - teacher_logprob`` (the sampled-token estimate of
    KL(student || teacher) under the policy that sampled them), ``distill/teacher_logprob`` and
    ``distill/student_logprob`` (token means), and with a top-k loss ``distill/topk_mass``, the
    probability the teacher's top-k tokens hold."""
    if exp.teacher_logprobs is None:
        return
    mask = exp.response_mask
    tokens = mask.sum()
    n = tokens.clamp(min=1)
    for name, values in (
        ("reverse_kl", exp.old_logprobs - exp.teacher_logprobs),
        ("teacher_logprob", exp.teacher_logprobs),
        ("student_logprob", exp.old_logprobs),
    ):
        stats.add_weighted_mean(f"distill/{name}", (values * mask).sum() / n, tokens)
    if exp.teacher_topk_logprobs is not None:
        mass = exp.teacher_topk_logprobs.exp().sum(-1)
        stats.add_weighted_mean("distill/topk_mass", (mass * mask).sum() / n, tokens)


def throughput_metrics(
    metrics: dict[str, float],
    times: dict[str, float],
    cfg: PPOConfig,
    world_size: int,
    engine_name: str,
) -> dict[str, float]:
    """``e2e_tps``, ``update_tps`` and ``rollout_tps``; ``vllm_tps`` (MindSpeed RL's name) only
    when vLLM generated, so an HF-engine run does not report a vLLM speed.

    e2e and update count the batch trained on; rollout counts every sequence generated, which
    with --dynamic_filtering is ``dynamic_filter/gen_rounds`` full batches.
    """
    tokens = metrics["response_length/mean"] + metrics["prompt_length/mean"]
    n = cfg.batch.rollout_batch_size * cfg.batch.n_samples_per_prompt
    rounds = metrics.get("dynamic_filter/gen_rounds", 1.0)
    generated = metrics["rollout/generated_length"]
    out = {
        "e2e_tps": throughput(tokens, n, world_size, times.get("all", 0.0)),
        "update_tps": throughput(tokens, n, world_size, times.get("update", 0.0)),
        "rollout_tps": throughput(generated, n * rounds, world_size, times.get("rollout", 0.0)),
    }
    if engine_name == "vllm":
        out["vllm_tps"] = out["rollout_tps"]
    return out


SHOWN = ("step", "prompt", "response", "score")  # the columns TensorBoard and W&B show


def _distill_sample(exp: Experience, i: int) -> dict:
    """Row ``i``'s attended token ids, where its response starts among them, and its mean
    sampled-token reverse KL to the teacher."""
    T = exp.response_len
    attended = exp.attention_mask[i].bool()
    mask = exp.response_mask[i]
    gap = ((exp.old_logprobs[i] - exp.teacher_logprobs[i]) * mask).sum() / mask.sum().clamp(min=1)
    return {
        "input_ids": exp.input_ids[i][attended].tolist(),
        "response_start": int(attended[:-T].sum()),
        "distill/reverse_kl": float(gap),
    }


def log_samples(
    logger: MetricLogger,
    tokenizer,
    exp: Experience,
    prompts,
    *,
    step: int,
    n_samples: int,
    save_path: str,
    k: int = 3,
) -> None:
    """A few prompt/response/score triples to TensorBoard text and ``samples.jsonl``. With a
    teacher each ``samples.jsonl`` row also holds its sequence's token ids (``input_ids``, the
    response from ``response_start``) and its ``distill/reverse_kl`` (the token mean of
    ``old_logprob - teacher_logprob`` over its generated tokens), for checks outside the run."""
    T = exp.response_len
    rows = []
    for i in range(min(k, exp.num_sequences)):
        # every response token, the environment's turns of a multi-turn rollout included
        ids = exp.input_ids[i, -T:][exp.attention_mask[i, -T:].bool()].tolist()
        rows.append(
            {
                "step": step,
                "prompt": prompts[i // n_samples].text,
                "response": tokenizer.decode(ids, skip_special_tokens=False),
                "score": float(exp.scores[i]),
            }
        )
        if exp.teacher_logprobs is not None:
            rows[-1].update(_distill_sample(exp, i))
    path = Path(save_path) / "samples.jsonl"
    with writing(path), open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    rows = [{k: v for k, v in r.items() if k in SHOWN} for r in rows]
    body = "\n\n".join(
        f"**prompt**: {r['prompt']}\n\n**response**: {r['response']}\n\n**score**: {r['score']:.4f}"
        for r in rows
    )
    logger.text("samples", body, step)
    logger.table("samples", rows, step)
