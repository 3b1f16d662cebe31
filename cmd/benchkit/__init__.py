"""`make bench`: fsdp-rlhf against TRL on the same machine (see ``cmd/bench.py``).

Modules: ``workload`` (sizes, model, data), ``launch`` (torchrun jobs with step timestamps and
RSS sampling), ``rm`` and ``rl`` (the comparisons), ``trl_rm_worker`` / ``trl_grpo_worker``
(the TRL side, run under torchrun), ``memcpy``, ``report`` (JSON, markdown, console table).
"""
