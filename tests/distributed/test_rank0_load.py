"""Rank 0 loads, every rank shards a meta skeleton filled from rank 0's copy (issue #36).

Before, every rank loaded the whole model in host memory before sharding it (about 131 GB per
rank for a 32B model in fp32). Checked on 2 gloo ranks: the sharded model is the one every rank
used to load (values, ties, buffers, first dimensions that do not divide the world size), and
the host memory a rank other than 0 peaks at is its shard, not the model.
"""

from __future__ import annotations

import torch

from fsdp_rlhf.config import BackendConfig, FSDPConfig
from tests.dist_utils import run_distributed


def _shard_both_ways(rank: int, world: int, cases: list[tuple[str, bool]]):
    return [_compare(rank, path, scalar) for path, scalar in cases]


def _layout(env):
    from fsdp_rlhf.distributed.layout import ParallelLayout

    return ParallelLayout(world_size=env.world_size, rank=env.rank)


def _compare(rank: int, path: str, scalar: bool):
    from fsdp_rlhf.models.load import load_causal_lm, load_scalar_model
    from fsdp_rlhf.trainers.common import load_and_prepare, prepare_model
    from tests.dist_utils import current_env

    env = current_env()
    backend, fsdp = BackendConfig(), FSDPConfig(zero_stage=3)

    def load(weights: bool):
        if scalar:  # a reward model whose head is initialised: rank 0's init reaches everyone
            torch.manual_seed(123)
            return load_scalar_model(path, backend, env.device, weights=weights)
        return load_causal_lm(path, backend, env.device, weights=weights)

    kw = dict(packed=False, trainable=True, parallel=_layout(env))
    old = prepare_model(load(True), env, fsdp, backend, **kw)  # every rank loads
    new = load_and_prepare(load, env, fsdp, backend, what="test", **kw)
    diffs = {
        n: (p.full_tensor() - dict(old.named_parameters())[n].full_tensor()).abs().max().item()
        for n, p in new.named_parameters()
    }
    buffers = {n: torch.equal(b, dict(old.named_buffers())[n]) for n, b in new.named_buffers()}
    ids = torch.randint(2, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out_old, out_new = (m(input_ids=ids).logits for m in (old, new))
    tied = None
    if not scalar and new.config.tie_word_embeddings:
        tied = new.lm_head.weight is new.model.embed_tokens.weight
    same_config = new.config.to_dict() == old.config.to_dict()
    if not scalar:  # an export writes it: the checkpoint's EOS ids and sampling defaults
        same_config &= new.generation_config.to_dict() == old.generation_config.to_dict()
    return dict(
        same_config=same_config,
        diffs=diffs,
        buffers=buffers,
        forward=(out_new - out_old).abs().max().item(),
        tied=tied,
        devices={p.to_local().device.type for p in new.parameters()},
    )


def test_rank0_load_matches_every_rank_loading(tiny_llama, tmp_path):
    from fsdp_rlhf.testing.tiny import build_model

    # first dimensions that do not divide 2 ranks: vocabulary, hidden, MLP width
    odd = str(build_model(tmp_path / "odd", "llama", hidden_size=576, intermediate_size=333))
    cases = [(tiny_llama, False), (odd, False), (odd, True)]
    for per_rank in run_distributed(_shard_both_ways, 2, cases):
        for (path, _), r in zip(cases, per_rank, strict=True):
            assert r["diffs"] and max(r["diffs"].values()) == 0.0, (path, r["diffs"])
            assert r["buffers"] and all(r["buffers"].values()), r["buffers"]
            # the weights are equal bit for bit (above); logits computed from two models' buffers
            # need not be: a CPU kernel's bits can depend on alignment and the ISA
            assert r["forward"] < 1e-5 and r["same_config"], r
            assert r["tied"] in (None, True), r
            assert r["devices"] == {"cpu"}, r


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _peak_host_memory(rank: int, world: int, path: str, rank0_only: bool):
    import gc

    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.trainers.common import load_and_prepare, prepare_model
    from tests.dist_utils import current_env

    env = current_env()
    backend, fsdp = BackendConfig(), FSDPConfig(zero_stage=3)
    load_causal_lm(path, backend, env.device, weights=False)  # imports, before the baseline
    gc.collect()
    before = _status_kib("VmRSS")
    load = lambda weights: load_causal_lm(path, backend, env.device, weights=weights)  # noqa: E731
    kw = dict(packed=False, trainable=True, parallel=_layout(env))
    if rank0_only:
        model = load_and_prepare(load, env, fsdp, backend, what="test", **kw)
    else:  # what every rank did before
        model = prepare_model(load(True), env, fsdp, backend, **kw)
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    return dict(peak_mib=(_status_kib("VmHWM") - before) / 1024, shard_mib=shard / 2**20)


def test_only_rank0_holds_the_whole_model_in_host_memory(tmp_path):
    from fsdp_rlhf.testing.tiny import build_model

    # 52M parameters: about 200 MiB in fp32; its largest tensor 3 MiB
    path = str(
        build_model(tmp_path / "m", "qwen2", hidden_size=512, num_layers=16, num_heads=8,
                    intermediate_size=1536, vocab_size=2048)
    )  # fmt: skip
    every = run_distributed(_peak_host_memory, 2, path, False)
    rank0 = run_distributed(_peak_host_memory, 2, path, True)
    full = 2 * every[1]["shard_mib"]
    print(f"peak host MiB above baseline, model {full:.0f} MiB in fp32 on 2 ranks:")
    for name, runs in (("every rank loads", every), ("rank 0 loads", rank0)):
        print(
            f"  {name}: " + ", ".join(f"rank {i} {r['peak_mib']:.0f}" for i, r in enumerate(runs))
        )
    assert every[1]["peak_mib"] > 0.9 * full, every  # the whole model, then its shard
    assert rank0[1]["peak_mib"] < 0.75 * full, rank0  # its shard and one tensor in flight
    assert rank0[1]["peak_mib"] < 0.7 * every[1]["peak_mib"], (every, rank0)
