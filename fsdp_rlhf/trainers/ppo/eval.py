"""Evaluation during PPO training (``--eval_dataset``): pass@1 and pass@k on held-out prompts.

Every ``--eval_steps`` steps and after the last one, the training vLLM engine (already holding
the newest actor weights after a sync) answers every eval prompt twice: greedily (n = 1) and
sampled (``--eval_n_samples_per_prompt`` at ``--eval_temperature``). Responses are scored like
training rollouts (reward model and/or rule reward, clipped; no overlong penalty) and a
response counts as **correct when its score is > 0**, the natural reading of 0/1 verifier
rewards. (OpenRLHF's evaluation averages the raw reward for pass@1 and takes the group maximum
for pass@n, which agrees with this on 0/1 rewards; for a reward model's real-valued scores
"correct" is only "scored above 0", so ``eval/score_mean`` is logged too.)

Under ``--async_train`` the rollout ranks evaluate (the training ranks hold no engine): an
evaluated step's weights are published with a flag, each rollout rank loads them at its next
batch boundary, evaluates its share of the prompts before it generates on, and sends its sums
to training rank 0; the training ranks wait for them at the end of that step (the metrics and
``best`` belong to that step's weights, as colocated). With a reward model that is refused:
the rollout ranks hold none (``rules`` row ``async-eval-reward-model``).

Metrics (global over ranks): ``eval/greedy_pass@1``, ``eval/pass@1`` (sampled), ``eval/pass@k``
for ``k = n`` and the k of ``--save_best_metric`` (unbiased estimator, see
:mod:`fsdp_rlhf.algorithms.passk`), ``eval/score_mean``, ``eval/greedy_score_mean``.

``--save_best_metric pass@K`` keeps ``<save_path>/best``: an HF export of the actor at the best
``eval/pass@K`` so far, with ``best_metric.json`` inside (swapped in whole, see
:meth:`Evaluator.save_best`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fsdp_rlhf.algorithms import eval_pass_metrics
from fsdp_rlhf.config import PPOConfig
from fsdp_rlhf.data.prompts import Prompt, tokenize_prompts
from fsdp_rlhf.distributed.env import DistEnv, all_reduce_scalars, barrier, broadcast_object
from fsdp_rlhf.distributed.layout import ParallelLayout
from fsdp_rlhf.errors import UserError, reading, writing
from fsdp_rlhf.rollout import RolloutOutput, SamplingConfig
from fsdp_rlhf.trainers.experience import Experience, experience_from_rollout

log = logging.getLogger("fsdp_rlhf")

BEST_DIR, BEST_FILE = "best", "best_metric.json"
EVAL_SEED = 20_251_122  # the same seed every evaluation: steps are compared on equal draws

Generate = Callable[..., RolloutOutput]  # (prompts, sampling, metrics, phase)
Score = Callable[[Experience, list[Prompt], int], None]  # fills exp.scores


def load_eval_rows(cfg: PPOConfig):
    """The eval prompt rows, loaded like the training prompts. UserError on bad input."""
    from fsdp_rlhf.data.sources import check_keys, load_sources

    rows = load_sources(
        cfg.eval.eval_dataset,
        None,
        max_samples=cfg.data.max_samples,
        seed=cfg.seed,
        flag_name="--eval_dataset",
        split=cfg.eval.eval_split,
    )
    keys = [cfg.data.input_key] + ([cfg.data.label_key] if cfg.data.label_key else [])
    flags = ["--input_key"] + (["--label_key"] if cfg.data.label_key else [])
    check_keys(rows, keys, flags, where="--eval_dataset")
    if len(rows) == 0:
        raise UserError(f"--eval_dataset {cfg.eval.eval_dataset} has no rows")
    return rows


def shard(num_prompts: int, rank: int, world_size: int) -> tuple[list[int], list[bool]]:
    """This rank's eval prompt indices and which of them count.

    Every rank gets ``ceil(P / world)`` prompts, so all run the same number of reward-model
    forwards (FSDP collectives); the last shards wrap around to prompt 0 and those repeats are
    marked not to count.
    """
    per = math.ceil(num_prompts / world_size)
    idx = [rank * per + i for i in range(per)]
    return [i % num_prompts for i in idx], [i < num_prompts for i in idx]


def eval_due(cfg: PPOConfig, step: int, total_steps: int) -> bool:
    """Whether step ``step`` ends with an evaluation: every ``--eval_steps`` and the last."""
    if cfg.eval.eval_dataset is None:
        return False
    every = cfg.logging.eval_steps
    return step == total_steps or (every > 0 and step % every == 0)


def pass_budgets(n: int, save_best_metric: str | None) -> list[int]:
    ks = {1, n}
    if save_best_metric:
        ks.add(int(save_best_metric.rsplit("@", 1)[1]))
    return sorted(ks)


def local_eval_sums(
    greedy_scores: torch.Tensor, sampled_scores: torch.Tensor, real: list[bool], ks: list[int]
) -> dict[str, float]:
    """Sums over this rank's counted prompts (all-reduced, then divided by ``count``).

    Args:
        greedy_scores: (P,) score of each prompt's greedy response.
        sampled_scores: (P, n) scores of the sampled responses, one row per prompt.
        real: P flags, False for padding repeats.
    """
    keep = torch.tensor(real, dtype=torch.bool)
    count = int(keep.sum())
    sums = {"count": float(count)}
    greedy, sampled = greedy_scores.cpu()[keep], sampled_scores.cpu()[keep]
    pass_sampled = eval_pass_metrics(sampled > 0, ks) if count else {}
    pass_greedy = eval_pass_metrics((greedy > 0).unsqueeze(1)) if count else {}
    for k in ks:
        sums[f"eval/pass@{k}"] = pass_sampled.get(f"pass@{k}", 0.0) * count
    sums["eval/greedy_pass@1"] = pass_greedy.get("pass@1", 0.0) * count
    sums["eval/score_mean"] = float(sampled.double().mean(dim=1).sum()) if count else 0.0
    sums["eval/greedy_score_mean"] = float(greedy.double().sum())
    return sums


def finish_eval(sums: dict[str, float]) -> dict[str, float]:
    """Global means from all-reduced sums."""
    count = max(sums["count"], 1.0)
    return {k: v / count for k, v in sums.items() if k != "count"}


class Evaluator:
    def __init__(
        self,
        cfg: PPOConfig,
        env: DistEnv,
        prompts: list[Prompt],
        parallel: ParallelLayout | None = None,
    ) -> None:
        self.cfg, self.env = cfg, env
        # a sequence-parallel group shares a data shard (None: every rank its own)
        parallel = parallel or ParallelLayout(world_size=env.world_size, rank=env.rank)
        self.data_group = parallel.data_group
        idx, self.real = shard(len(prompts), parallel.dp_rank, parallel.dp_size)
        self.prompts = [prompts[i] for i in idx]
        self.n = cfg.eval.eval_n_samples_per_prompt
        self.ks = pass_budgets(self.n, cfg.eval.save_best_metric)
        self.metric = None
        if cfg.eval.save_best_metric:
            self.metric = "eval/" + cfg.eval.save_best_metric.removeprefix("eval/")
        self.best = self._saved_best()
        log.info(
            "evaluation: %d prompts, n=%d, metrics every %s",
            len(prompts),
            self.n,
            f"{cfg.logging.eval_steps} steps" if cfg.logging.eval_steps > 0 else "run end",
        )

    def due(self, step: int, total_steps: int) -> bool:
        return eval_due(self.cfg, step, total_steps)

    def _sampling(self, greedy: bool) -> SamplingConfig:
        e, r = self.cfg.eval, self.cfg.rollout
        return SamplingConfig(
            max_new_tokens=r.generate_max_len,
            max_total_len=r.max_len,
            temperature=0.0 if greedy else e.eval_temperature,
            top_p=1.0 if greedy else r.top_p,
            top_k=-1 if greedy else r.top_k,
            n=1 if greedy else self.n,
            seed=EVAL_SEED,
            greedy=greedy,
        )

    def _scores(self, generate: Generate, score: Score, greedy: bool) -> torch.Tensor:
        sampling = self._sampling(greedy)
        out = generate(self.prompts, sampling, None, "eval")
        exp = experience_from_rollout(out, self.env.device)
        score(exp, self.prompts, sampling.n)
        return exp.scores.reshape(len(self.prompts), sampling.n)

    def local_sums(self, generate: Generate, score: Score) -> dict[str, float]:
        """Generate and score this rank's share; its sums (see :func:`local_eval_sums`)."""
        greedy = self._scores(generate, score, greedy=True)[:, 0]
        sampled = self._scores(generate, score, greedy=False)
        return local_eval_sums(greedy, sampled, self.real, self.ks)

    def run(self, generate: Generate, score: Score) -> dict[str, float]:
        """Generate, score and reduce (collective: every rank calls it at the same step)."""
        start = time.perf_counter()
        local = self.local_sums(generate, score)
        sums = all_reduce_scalars(local, "sum", self.data_group)
        metrics = finish_eval(sums)
        metrics["timing/eval"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------ best model

    @property
    def best_dir(self) -> Path:
        return Path(self.cfg.ckpt.save_path) / BEST_DIR

    def _saved_best(self) -> float | None:
        """A resumed run continues the interrupted one's record; a fresh run starts over."""
        path = self.best_dir / BEST_FILE
        if self.metric is None or not self.cfg.ckpt.load_checkpoint or not path.is_file():
            return None
        with reading("best-model record", path):
            saved = json.loads(path.read_text())
            return float(saved["value"]) if saved.get("metric") == self.metric else None

    def improved(self, metrics: dict[str, float]) -> bool:
        if self.metric is None:
            return False
        value = metrics[self.metric]
        better = math.isfinite(value) and (self.best is None or value > self.best)
        return bool(broadcast_object(better))  # one decision: the export below is collective

    def save_best(self, step: int, metrics: dict[str, float], export: Callable[[Path], None]):
        """Export the actor to ``best`` (collective). The export goes to a staging folder
        with ``best_metric.json`` written inside, and only then replaces ``best``, so ``best``
        never pairs weights with another step's value."""
        value = metrics[self.metric]
        staging = self.best_dir.with_name(f"{BEST_DIR}.staging")
        export(staging)
        if self.env.is_rank0:
            record = {"metric": self.metric, "value": value, "step": step}
            old = self.best_dir.with_name(f"{BEST_DIR}.old")
            with writing(self.best_dir):
                (staging / BEST_FILE).write_text(json.dumps(record, indent=2))
                shutil.rmtree(old, ignore_errors=True)
                if self.best_dir.exists():
                    self.best_dir.rename(old)
                staging.rename(self.best_dir)
            shutil.rmtree(old, ignore_errors=True)
        barrier()
        self.best = value
        log.info("best %s = %.4f at step %d: saved to %s", self.metric, value, step, self.best_dir)


def build_evaluator(
    cfg: PPOConfig, env: DistEnv, tokenizer, parallel: ParallelLayout | None = None, images=None
) -> Evaluator | None:
    """``images``: a VLM's ``ppo.vision.StepImages`` (eval prompts may hold images)."""
    if cfg.eval.eval_dataset is None:
        return None
    vision = images.vision if images is not None else None
    rows = load_eval_rows(cfg)
    prompts = tokenize_prompts(rows, tokenizer, cfg.data, vision, cfg.vision.image_key)
    if not prompts:
        raise UserError(f"--eval_dataset {cfg.eval.eval_dataset}: no non-empty prompts")
    return Evaluator(cfg, env, prompts, parallel)
