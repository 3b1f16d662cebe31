"""What the machine has: versions, and the carried ``datasets`` wheel's requirements."""

from __future__ import annotations

import torch

from tests.gpu.suite import HAVE, unmet_requirements


def test_versions(detail):
    from fsdp_rlhf.doctor import versions

    v = versions()
    detail(", ".join(f"{k} {x}" for k, x in v.items()))
    if HAVE["cuda"]:
        props = torch.cuda.get_device_properties(0)
        detail(f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert (major, minor) >= (2, 11), v  # the oldest torch the package supports


def test_datasets_requirements_are_met(detail):
    """``datasets`` travels as a wheel (docs/gpu.md): its pins, and its requirements' pins,
    against what this machine has (pyarrow, fsspec, pandas...), before it is imported."""
    from importlib import metadata

    bad = unmet_requirements("datasets")
    assert not bad, "unmet: " + "; ".join(bad)
    import datasets  # noqa: F401 - the data loaders import it where used

    have = {n: metadata.version(n) for n in ("datasets", "pyarrow", "fsspec", "pandas")}
    detail("requirements met: " + ", ".join(f"{k} {v}" for k, v in have.items()))
