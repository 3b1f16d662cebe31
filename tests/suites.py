"""Which suite (make target) each test belongs to: exactly one, so that a pytest run over
several suites runs every test once (`make test SUITES="test async vlm"`, .ci/run).

A test's suite is the first rule below that its folder or markers meet. ``featured`` tests are
a feature suite's short case that `make test` runs: they belong to `make test` (``test``), not
again to their feature's suite.
"""

from __future__ import annotations

from collections.abc import Iterable

# suite -> what it is (the Makefile target is `make test-<suite>`, `make test` for "test")
SUITES = {
    "test": "make test: unit, 2-rank gloo and CLI runs, one short case of every feature",
    "faults": "fault injection: a failure on one rank, a full disk, a stop mid-step",
    "async": "--async_train end to end",
    "async-resume": "the lossless async-resume matrix (not in CI)",
    "models": "the family matrix",
    "models-full": "the families beside a like family in CI's selection (not in CI)",
    "vlm": "vision-language models",
    "pairs": "the pairwise feature matrix's jobs after the first",
    "flagship": "the hybrid MoE VLM trained async with SP and router replay",
    "distill": "on-policy distillation's longer runs: a fine-tuned teacher, a served teacher",
    "bench": "the bench's smoke run",
    "sp": "sequence parallelism",
    "ep": "expert parallelism",
    "cluster": "multi-host: network-namespace hosts, a real Slurm (root)",
    "gpu": "the GPU suite (CUDA checks skip on CPU)",
    "long": "the longer duplicates of a CI case (not in CI)",
}
# What .ci/run runs in one pytest process (the GPU suite runs apart: vLLM hidden from it).
CI = (
    "test", "faults", "async", "models", "vlm", "pairs", "flagship", "distill", "bench", "sp",
    "ep",
)  # fmt: skip

# (marker, suite), in order: the first marker a test carries decides.
_BY_MARKER = (
    ("long", "long"),
    ("async_resume_full", "async-resume"),
    ("models_full", "models-full"),
    ("featured", "test"),
    ("flagship", "flagship"),
    ("distill", "distill"),
    ("pairs", "pairs"),
    ("faults", "faults"),
    ("asynchronous", "async"),
    ("sp", "sp"),
    ("ep", "ep"),
    ("vlm", "vlm"),
)
# folders whose tests are a suite of their own whatever their markers
_BY_FOLDER = {"cluster": "cluster", "gpu": "gpu", "bench": "bench"}


def suite_of(folder: str, markers: Iterable[str]) -> str:
    """The suite of a test in ``tests/<folder>/`` carrying ``markers``."""
    if folder in _BY_FOLDER:
        return _BY_FOLDER[folder]
    names = set(markers)
    for marker, suite in _BY_MARKER:
        if marker in names:
            return suite
    return "models" if folder == "models" else "test"


def parse(value: str) -> list[str]:
    """``--suites`` as given (commas or spaces; ``ci`` for .ci/run's), checked."""
    names = [n for part in value.replace(",", " ").split() for n in part.split()]
    out: list[str] = []
    for name in names:
        for suite in CI if name == "ci" else (name,):
            if suite not in SUITES:
                raise ValueError(f"unknown suite {suite!r}: one of {', '.join(SUITES)} or ci")
            if suite not in out:
                out.append(suite)
    return out
