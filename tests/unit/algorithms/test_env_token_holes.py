"""Multi-turn responses put environment tokens (response_mask 0) in the MIDDLE of a response.
Whatever values sit at those positions, every estimator, KL, loss and correction must give the
model tokens exactly what they get with the environment tokens cut out (verl's choice: values
and advantages live on model tokens only; the next state of a model token is the next model
token)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from fsdp_rlhf.algorithms import (
    aggregate_loss,
    estimate_advantages,
    gspo_loss,
    kl_estimate,
    policy_loss,
    rollout_correction,
)

B, T, N = 4, 12, 2


def holed_batch(gen: torch.Generator):
    """(mask with env-token holes, the same rows compacted) and random per-token tensors."""
    mask = torch.ones(B, T)
    mask[:, 3:6] = 0  # an observation after a 3-token first turn
    mask[1, 9:] = 0  # right padding
    mask[2, 7] = 0  # a one-token observation
    tensors = {k: torch.randn(B, T, generator=gen) for k in ("a", "b", "c", "v")}
    return mask, tensors


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's model tokens to the left: (B, T) values and mask without holes."""
    out, m = torch.zeros_like(x), torch.zeros_like(mask)
    for i in range(x.shape[0]):
        kept = x[i][mask[i].bool()]
        out[i, : kept.numel()], m[i, : kept.numel()] = kept, 1
    return out, m


def garbage(x: torch.Tensor, mask: torch.Tensor, fill: float = 1e4) -> torch.Tensor:
    """``x`` with ``fill`` at masked positions: nothing may read them."""
    return torch.where(mask.bool(), x, torch.full_like(x, fill))


@pytest.mark.parametrize("estimator", ["gae", "reinforce++", "grpo", "rloo", "reinforce_baseline"])
def test_estimators_ignore_env_tokens(estimator):
    gen = torch.Generator().manual_seed(0)
    mask, t = holed_batch(gen)
    scores = torch.randn(B, generator=gen)
    kl, values = t["a"].abs(), t["v"]
    common = dict(gamma=0.9, lam=0.8, n_samples_per_prompt=N)
    holed = estimate_advantages(
        estimator, scores, garbage(kl, mask), 0.1, mask, values=garbage(values, mask), **common
    )
    ckl, cmask = compact(kl, mask)
    cvalues, _ = compact(values, mask)
    packed = estimate_advantages(estimator, scores, ckl, 0.1, cmask, values=cvalues, **common)
    for name in ("advantages", "returns", "rewards"):
        h = getattr(holed, name)
        assert torch.all(h[~mask.bool()] == 0), name
        torch.testing.assert_close(compact(h, mask)[0], getattr(packed, name), msg=name)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_losses_kl_and_correction_ignore_env_tokens(mode):
    gen = torch.Generator().manual_seed(1)
    mask, t = holed_batch(gen)
    lp, old, adv = t["a"] * 0.1 - 1, t["b"] * 0.1 - 1, t["c"]
    rollout = old + 0.05 * t["v"]
    cm = compact(lp, mask)[1]

    def both(fn, *xs):
        # a different fill per argument: a log-ratio at env tokens is then far from 0
        holed = fn(*[garbage(x, mask, 7.0 - 11.0 * k) for k, x in enumerate(xs)], mask)
        packed = fn(*[compact(x, mask)[0] for x in xs], cm)
        return holed, packed

    h, p = both(lambda a, b, c, m: policy_loss(a, b, c, m, loss_agg=mode)[0], lp, old, adv)
    torch.testing.assert_close(h, p)
    h, p = both(lambda a, b, c, m: gspo_loss(a, b, c, m, loss_agg=mode)[0], lp, old, adv)
    torch.testing.assert_close(h, p)
    h, p = both(lambda a, b, m: aggregate_loss(kl_estimate(a, b, "k3") * m, m, mode), lp, old)
    torch.testing.assert_close(h, p)
    for corr in ("tis", "icepop", "seq_mask_tis"):
        (hw, hs), (pw, ps) = both(partial(rollout_correction, mode=corr), old, rollout)
        torch.testing.assert_close(compact(hw, mask)[0], pw)
        for key in hs:
            torch.testing.assert_close(hs[key], ps[key], msg=f"{corr} {key}")
