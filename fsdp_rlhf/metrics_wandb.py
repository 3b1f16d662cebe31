"""Weights & Biases beside TensorBoard and ``metrics.jsonl`` (rank 0, ``--use_wandb``).

Training must never wait on W&B. Without an API key, or when W&B's server cannot be reached
(air-gapped clusters), the run is recorded offline under ``<save_path>/wandb/`` and one warning
line says why, where the run is and how to upload it (``wandb sync``). With a key, a TCP probe of
the server (a few seconds) comes first, and the online start is bounded by
:data:`INIT_TIMEOUT_S`; an online start that fails falls back to offline the same way.

The key is never written or printed: it reaches wandb as a setting, not through ``wandb.login``
(which stores it in ``~/.netrc``), W&B's system metadata (it records the command line, where the
key may be) is off, and the run config is the redacted one of ``config.yaml``. Console capture is
off too: the console is rank 0's log, already in the job's output.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
import socket
import threading
import urllib.parse
from datetime import datetime
from pathlib import Path
from typing import Any

from fsdp_rlhf.config import LoggingConfig
from fsdp_rlhf.errors import UserError

log = logging.getLogger("fsdp_rlhf")

INIT_TIMEOUT_S = 60.0  # an online wandb.init retries for 90 s by default, then fails
PROBE_TIMEOUT_S = 5.0  # DNS + TCP connect to the server
TRUE_WORDS = ("true", "1", "yes", "on")  # --use_wandb True: a key from the environment


def check_wandb(cfg: LoggingConfig) -> None:
    """Before any heavy work: ``--use_wandb`` needs the wandb package."""
    if cfg.wandb_enabled and importlib.util.find_spec("wandb") is None:
        raise UserError(
            "--use_wandb: the wandb package is not installed; pip install 'fsdp-rlhf[wandb]' "
            "(or wandb), or drop the flag"
        )


def explicit_key(use_wandb: str) -> str | None:
    """The API key given to ``--use_wandb``, or None for ``True`` (key from the environment)."""
    return None if use_wandb.strip().lower() in TRUE_WORDS else use_wandb.strip()


def server_url() -> str:
    """W&B's server: ``WANDB_BASE_URL`` or the library's default."""
    import wandb

    return os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url


def stored_credentials(url: str) -> bool:
    """Whether wandb will find a key without the flag: ``WANDB_API_KEY``, an identity token,
    or a ``~/.netrc`` entry for the server (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def unreachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``url``'s host cannot be reached within ``timeout_s`` (DNS and TCP), or None.

    The lookup runs in a daemon thread: ``getaddrinfo`` itself has no timeout.
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout_s + 1.0)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:g} s"
    return outcome[0]


class WandbRun:
    """One W&B run on rank 0: metrics by step, sample tables, and where an offline run is."""

    def __init__(self, run, offline_dir: Path | None) -> None:
        self.run, self.offline_dir = run, offline_dir

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def table(self, tag: str, rows: list[dict[str, Any]], step: int) -> None:
        import wandb

        if not rows:
            return
        columns = list(rows[0])
        data = [[row.get(c) for c in columns] for row in rows]
        self.run.log({tag: wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, exit_code: int = 0) -> None:
        import wandb

        self.run.finish(exit_code=exit_code)
        # finish() can return before wandb's service has written the run file (offline runs
        # measured empty right after it); teardown waits for the service to flush and stop
        wandb.teardown()
        if self.offline_dir is not None:
            where = self.offline_dir
            log.info("W&B offline run: %s (upload: wandb sync %s)", where, where)


def _settings(key: str | None, timeout_s: float):
    import wandb

    return wandb.Settings(
        api_key=key,
        init_timeout=timeout_s,
        x_disable_meta=True,  # the metadata holds sys.argv, which may hold the key
        console="off",
        silent=True,
        save_code=False,
        disable_git=True,
    )


def open_wandb(
    cfg: LoggingConfig, command: str, run_config: dict[str, Any], root: str | Path
) -> WandbRun | None:
    """Start the run under ``root`` (``WANDB_DIR`` wins). None when ``WANDB_MODE=disabled``.

    ``command`` names the defaults: project ``openrlhf_train_<command>`` and run name
    ``<command>_<MMDD>T<HH:MM>`` (OpenRLHF's, so a migrated job logs where it did before).
    """
    import wandb

    env_mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if env_mode == "disabled":
        log.info("W&B: WANDB_MODE=disabled, not logging to W&B")
        return None
    directory = Path(os.environ.get("WANDB_DIR") or root)
    directory.mkdir(parents=True, exist_ok=True)
    init = {
        "entity": cfg.wandb_org,
        "project": cfg.wandb_project or f"openrlhf_train_{command}",
        "group": cfg.wandb_group,
        "name": cfg.wandb_run_name or f"{command}_{datetime.now():%m%dT%H:%M}",
        "config": run_config,
        "dir": str(directory),
    }
    key = explicit_key(cfg.use_wandb)
    url = server_url()
    why_offline = None
    if env_mode in ("offline", "dryrun"):
        why_offline = f"WANDB_MODE={env_mode}"
    elif key is None and not stored_credentials(url):
        why_offline = "no API key: pass --use_wandb KEY, set WANDB_API_KEY or run `wandb login`"
    elif (problem := unreachable(url)) is not None:
        why_offline = f"{url} is unreachable ({problem})"
    if why_offline is None:
        try:
            run = wandb.init(mode="online", settings=_settings(key, INIT_TIMEOUT_S), **init)
            log.info("W&B: run %s", run.url or run.name)
            return WandbRun(run, None)
        except Exception as e:  # noqa: BLE001 - any failure to go online means: go offline
            # the message names the server and the timeout, never the key
            why_offline = f"the online start failed ({type(e).__name__})"
    run = wandb.init(mode="offline", settings=_settings(None, INIT_TIMEOUT_S), **init)
    offline_dir = Path(run.dir).parent
    log.warning(
        "W&B: logging offline, %s; the run is saved in %s; upload it later with: wandb sync %s",
        why_offline,
        offline_dir,
        offline_dir,
    )
    return WandbRun(run, offline_dir)
