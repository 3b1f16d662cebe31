"""`torchrun --nnodes 2` across the test cluster's hosts: c10d rendezvous on node1, gloo over
eth0 (GLOO_SOCKET_IFNAME), one rank per host (the machine has 2 cores: TP 1). Each run must
reproduce the single-host run with the same world size, flags and seed."""

from __future__ import annotations

from tests.cluster import runs


def _two_hosts(setup, logs, cmd: str, name: str, flags: list[str]) -> list[dict]:
    run = runs.run_hosts(setup.cluster, cmd, flags, logs, tag=name)
    assert run.returncode == 0, {h: runs.tail(t) for h, t in run.logs.items()}
    runs.record(logs, f"{name}_s", run.seconds)
    return runs.read_metrics(setup.save(name))


def test_train_rm_on_two_hosts_matches_one_host(setup, rm_reference, logs):
    got = _two_hosts(setup, logs, "train-rm", "rm_two_hosts", setup.rm_flags("rm_two_hosts"))
    assert not runs.compare_metrics(got, rm_reference["metrics"])


def test_grpo_on_two_hosts_matches_one_host(setup, grpo_reference, logs):
    flags = setup.ppo_flags("grpo_two_hosts", *runs.GRPO_FLAGS)
    got = _two_hosts(setup, logs, "ppo", "grpo_two_hosts", flags)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert not runs.compare_metrics(got, grpo_reference["metrics"])


def test_gae_on_two_hosts_matches_one_host(setup, gae_reference, logs):
    flags = setup.ppo_flags("gae_two_hosts", *runs.GAE_FLAGS)
    got = _two_hosts(setup, logs, "ppo", "gae_two_hosts", flags)
    assert all("critic/vf_loss" in r for r in got)
    assert not runs.compare_metrics(got, gae_reference["metrics"])
