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
