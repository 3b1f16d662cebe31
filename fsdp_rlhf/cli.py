"""`fsdp-rlhf`: the command line. Run every subcommand (the table in
:mod:`fsdp_rlhf.commands`) under torchrun, on every rank::

    torchrun --nproc_per_node 8 -m fsdp_rlhf.cli sft --pretrain ... --dataset ...
    torchrun --nproc_per_node 8 -m fsdp_rlhf.cli ppo --pretrain ... --reward_pretrain ...

Flags are the OpenRLHF / AIAK-RLHF names (underscores or dashes), after an optional
``--config x.yaml``: defaults < YAML < flags. ``--local_rank`` from torch.distributed.launch is
ignored. Bad input prints one line and exits 2, a fault (full disk, unreachable reward server)
one line and exits 1, whichever rank finds it (a traceback only with ``--debug``; see
fsdp_rlhf.distributed.exit_report).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING

from fsdp_rlhf.allocator import maybe_reexec
from fsdp_rlhf.commands import BY_NAME, COMMANDS, Command
from fsdp_rlhf.errors import Fault, UserError, exception_line

if TYPE_CHECKING:
    import typer

    from fsdp_rlhf.distributed.exit_report import Failure

# typer (half of this module's import time) is imported only once the process is past its
# tcmalloc re-exec (main), so the process that re-executes itself does not pay for it:
# benchmarks/2026-11-27-make-test-startup.md.


@functools.cache
def build_app() -> typer.Typer:
    """The `fsdp-rlhf` typer app: one subcommand per row of the command table."""
    import typer

    app = typer.Typer(
        add_completion=False,
        no_args_is_help=True,
        help="Pure-PyTorch RLHF on FSDP2: SFT, reward models, DPO and colocated PPO (no Ray).",
    )
    for command in COMMANDS:
        _register(app, command)
    return app


def __getattr__(name: str):
    """``from fsdp_rlhf.cli import app`` (tests invoke it with typer's runner)."""
    if name == "app":
        return build_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Flags are parsed by fsdp_rlhf.config_base against the config tree, not by click, so that
# every OpenRLHF spelling works and YAML/flag precedence lives in one place.
_RAW = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _translate(command: str, argv: list[str]) -> list[str]:
    """OpenRLHF spellings -> canonical flags; rank 0 prints what each became, once, with the
    other start-up information (stdout; stderr is for errors)."""
    from fsdp_rlhf.compat import translate

    translation = translate(command, argv)
    if translation.notes and os.environ.get("RANK", "0") == "0":
        for note in translation.notes:
            print(f"openrlhf flag: {note}", flush=True)
    return translation.argv


def _run(argv: list[str], command: Command) -> None:
    """Parse ``argv`` into the command's config and run its module's ``main`` on it (both
    imported only now: ``--help`` stays fast); every failure ends in the job's error report."""
    import typer

    config_cls = command.config_class()
    if "--help" in argv or "-h" in argv:
        from fsdp_rlhf.flag_help import render_help

        title = f"fsdp-rlhf {command.name} flags"
        if command.flags_of:
            title += f" (same as {command.flags_of})"
        sys.stdout.write(render_help(config_cls, command.name, title))
        raise typer.Exit(0)
    debug = "--debug" in argv
    try:
        from fsdp_rlhf.config_base import build_config

        cfg, debug = build_config(config_cls, _translate(command.name, argv))
        code = importlib.import_module(command.module).main(cfg, debug=debug) or 0
        failure = None
    except Exception as e:  # noqa: BLE001 - every failure ends in the job's error report
        failure = describe_failure(e, debug)
        code = failure.code
    if code:
        from fsdp_rlhf.distributed.exit_report import Failure, report

        # every rank, also one that has nothing to say: none may leave (and have torchrun
        # stop the others) before each rank's line and rank 0's report are printed
        report(failure or Failure(code))
    raise typer.Exit(code)


def _raised_class(module: str, name: str) -> type | None:
    """``module.name`` when ``module`` is imported, else None. An exception of that class can only
    have been raised once its module was imported, so ruling it out needs no import: a bad flag's
    report does not import torch (which the modules of the peer failures import)."""
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None


def describe_failure(e: Exception, debug: bool) -> Failure:
    """The line (and exit code) a failure is reported with. Bad input and faults are one line
    (and the user's own frames), their traceback only with ``--debug``; anything else is
    unexpected and shows its traceback, unless another rank failed first (then it is most
    likely a collective that rank broke)."""
    from fsdp_rlhf.distributed.exit_report import Failure, first_to_fail

    peer_lost = _raised_class("fsdp_rlhf.distributed.bridge", "PeerLost")
    peer_failure = _raised_class("fsdp_rlhf.distributed.env", "PeerFailure")
    if peer_lost is not None and isinstance(e, peer_lost) and not first_to_fail():
        return Failure(1, str(e), secondary=True)  # the peer failed first and says why
    if peer_failure is not None and isinstance(e, peer_failure):
        if debug:
            traceback.print_exc()
        return Failure(1, str(e), secondary=True)
    if isinstance(e, UserError | Fault):
        if debug:
            traceback.print_exc()
        detail = getattr(e, "detail", "")
        return Failure(e.exit_code, str(e) + (f"\n{detail}" if detail else ""))
    line = exception_line(e)
    if not first_to_fail():  # e.g. a collective broken by the rank that failed first
        if debug:
            traceback.print_exc()
        return Failure(1, f"stopped after another rank failed ({line})", secondary=True)
    traceback.print_exc()
    return Failure(1, f"{line} (unexpected: the traceback above shows where)")


def _register(app: typer.Typer, command: Command) -> None:
    import typer

    def run(ctx) -> None:
        _run(list(ctx.args), command)

    # the class itself, not the string annotation: typer finds the context parameter by its
    # type, and this module has no global ``typer`` to resolve a string against
    run.__annotations__ = {"ctx": typer.Context, "return": None}
    run.__doc__ = f"{command.summary} --help lists every flag."
    app.command(command.name, context_settings=_RAW)(run)


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop ``--local-rank=N``: ``python -m torch.distributed.launch`` (without --use-env) puts
    it right after ``-m fsdp_rlhf.cli``, before the subcommand, where typer would reject it.
    The rank comes from the LOCAL_RANK environment variable instead."""
    return [a for a in argv if not a.startswith(("--local-rank=", "--local_rank="))]


def quiet_libraries() -> None:
    """Library progress bars and load reports drown the trainer's own log; users can still
    turn them back on by setting these variables themselves."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def wants_fast_allocator(argv: list[str]) -> bool:
    """Every command trains or loads models: worth a process restart for tcmalloc (not for
    ``--help``)."""
    return bool(argv) and argv[0] in BY_NAME and not {"--help", "-h"} & set(argv)


def end_without_teardown(code: int) -> None:
    """Flush the log and leave with ``code``, skipping interpreter teardown.

    Everything a run writes is closed by then (metrics, TensorBoard, checkpoints, the export;
    the process group is destroyed). The teardown itself, destroying the C++ threads of gloo,
    vLLM and inductor in no set order, sometimes aborts on CPU hosts ("terminate called without
    an active exception", exit -6 after a finished run: 1 of 4 bench smokes here), and a
    launcher would count that job as failed.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    quiet_libraries()
    sys.argv[1:] = strip_launcher_args(sys.argv[1:])
    runs = wants_fast_allocator(sys.argv[1:])
    if runs:
        maybe_reexec()  # CPU hosts: once, with tcmalloc preloaded (see fsdp_rlhf.allocator)
    try:
        build_app()()
    except SystemExit as done:
        if runs:
            code = done.code
            end_without_teardown(code if isinstance(code, int) else int(code is not None))
        raise


if __name__ == "__main__":
    main()
