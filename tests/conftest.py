"""Shared fixtures: tiny local models (no downloads), seeded RNG, CUDA skip marker."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from contextlib import ExitStack, contextmanager
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
# Two pytest-xdist workers (make's TEST_JOBS, default 2) fill each other's idle time: a 2-rank
# run keeps 2 cores busy only part of the time (rank 0 loads while rank 1 waits, collectives,
# start-up). A test whose assertions read a clock, and the multi-host and bench runs, must not
# share the cores: they run alone (the `exclusive` marker; the folders below), the other
# worker waiting between its tests (_alone).
_ALONE_FOLDERS = ("cluster", "bench")
_LOCK_DIR = "FSDP_RLHF_TEST_LOCK_DIR"


def _in_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if not _in_worker(config) and getattr(config.option, "numprocesses", None):
        # the workers inherit the controller's environment: one lock folder for the run
        os.environ[_LOCK_DIR] = tempfile.mkdtemp(prefix="fsdp_rlhf_test_locks_")


def pytest_unconfigure(config):
    folder = os.environ.get(_LOCK_DIR)
    if folder and not _in_worker(config):
        shutil.rmtree(folder, ignore_errors=True)


def pytest_sessionstart(session):
    _CLOCK["start"] = time.monotonic()


def pytest_collection_finish(session):
    _CLOCK["collected"] = time.monotonic()
    if warm_launch.mode() != "warm":
        return
    if any(_folder(item) in _LAUNCHING for item in session.items):
        warm_launch.start_server(REPO)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The controller's collection line: when the first worker has collected."""
    _CLOCK.setdefault("collected", time.monotonic())


def _module_text(path: str) -> str:
    """The source of the test module at ``path`` (relative to the repo; "" if none)."""
    if path not in _TEXTS:
        _TEXTS[path] = (REPO / path).read_text() if (REPO / path).is_file() else ""
    return _TEXTS[path]


_TEXTS: dict[str, str] = {}
_EXCLUSIVE_MODULE = "pytestmark = pytest.mark.exclusive"
ALONE_UNIT = "tests run alone"


def _shares_fixtures(path: str) -> bool:
    """Whether the test module at ``path`` holds a module- or class-scoped fixture (no
    conftest here holds one: tests/unit/test_suites.py checks)."""
    return any(f'scope="{s}"' in _module_text(path) for s in ("module", "class", "package"))


def _work_unit(nodeid: str) -> str:
    """The tests one worker runs together: every test that runs alone (the multi-host tests,
    one cluster of network-namespace hosts and one Slurm per run; the bench; the modules
    marked ``exclusive``), one after another under one hold of the lock; every test of a
    module that shares a module- or class-scoped fixture (a run asserted many times); else
    the test by itself. The scheduler sees node ids, not items: the ``exclusive`` marker
    counts here on a whole module (``pytestmark``), as every use of it is
    (tests/unit/test_suites.py checks)."""
    path = nodeid.split("::")[0]
    folder = path.split("/")[1] if path.count("/") >= 2 else ""
    if folder in _ALONE_FOLDERS or _EXCLUSIVE_MODULE in _module_text(path):
        return ALONE_UNIT
    return path if _shares_fixtures(path) else nodeid


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-by-scope scheduling over :func:`_work_unit`'s units (the largest first).
    xdist's own ``loadgroup`` marks a test's group on its node id, which pytest 9.2's items
    no longer take."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return ByWorkUnit(config, log)


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
    for item in items:
        item.user_properties.append(("suite", _suite(item)))  # the controller's table reads it
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


def _alone(item) -> bool:
    """Whether the test runs alone: the scheduler's rule (:func:`_work_unit`), so the lock and
    the work units cannot disagree."""
    return _work_unit(item.nodeid) == ALONE_UNIT


@contextmanager
def _flock(path: str, how: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextmanager
def _turn(folder: str, alone: bool):
    """A readers-writer lock over the workers: a test that runs alone holds ``run`` exclusively;
    the others share it. ``gate`` gives a waiting lone test priority: it holds the gate while it
    waits and runs, and a shared taker passes the gate before taking ``run``."""
    gate, run = os.path.join(folder, "gate"), os.path.join(folder, "run")
    if alone:
        with _flock(gate, fcntl.LOCK_EX), _flock(run, fcntl.LOCK_EX):
            yield
        return
    with _flock(gate, fcntl.LOCK_EX):
        pass
    with _flock(run, fcntl.LOCK_SH):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown (module fixtures included) under the workers' lock; a lone
    test followed by another keeps the lock for it (the other worker, once it waited for its
    current test to end, waits once, not once per lone test)."""
    folder = os.environ.get(_LOCK_DIR)
    if not folder or not _in_worker(item.config):
        yield
        return
    alone = _alone(item)
    if not _HELD:  # else the lone test before this one kept the lock for it
        turn = ExitStack()
        turn.enter_context(_turn(folder, alone))
        _HELD.append(turn)
    try:
        yield
    finally:
        if not (alone and nextitem is not None and _alone(nextitem)):
            _HELD.pop().close()


_HELD: list[ExitStack] = []  # this worker's turn at the lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The cases the warm launcher passed to torchrun during this test travel with its last
    report (a worker's list is not the controller's)."""
    outcome = yield
    if call.when == "teardown":
        report = outcome.get_result()
        new = warm_launch.FALLBACKS[_SENT[0] :]
        _SENT[0] = len(warm_launch.FALLBACKS)
        report.user_properties.extend(("warm_fallback", line) for line in new)


_SENT = [0]  # of warm_launch.FALLBACKS, in this process


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
_FALLBACKS: list[str] = []  # the run's, from every worker's reports


def pytest_runtest_logreport(report):
    """Seconds per suite (setup + call + teardown of its tests) for the table at the end."""
    props = report.user_properties
    _FALLBACKS.extend(v for k, v in props if k == "warm_fallback" and report.when == "teardown")
    suite = next((v for k, v in props if k == "suite"), None)
    if suite is None:
        return
    row = _SECONDS.setdefault(suite, [0, 0, 0, 0, 0.0])  # tests, passed, failed, skipped, s
    row[4] += report.duration
    if report.when == "setup":
        row[0] += 1
    if report.when == "call" or (report.when == "setup" and not report.passed):
        row[1 if report.passed else 3 if report.skipped else 2] += 1


def pytest_sessionfinish(session, exitstatus):
    """A suite may be empty today (pairs: the plan's one job is featured): not a failure."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.config.getoption("--suites"):
        session.exitstatus = pytest.ExitCode.OK


def pytest_terminal_summary(terminalreporter, config):
    write = terminalreporter.write_line
    if _FALLBACKS:
        write("")
        write(f"warm launcher: {len(_FALLBACKS)} case(s) ran without it:")
        for line in _FALLBACKS:
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
        write(f"{'collection':<14}{'':>32}{_CLOCK['collected'] - _CLOCK['start']:>10.0f}")
        write(f"{'wall':<14}{'':>32}{time.monotonic() - _CLOCK['start']:>10.0f}")
