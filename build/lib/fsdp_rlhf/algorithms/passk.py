"""pass@k from ``n`` samples per prompt, and the evaluation summary built on it.

The unbiased estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on
Code", arXiv:2107.03374, eq. 1) of the probability that at least one of ``k`` samples is
correct, given ``c`` correct among ``n >= k`` samples of a prompt:

    pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i)

The product form never builds the (huge) binomial coefficients, so it is exact enough in
float64 for any ``n``. It is 1 when ``n - c < k`` (every draw of ``k`` contains a correct one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct out of ``n`` samples.

    Args:
        n: Samples drawn for the prompt (>= 1).
        c: Correct samples (``0 <= c <= n``).
        k: Budget (``1 <= k <= n``).

    Returns:
        The estimate in [0, 1]; ``c / n`` for ``k = 1``.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k_per_prompt(correct: torch.Tensor, k: int) -> torch.Tensor:
    """pass@k for every prompt of a (P, n) correctness matrix.

    Args:
        correct: (P, n) bool (or 0/1) tensor, one row per prompt, ``n`` samples each.
        k: Budget (``1 <= k <= n``).

    Returns:
        (P,) float64 estimates.
    """
    if correct.dim() != 2:
        raise ValueError(f"correct must be (P, n), got shape {tuple(correct.shape)}")
    n = correct.shape[1]
    counts = correct.bool().sum(dim=1).tolist()
    return torch.tensor([pass_at_k(n, int(c), k) for c in counts], dtype=torch.float64)


def eval_pass_metrics(
    correct: torch.Tensor | Sequence[Sequence[bool]], ks: Iterable[int] | None = None
) -> dict[str, float]:
    """Summary of an evaluation: mean pass@1 and mean pass@k over prompts.

    Args:
        correct: (P, n) per-sample correctness grouped by prompt (rows = prompts; a tensor or
            nested lists). A sample counts as correct when its score says so (e.g. reward > 0
            for 0/1 verifiers); the caller decides.
        ks: Budgets to report (each ``1 <= k <= n``); ``None`` reports ``k = n``. ``pass@1``
            is always reported.

    Returns:
        ``{"pass@1": ..., "pass@k": ...}`` as Python floats; ``pass@1`` is the mean accuracy
        over all samples (every prompt has ``n`` samples, so it equals the per-prompt mean).
    """
    matrix = torch.as_tensor(correct).bool()
    if matrix.dim() != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"correct must be a non-empty (P, n) matrix, got {tuple(matrix.shape)}")
    n = matrix.shape[1]
    budgets = sorted({1, *(ks if ks is not None else (n,))})
    return {f"pass@{k}": float(pass_at_k_per_prompt(matrix, k).mean()) for k in budgets}
