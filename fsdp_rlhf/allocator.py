"""Host memory allocator of CPU runs: is tcmalloc (or jemalloc) preloaded, and where is one.

Why it matters: PyTorch's CPU tensors come straight from malloc. glibc returns large freed blocks
to the kernel, so every training step page-faults its activation and gradient buffers in again.
Measured on the 2-core bench machine (GRPO step of the 34M-parameter bench model): 56-84k minor
page faults per actor update with glibc against 1-4k with tcmalloc, and the update went from
2.7-3.1 s to 2.3-2.5 s. vLLM's CPU backend asks for tcmalloc in ``LD_PRELOAD`` for the same reason.
``LD_PRELOAD`` acts only when a process starts, so the trainer cannot switch allocator itself: it
says so once at start-up and the launcher sets the variable::

    LD_PRELOAD=$(python -m fsdp_rlhf.allocator) torchrun ... -m fsdp_rlhf.cli ppo ...

On GPUs the device memory has its own caching allocator and this does not apply.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

FAST_ALLOCATORS = ("libtcmalloc", "libjemalloc")
# Debian/Ubuntu (libtcmalloc-minimal4), RHEL/Fedora (gperftools-libs), conda and /usr/local.
SEARCH_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    str(Path(sys.prefix) / "lib"),
)
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")


def _entries(ld_preload: str) -> list[str]:
    """The libraries of an ``LD_PRELOAD`` value (the loader takes colons or spaces)."""
    return [e for e in ld_preload.replace(" ", ":").split(":") if e]


def _fast_allocator(entry: str) -> str | None:
    name = Path(entry).name
    return next((lib for lib in FAST_ALLOCATORS if name.startswith(lib)), None)


def preloaded_allocator(ld_preload: str) -> str | None:
    """The fast allocator named in an ``LD_PRELOAD`` value (``"libtcmalloc"``...), else None."""
    return next(filter(None, map(_fast_allocator, _entries(ld_preload))), None)


def without_fast_allocators(ld_preload: str) -> str:
    """``ld_preload`` with tcmalloc/jemalloc taken out (colon-separated)."""
    return ":".join(e for e in _entries(ld_preload) if not _fast_allocator(e))


def find_tcmalloc(dirs: Sequence[str] = SEARCH_DIRS) -> Path | None:
    """The first tcmalloc shared library in ``dirs``, or None."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            path = Path(d) / name
            if path.is_file():
                return path
    return None


def tcmalloc_preload(ld_preload: str, found: Path | None) -> str:
    """``ld_preload`` with ``found`` (a tcmalloc) put first, unless a fast allocator is already
    there or none was found."""
    if found is None or preloaded_allocator(ld_preload):
        return ld_preload
    return f"{found}:{ld_preload}" if ld_preload else str(found)


def allocator_hint(
    device_type: str, ld_preload: str | None = None, found: Path | None = None
) -> str | None:
    """One line for the start-up log when a CPU run uses glibc malloc; None otherwise.

    ``ld_preload`` defaults to this process's ``LD_PRELOAD``, ``found`` to :func:`find_tcmalloc`.
    """
    if device_type != "cpu":
        return None
    if preloaded_allocator(os.environ.get("LD_PRELOAD", "") if ld_preload is None else ld_preload):
        return None
    found = found or find_tcmalloc()
    how = (
        f"start with LD_PRELOAD={found}"
        if found
        else "install tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4) and put it in LD_PRELOAD"
    )
    return (
        "CPU run with glibc malloc: each step page-faults its buffers in again (9-12% of a GRPO "
        f"step on the bench); {how}"
    )


def main() -> int:
    """Print the tcmalloc path (for ``LD_PRELOAD=$(python -m fsdp_rlhf.allocator)``)."""
    found = find_tcmalloc()
    if found is None:
        print("no tcmalloc found in " + ", ".join(SEARCH_DIRS), file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
