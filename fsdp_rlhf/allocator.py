"""Host memory allocator of CPU runs: tcmalloc preloaded by default, found where installed.

Why it matters: PyTorch's CPU tensors come straight from malloc. glibc returns large freed blocks
to the kernel, so every training step page-faults its activation and gradient buffers in again;
tcmalloc keeps them, and the faults and the time they cost mostly go away (measured in
benchmarks/grpo_rm_vs_trl_intel-xeon-amx-2core_2026-11-22.md). vLLM's CPU backend asks for
tcmalloc in ``LD_PRELOAD`` for the same reason.

``LD_PRELOAD`` acts only when a process starts, so on a host without a GPU the CLI re-executes
itself once with tcmalloc preloaded (:func:`reexec_env`; same PID, so torchrun and schedulers
see nothing) and the start-up log says so. ``FSDP_RLHF_TCMALLOC=0`` keeps glibc malloc; without
an installed tcmalloc the run goes on with glibc and the log says what to install. To preload
by hand::

    LD_PRELOAD=$(python -m fsdp_rlhf.allocator) torchrun ... -m fsdp_rlhf.cli ppo ...

On GPUs the device memory has its own caching allocator and nothing is re-executed.
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
# "0": keep glibc malloc; "preloaded": set by the re-exec (it happens once).
SWITCH = "FSDP_RLHF_TCMALLOC"
# tcmalloc prints a line per allocation above 1 GiB by default: loading a large model on the
# host would flood the log.
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


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


def reexec_env(environ: dict[str, str], found: Path | None, has_gpu: bool) -> dict[str, str] | None:
    """The environment to re-execute this process with tcmalloc preloaded; None to go on.

    None on GPU hosts, when a fast allocator is already preloaded, when none is installed, when
    ``FSDP_RLHF_TCMALLOC=0``, and after the re-exec itself (never loops).
    """
    current = environ.get("LD_PRELOAD", "")
    if has_gpu or found is None or environ.get(SWITCH) in ("0", "preloaded"):
        return None
    if preloaded_allocator(current):
        return None
    return {**QUIET, **environ, "LD_PRELOAD": tcmalloc_preload(current, found), SWITCH: "preloaded"}


def gpu_visible() -> bool:
    """An NVIDIA device node exists (cheap: no CUDA initialisation before the re-exec)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def maybe_reexec() -> None:
    """Replace this process by itself with tcmalloc preloaded, when :func:`reexec_env` says so.

    Call it first thing in the console entry point only (never inside a test runner).
    """
    env = reexec_env(dict(os.environ), find_tcmalloc(), gpu_visible())
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def allocator_status(environ: dict[str, str] | None = None) -> str | None:
    """One line for the start-up log when the CLI preloaded tcmalloc itself; None otherwise."""
    environ = os.environ if environ is None else environ
    if environ.get(SWITCH) != "preloaded":
        return None
    lib = preloaded_allocator(environ.get("LD_PRELOAD", ""))
    return f"host allocator: {lib} preloaded by fsdp-rlhf ({SWITCH}=0 keeps glibc malloc)"


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
    if os.environ.get(SWITCH) == "0":
        how = f"{SWITCH}=0 is set; unset it to preload tcmalloc"
    elif found:
        how = f"start with LD_PRELOAD={found}"
    else:
        how = "install tcmalloc (Debian/Ubuntu: libtcmalloc-minimal4) and it is used by default"
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
