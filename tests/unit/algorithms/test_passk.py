import math

import pytest
import torch

from fsdp_rlhf.algorithms import eval_pass_metrics, pass_at_k, pass_at_k_per_prompt
from tests.unit.algorithms.helpers import SEEDS, make_gen


@pytest.mark.parametrize("n", [1, 2, 4, 7, 16])
def test_pass_at_k_equals_the_binomial_formula(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_closed_forms_and_large_n():
    assert pass_at_k(4, 2, 1) == 0.5
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples
    # n = 1000: the binomials are astronomically large, the product form is not.
    exact = 1.0 - math.comb(990, 100) / math.comb(1000, 100)
    assert pass_at_k(1000, 10, 100) == pytest.approx(exact, rel=1e-12)
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


@pytest.mark.parametrize("seed", SEEDS[:6])
def test_pass_at_k_is_the_expectation_over_k_subsets(seed):
    """pass@k is unbiased: it equals the fraction of k-subsets with a correct sample."""
    from itertools import combinations

    gen = make_gen(seed)
    correct = torch.rand(5, 6, generator=gen) < 0.3
    for k in (1, 2, 3, 6):
        per_prompt = pass_at_k_per_prompt(correct, k)
        for p in range(5):
            row = correct[p].tolist()
            subsets = list(combinations(range(6), k))
            frac = sum(any(row[i] for i in s) for s in subsets) / len(subsets)
            assert per_prompt[p].item() == pytest.approx(frac, rel=1e-12, abs=1e-15)


def test_eval_pass_metrics_on_groups_of_four():
    correct = [
        [True, False, False, False],  # c=1
        [False, False, False, False],  # c=0
        [True, True, True, True],  # c=4
        [True, True, False, False],  # c=2
    ]
    out = eval_pass_metrics(correct)
    assert set(out) == {"pass@1", "pass@4"}
    assert out["pass@1"] == pytest.approx((1 + 0 + 4 + 2) / 16)
    assert out["pass@4"] == pytest.approx(3 / 4)
    out = eval_pass_metrics(torch.tensor(correct), ks=[2])
    pass2 = [1 - 3 / 6, 0.0, 1.0, 1 - 1 / 6]  # 1 - C(n-c,2)/C(4,2)
    assert out == {"pass@1": pytest.approx(7 / 16), "pass@2": pytest.approx(sum(pass2) / 4)}
    assert all(type(v) is float for v in out.values())
    with pytest.raises(ValueError):
        eval_pass_metrics([[True, False]], ks=[3])
    with pytest.raises(ValueError):
        eval_pass_metrics(torch.zeros(0, 4, dtype=torch.bool))
