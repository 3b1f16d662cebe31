"""What `train-rm`, `sft` and `dpo` share: one model trained over a fixed, pre-tokenized
dataset (the commands themselves are ``trainers/rm.py``, ``sft.py`` and ``dpo.py``).

    data.py      prepare: flags, paths, every row checked and tokenized, before the process group
    models.py    the reward model, the policy and DPO's reference, built and sharded
    trainer.py   OfflineTrainer: optimizer, schedule, resumable data order, metrics, checkpoints
"""
