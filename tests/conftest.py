"""Shared fixtures: tiny local models (no downloads), seeded RNG, CUDA skip marker."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from fsdp_rlhf.testing import warm_launch
from tests import suites

REPO = Path(__file__).resolve().parents[1]
# folders whose tests launch ranks (torchrun, gloo): a session holding any starts the warm
# launcher's server at once, so that its imports overlap the first tests
_LAUNCHING = ("e2e", "distributed", "vlm", "models", "cluster")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Arrow caches of the many small files tests load go to /tmp, not the user's ~/.cache.
os.environ.setdefault(
    "HF_DATASETS_CACHE", os.path.join(tempfile.gettempdir(), "fsdp_rlhf_tests_hf_datasets")
)


def pytest_addoption(parser):
    parser.addoption(
        "--suites",
        default=None,
        help="run only these suites (comma/space separated; `ci` = .ci/run's): tests/suites.py",
    )


def _folder(item) -> str:
    """The folder under tests/ that holds the test (``""`` for a file in tests/ itself)."""
    parts = Path(str(item.fspath)).parts
    below = parts[len(parts) - 1 - parts[::-1].index("tests") + 1 :] if "tests" in parts else ()
    return below[0] if len(below) > 1 else ""


def _suite(item) -> str:
    return suites.suite_of(_folder(item), (m.name for m in item.iter_markers()))


_CLOCK: dict[str, float] = {}


def pytest_sessionstart(session):
    import time

    _CLOCK["start"] = time.monotonic()


def pytest_collection_finish(session):
    import time

    _CLOCK["collected"] = time.monotonic()
    _SUITE_OF.update((item.nodeid, _suite(item)) for item in session.items)
    if warm_launch.mode() != "warm":
        return
    if any(_folder(item) in _LAUNCHING for item in session.items):
        warm_launch.start_server(REPO)


def pytest_collection_modifyitems(config, items):
    chosen = config.getoption("--suites")
    if chosen:
        try:
            wanted = set(suites.parse(chosen))
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        keep = [i for i in items if _suite(i) in wanted]
        config.hook.pytest_deselected(items=[i for i in items if _suite(i) not in wanted])
        items[:] = keep
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # the marker, not a keyword: keywords also hold folder names (a checkout named "gpu")
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    """A 2-layer Qwen2 (hidden 128, 2 heads of 64) with a trained BPE tokenizer, saved locally;
    like Qwen2/2.5 checkpoints its config.json has no head_dim."""
    from fsdp_rlhf.testing.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 2-layer Llama shaped like SmolLM: 9 query / 3 KV heads of 64, tied embeddings."""
    from fsdp_rlhf.testing.tiny import build_model

    return str(build_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=1))


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tmp_path_factory) -> str:
    from fsdp_rlhf.testing.tiny import build_model

    path = tmp_path_factory.mktemp("tiny_qwen2_tied")
    return str(build_model(path, "qwen2", tie_word_embeddings=True, seed=2))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _environment():
    """Each test leaves the process environment as it found it. An in-process vLLM engine sets
    variables for its workers (LD_PRELOAD with libgomp and tcmalloc, VLLM_*, inductor's): left
    set, every later case launched from this process would inherit them (CI runs all suites in
    one process), and differ from the warm launcher's server, so run without it."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


_SECONDS: dict[str, list] = {}


def pytest_runtest_logreport(report):
    """Seconds per suite (setup + call + teardown of its tests) for the table at the end."""
    suite = _SUITE_OF.get(report.nodeid)
    if suite is None:
        return
    row = _SECONDS.setdefault(suite, [0, 0, 0, 0, 0.0])  # tests, passed, failed, skipped, s
    row[4] += report.duration
    if report.when == "setup":
        row[0] += 1
    if report.when == "call" or (report.when == "setup" and not report.passed):
        row[1 if report.passed else 3 if report.skipped else 2] += 1


_SUITE_OF: dict[str, str] = {}


def pytest_sessionfinish(session, exitstatus):
    """A suite may be empty today (pairs: the plan's one job is featured): not a failure."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.getoption("--suites"):
        session.exitstatus = pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter, config):
    write = terminalreporter.write_line
    if warm_launch.FALLBACKS:
        write("")
        write(f"warm launcher: {len(warm_launch.FALLBACKS)} case(s) ran without it:")
        for line in warm_launch.FALLBACKS:
            write(f"  {line}")
    if not config.getoption("--suites") or not _SECONDS:
        return
    write("")
    write("seconds per suite (setup + call + teardown of its tests, tests/suites.py):")
    write(f"{'suite':<14}{'tests':>7}{'passed':>8}{'failed':>8}{'skipped':>9}{'seconds':>10}")
    total = 0.0
    for suite in suites.SUITES:
        if suite in _SECONDS:
            n, ok, bad, skip, sec = _SECONDS[suite]
            total += sec
            write(f"{suite:<14}{n:>7}{ok:>8}{bad:>8}{skip:>9}{sec:>10.0f}")
    write(f"{'all tests':<14}{'':>32}{total:>10.0f}")
    if "collected" in _CLOCK:
        import time

        write(f"{'collection':<14}{'':>32}{_CLOCK['collected'] - _CLOCK['start']:>10.0f}")
        write(f"{'wall':<14}{'':>32}{time.monotonic() - _CLOCK['start']:>10.0f}")
