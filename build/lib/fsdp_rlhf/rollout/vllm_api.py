"""Checks that the vLLM internals the adapter calls still have the shape it was written for."""

from __future__ import annotations

import inspect

# "what": (class, attribute, parameter names the call passes by keyword)
Expected = dict[str, tuple[type, str, tuple[str, ...]]]


def signature_problems(expected: Expected) -> list[str]:
    """One line per attribute that is gone or lost a parameter (empty when all are as expected).

    Looked up statically, so nothing is imported or bound; classmethods are unwrapped."""
    problems = []
    for what, (cls, name, params) in expected.items():
        fn = inspect.getattr_static(cls, name, None)
        if fn is None:
            problems.append(f"{what} is gone")
            continue
        fn = fn.__func__ if isinstance(fn, classmethod) else fn
        missing = set(params) - set(inspect.signature(fn).parameters)
        if missing:
            problems.append(f"{what} lost parameters {sorted(missing)}")
    return problems
