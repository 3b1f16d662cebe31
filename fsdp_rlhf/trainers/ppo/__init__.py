"""`fsdp-rlhf ppo`: every module of the PPO command (the step, its setup, its sources of
experiences, the asynchronous trainer). ``PPOTrainer`` and ``main`` are re-exported from
``trainer.py`` so that ``fsdp_rlhf.trainers.ppo`` stays the command's entry module.

    trainer.py            PPOTrainer: the phases of one step, in order; main
    setup.py              cheap checks before heavy work (prepare), then each component built
    source.py             where a step's batch comes from (colocated engine or async queue)
    colocated.py          the engine beside the actor on this rank
    rollout.py            the engine beside the actor: wake, sync weights, sample, sleep
    multiturn.py          multi-turn rollouts in a step: one wake-up, statistics, the runner
    vision.py             a vision-language actor: images checked, prompts per step
    rewards.py            from scores to advantages: rule rewards, the KL term, the estimators
    dynamic_filtering.py  DAPO dynamic sampling (--dynamic_filtering)
    update.py             the actor and critic updates: epochs x minibatches x micro-batches
    metrics.py            step metrics with verl / MindSpeed RL names
    eval.py               evaluation during training (--eval_dataset): pass@1, pass@k
    async_train.py        --async_train: training ranks fed by rollout ranks
    async_rollout.py      a rollout rank: batches generated ahead, within the staleness bound
    async_queue.py        what travels between rollout and training ranks, and their schedule
    async_ledger.py       the ledger: which prompts were generated, queued and trained
    pairing.py            the pairing audit: each async sample checked at the update
"""

from fsdp_rlhf.trainers.ppo.trainer import PPOTrainer, build_colocated, main

__all__ = ["PPOTrainer", "build_colocated", "main"]
