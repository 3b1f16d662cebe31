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
            _carry_over(final, tmp)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".index.json", ".model", ".tiktoken")
_MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
}


def _is_model_file(name: str) -> bool:
    return (
        name in _MODEL_FILES or name.startswith("tokenizer") or name.endswith(_MODEL_FILE_SUFFIXES)
    )


def _carry_over(old: Path, new: Path) -> None:
    """Move what else lives in the old folder (logs, checkpoints, TensorBoard) into the new one,
    so replacing the model never deletes a run's history; stale weight files stay behind."""
    for entry in old.iterdir():
        if not _is_model_file(entry.name) and not (new / entry.name).exists():
            entry.rename(new / entry.name)
