"""The GPU suite prints one line per check as it finishes: PASS, FAIL or SKIP, with what it
measured, why it failed or what it needs (docs/gpu.md), then the counts. Checks that would start
after ``FSDP_RLHF_GPU_SUITE_BUDGET_S`` seconds (default 540) SKIP, so that one command stays
under the 10 minutes a borrowed GPU gives it and its report is never cut off."""

from __future__ import annotations

import os
import time

import pytest

_DETAILS: dict[str, list[str]] = {}
_COUNTS = {"PASS": 0, "FAIL": 0, "SKIP": 0}
_CONFIG = []


def _budget_s() -> float:
    return float(os.environ.get("FSDP_RLHF_GPU_SUITE_BUDGET_S", "540"))


def pytest_configure(config) -> None:
    _CONFIG.append(config)


def pytest_runtest_setup(item) -> None:
    from tests.gpu.suite import SUITE_START

    spent = time.monotonic() - SUITE_START
    if spent > _budget_s():
        pytest.skip(f"the suite's time budget ({_budget_s():.0f} s) is spent: run it alone")


@pytest.fixture(scope="session")
def big_model(tmp_path_factory) -> str:
    """The 1.5 B model (``suite.build_big_model``), built once for the checks that use it."""
    from tests.gpu.suite import HAVE, build_big_model

    if not HAVE["cuda"]:
        pytest.skip("needs CUDA")
    return build_big_model(tmp_path_factory.mktemp("big") / "model")


@pytest.fixture
def detail(request):
    """``detail(line)``: printed under the check's PASS or FAIL line."""
    return _DETAILS.setdefault(request.node.nodeid, []).append


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return report.longrepr[2].removeprefix("Skipped: ")
    if report.failed:
        text = str(report.longrepr).strip().splitlines()
        errors = [x for x in text if x.startswith("E ")]
        return (errors[0][1:].strip() if errors else text[-1])[:400]
    return ""


def _write(line: str) -> None:
    plugins = _CONFIG[0].pluginmanager if _CONFIG else None
    terminal = plugins.get_plugin("terminalreporter") if plugins else None
    if terminal is None:
        print(line, flush=True)
        return
    if getattr(terminal._tw, "width_of_current_line", 0):  # after pytest's progress dots
        terminal._tw.line()
    terminal.write_line(line)


@pytest.hookimpl(trylast=True)  # after pytest's own progress output
def pytest_runtest_logreport(report) -> None:
    if not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    name = report.nodeid.split("::", 1)[-1]
    mark = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[report.outcome]
    _COUNTS[mark] += 1
    seconds = f" ({report.duration:.1f}s)" if report.when == "call" else ""
    reason = _reason(report)
    _write(f"{mark} {name}{seconds}" + (f": {reason}" if reason else ""))
    for line in _DETAILS.get(report.nodeid, []):
        for part in line.split("\n"):
            _write(f"    {part}")


def pytest_terminal_summary(terminalreporter) -> None:
    if not any(_COUNTS.values()):
        return
    from tests.gpu.suite import HAVE, SUITE_START, WORLD

    have = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in HAVE.items())
    elapsed = time.monotonic() - SUITE_START
    terminalreporter.write_line(
        f"gpu suite ({have}; {WORLD} rank(s)): {_COUNTS['PASS']} passed, {_COUNTS['FAIL']} "
        f"failed, {_COUNTS['SKIP']} skipped in {elapsed:.0f}s"
    )
