from pathlib import Path

import pytest

from fsdp_rlhf import allocator
from fsdp_rlhf.allocator import (
    allocator_hint,
    find_tcmalloc,
    preloaded_allocator,
    tcmalloc_preload,
    without_fast_allocators,
)


@pytest.mark.parametrize(
    ("ld_preload", "want"),
    [
        ("", None),
        ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "libtcmalloc"),
        ("/opt/a/libgomp.so.1:/opt/b/libjemalloc.so.2", "libjemalloc"),
        ("/opt/a/libgomp.so.1 /usr/lib64/libtcmalloc.so.4", "libtcmalloc"),
        ("/opt/a/libgomp.so.1", None),
        ("/opt/libtcmalloc_dir/libfoo.so", None),  # only the file name counts
    ],
)
def test_preloaded_allocator(ld_preload, want):
    assert preloaded_allocator(ld_preload) == want


def test_find_tcmalloc_takes_first_dir_and_preferred_name(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert find_tcmalloc([str(a), str(b)]) is None
    (b / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([str(a), str(b)]) == b / "libtcmalloc.so.4"
    (b / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc([str(a), str(b)]) == b / "libtcmalloc_minimal.so.4"
    (a / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([str(a), str(b)]) == a / "libtcmalloc.so.4"


def test_hint_only_for_cpu_runs_without_a_fast_allocator(tmp_path: Path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    assert allocator_hint("cuda", ld_preload="", found=lib) is None
    assert allocator_hint("cpu", ld_preload=str(lib), found=lib) is None
    hint = allocator_hint("cpu", ld_preload="", found=lib)
    assert f"LD_PRELOAD={lib}" in hint
    assert "\n" not in hint


def test_hint_says_what_to_install_when_none_is_found(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    hint = allocator_hint("cpu", ld_preload="/opt/a/libgomp.so.1")
    assert "libtcmalloc-minimal4" in hint


def test_main_prints_the_path_or_fails(monkeypatch, capsys, tmp_path: Path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: lib)
    assert allocator.main() == 0
    assert capsys.readouterr().out.strip() == str(lib)
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.main() == 1
    out = capsys.readouterr()
    assert out.out == "" and "no tcmalloc found" in out.err


def test_tcmalloc_preload_goes_first_once(tmp_path: Path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    assert tcmalloc_preload("", lib) == str(lib)
    assert tcmalloc_preload("/opt/libgomp.so.1", lib) == f"{lib}:/opt/libgomp.so.1"
    assert tcmalloc_preload("/opt/libjemalloc.so.2", lib) == "/opt/libjemalloc.so.2"
    assert tcmalloc_preload("/opt/libgomp.so.1", None) == "/opt/libgomp.so.1"


def test_without_fast_allocators_keeps_the_other_libraries():
    assert without_fast_allocators("") == ""
    assert without_fast_allocators("/usr/lib/libtcmalloc_minimal.so.4") == ""
    value = "/opt/a/libgomp.so.1:/x/libtcmalloc.so.4 /opt/b/libiomp5.so:/y/libjemalloc.so.2"
    assert without_fast_allocators(value) == "/opt/a/libgomp.so.1:/opt/b/libiomp5.so"


def test_reexec_env_only_once_only_on_cpu_hosts_with_tcmalloc(tmp_path: Path):
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    env = allocator.reexec_env({"LD_PRELOAD": "/opt/libgomp.so.1"}, lib, has_gpu=False)
    assert env["LD_PRELOAD"] == f"{lib}:/opt/libgomp.so.1"
    assert env[allocator.SWITCH] == "preloaded" and "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" in env
    assert allocator.reexec_env(env, lib, has_gpu=False) is None  # the re-executed process
    assert allocator.reexec_env({}, lib, has_gpu=True) is None
    assert allocator.reexec_env({}, None, has_gpu=False) is None
    assert allocator.reexec_env({allocator.SWITCH: "0"}, lib, has_gpu=False) is None
    jemalloc = {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}
    assert allocator.reexec_env(jemalloc, lib, has_gpu=False) is None
    # a user's own threshold wins
    mine = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}
    assert allocator.reexec_env(mine, lib, False)["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5"


def test_status_line_only_after_our_own_preload():
    env = {allocator.SWITCH: "preloaded", "LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}
    assert "libtcmalloc preloaded by fsdp-rlhf" in allocator.allocator_status(env)
    assert allocator.allocator_status({"LD_PRELOAD": env["LD_PRELOAD"]}) is None


def test_only_run_commands_restart():
    from fsdp_rlhf.cli import wants_fast_allocator

    assert wants_fast_allocator(["ppo", "--pretrain", "x"])
    assert wants_fast_allocator(["train-rm"]) and wants_fast_allocator(["doctor"])
    assert not wants_fast_allocator(["ppo", "--help"]) and not wants_fast_allocator([])
    assert not wants_fast_allocator(["--help"])


REEXEC_PROBE = (
    "from fsdp_rlhf.allocator import maybe_reexec; maybe_reexec(); import os; "
    "maps = open('/proc/self/maps').read(); "
    "print(os.environ.get('FSDP_RLHF_TCMALLOC'), 'libtcmalloc' in maps)"
)


@pytest.mark.skipif(
    find_tcmalloc() is None or allocator.gpu_visible(), reason="needs tcmalloc on a CPU host"
)
@pytest.mark.parametrize(("switch", "want"), [(None, "preloaded True"), ("0", "0 False")])
def test_a_real_process_restarts_itself_with_tcmalloc_mapped(switch, want):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.SWITCH)}
    if switch is not None:
        env[allocator.SWITCH] = switch
    out = subprocess.run(
        [sys.executable, "-c", REEXEC_PROBE], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == want, out.stderr
