"""What `train-rm`, `sft` and `dpo` share: one model trained over a fixed, pre-tokenized
dataset. The commands themselves are here too: ``rm.py`` (its step and evaluation in
``rm_steps.py``), ``sft.py`` and ``dpo.py``.

    data.py      prepare: flags, paths, every row checked and tokenized, before the process group
    models.py    the reward model, the policy and DPO's reference, built and sharded
    trainer.py   OfflineTrainer: optimizer, schedule, resumable data order, metrics, checkpoints
"""
