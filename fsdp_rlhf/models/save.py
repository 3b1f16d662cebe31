"""Export FSDP2 models as HF folders, atomically (temp folder, then rename)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdp_rlhf.distributed.env import barrier
from fsdp_rlhf.distributed.fsdp import gather_full_state_dict


def save_hf_model(
    model: nn.Module,
    tokenizer,
    save_path: str | Path,
    *,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Collective. Rank 0 writes ``save_path`` as a ``from_pretrained``-loadable folder.

    The folder appears complete or not at all: files go to ``<save_path>.tmp-<pid>`` first and
    an existing ``save_path`` is replaced only after everything is written.
    """
    state = gather_full_state_dict(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = Path(save_path)
    if rank == 0:
        import os

        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if extra_config:
            cfg_file = tmp / "config.json"
            cfg = json.loads(cfg_file.read_text())
            cfg.update(extra_config)
            cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def update_hf_config(save_path: str | Path, values: dict[str, Any]) -> None:
    """Rank 0 merges ``values`` into ``config.json`` (write to temp, then rename)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    cfg_file = Path(save_path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(values)
    tmp = cfg_file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tmp.replace(cfg_file)
