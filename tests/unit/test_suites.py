"""Every test belongs to exactly one suite (tests/suites.py), the Makefile's targets select by
it, and .ci/run's one pytest process runs every CI suite."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tests import suites

REPO = Path(__file__).resolve().parents[2]


def test_featured_cases_belong_to_make_test_and_nowhere_else():
    assert suites.suite_of("e2e", ["featured", "sp", "slow"]) == "test"
    assert suites.suite_of("distributed", ["featured", "ep"]) == "test"
    assert suites.suite_of("e2e", ["sp"]) == "sp"
    assert suites.suite_of("e2e", ["asynchronous", "sp"]) == "async"  # once, not in both
    assert suites.suite_of("e2e", ["asynchronous", "async_resume_full"]) == "async-resume"
    assert suites.suite_of("vlm", ["vlm", "long"]) == "long"
    assert suites.suite_of("models", []) == "models"
    assert suites.suite_of("models", ["models_full"]) == "models-full"
    assert suites.suite_of("cluster", ["slow"]) == "cluster"
    assert suites.suite_of("unit", []) == "test"


def test_every_marker_of_a_suite_is_declared():
    declared = {
        line.split(":")[0].strip().strip('"')
        for line in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
            "ini_options"
        ]["markers"]
    }
    assert {marker for marker, _ in suites._BY_MARKER} <= declared


def test_the_suites_option_parses_and_refuses_unknown_names():
    assert suites.parse("test") == ["test"]
    assert suites.parse("ci cluster") == [*suites.CI, "cluster"]
    assert suites.parse("test,async test") == ["test", "async"]
    with pytest.raises(ValueError, match="unknown suite 'tests'"):
        suites.parse("tests")


def test_the_makefile_and_ci_name_only_known_suites_and_ci_leaves_none_out():
    makefile = (REPO / "Makefile").read_text()
    named = re.findall(r'--suites "?([a-z\- $()A-Z]+?)"?$', makefile, flags=re.M)
    assert named, "no target selects by suite"
    for value in named:
        if "$(SUITES)" not in value:
            suites.parse(value)
    ci = (REPO / ".ci" / "run").read_text()
    assert 'make test SUITES="ci $cluster"' in ci and "make test-gpu" in ci
    # what CI runs: the CI list, the cluster (when root can) and the GPU suite in its own run;
    # the rest is named here with the reason it is not in CI
    not_in_ci = {"async-resume", "models-full", "long"}
    assert set(suites.SUITES) == set(suites.CI) | {"cluster", "gpu"} | not_in_ci


def test_the_two_workers_keep_shared_fixtures_and_the_cluster_on_one_worker():
    """tests/conftest.py's work units: every test that runs alone (the cluster, the bench, the
    modules marked exclusive) in one unit, a module with a module- or class-scoped fixture on
    one worker (its fixture once), other tests by themselves; no conftest holds such a fixture
    (a unit is a module, not a folder), and the exclusive marker marks whole modules (the
    scheduler reads it from their text)."""
    from tests import conftest

    alone = conftest.ALONE_UNIT
    assert conftest._work_unit("tests/cluster/test_slurm.py::test_x") == alone
    assert conftest._work_unit("tests/cluster/test_async.py::test_y") == alone
    assert conftest._work_unit("tests/bench/test_bench_smoke.py::test_w") == alone
    assert conftest._work_unit("tests/unit/test_heartbeat.py::test_z") == alone
    shared = "tests/e2e/test_pairs.py"
    assert conftest._shares_fixtures(shared)
    assert conftest._work_unit(f"{shared}::test_w") == shared
    lone = "tests/unit/test_suites.py::test_the_suites_option_parses_and_refuses_unknown_names"
    assert conftest._work_unit(lone) == lone
    marker = "mark." + "exclusive"  # not this file's own text
    marked = 0
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        # the marker only as the module's whole pytestmark: no decorator, no list
        assert text.count(marker) == text.count(conftest._EXCLUSIVE_MODULE), path
        if conftest._EXCLUSIVE_MODULE in text:
            marked += 1
            assert conftest._work_unit(f"{path.relative_to(REPO)}::t") == alone, path
    assert marked >= 5
    for path in (REPO / "tests").rglob("conftest.py"):
        text = path.read_text()
        for scope in ("module", "class", "package"):
            assert f'scope="{scope}"' not in text, (path, scope)
