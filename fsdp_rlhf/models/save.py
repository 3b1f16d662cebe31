"""Export FSDP2 models as HF folders, atomically (temp folder, then rename).

Rank 0 writes ``<save_path>.tmp-<pid>``, moves the old folder aside as ``<save_path>.old-<pid>``
and renames the new one into place. A crash between those steps leaves the sibling folders
behind (possibly holding the run's checkpoints and logs, which are carried into the new
folder); :func:`recover_interrupted_export` puts everything back at the next start.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from fsdp_rlhf.config import LoraConfig
from fsdp_rlhf.distributed.env import run_and_agree
from fsdp_rlhf.distributed.fsdp import gather_full_state_dict
from fsdp_rlhf.errors import UserError, write_fault
from fsdp_rlhf.models.lora import adapter_config, adapter_state_dict, merge_lora_state_dict

log = logging.getLogger("fsdp_rlhf")


ADAPTER_DIR = "adapter"  # <save_path>/adapter: the LoRA adapter folder of a --lora_rank run


def save_hf_model(
    model: nn.Module,
    tokenizer,
    save_path: str | Path,
    *,
    extra_config: dict[str, Any] | None = None,
    layout_of: str | None = None,
) -> Path:
    """Collective. Rank 0 writes ``save_path`` as a ``from_pretrained``-loadable folder, its
    tensors laid out as in the checkpoint ``layout_of`` (the model trained; see
    :func:`match_checkpoint_layout`).

    The folder appears complete or not at all: files go to ``<save_path>.tmp-<pid>`` first and
    an existing ``save_path`` is replaced only after everything is written.
    """
    state = gather_full_state_dict(model)
    final = Path(save_path)

    def fill(tmp: Path) -> None:
        _write_hf(model, state, tokenizer, tmp, extra_config, layout_of)

    _write_atomically(final, fill)
    return final


def match_checkpoint_layout(out: Path, source: str | Path) -> list[str]:
    """Give the tensors of the safetensors files in ``out`` the layout of the same tensors in
    the checkpoint folder ``source``; returns the names changed.

    transformers' loader transposes some weights by shape (Qwen3-VL-MoE's fused experts: (E, H,
    2I) and (E, I, H) in the published checkpoints, (E, 2I, H) and (E, H, I) in the model), and
    ``save_pretrained`` never transposes them back (in reverse the shapes always match), so the
    export would hold a layout that vLLM's loader and the published checkpoints do not. A 3-D
    tensor whose source shape is its own with the last two dimensions swapped is written
    transposed. Nothing changes without a local ``source`` (a hub id) or for other models."""
    from safetensors import safe_open

    from fsdp_rlhf.models.checkpoint_format import checkpoint_shapes

    shapes, changed = checkpoint_shapes(source), []
    for path in sorted(out.glob("*.safetensors")) if shapes else []:
        with safe_open(str(path), framework="pt") as f:
            names = []
            for name in f.keys():
                mine, theirs = tuple(f.get_slice(name).get_shape()), shapes.get(name)
                if theirs is not None and len(mine) == 3 and mine != theirs:
                    if (mine[0], mine[2], mine[1]) == theirs:
                        names.append(name)
        transpose_in_file(path, names)
        changed += names
    return changed


def transpose_in_file(path: Path, names: list[str]) -> None:
    """Rewrite the safetensors file ``path`` with the 3-D tensors ``names`` transposed in their
    last two dimensions (a temp file, then a rename); nothing when ``names`` is empty."""
    from safetensors.torch import load_file, save_file

    if not names:
        return
    tensors = load_file(str(path))
    for name in names:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path)


def save_model(
    model: nn.Module,
    tokenizer,
    save_path: str | Path,
    lora: LoraConfig,
    *,
    base_path: str,
    head: str | None = None,
    extra_config: dict[str, Any] | None = None,
) -> Path:
    """Collective. The final export of a trained model: :func:`save_hf_model`, or with LoRA
    the adapter folder ``<save_path>/adapter`` (peft's format, loadable by peft and vLLM) and,
    with ``--merge_lora``, the merged HF model in ``save_path`` itself.

    ``base_path``: the model the adapters were trained on; ``head``: a scalar head trained in
    full (reward model, critic), saved in the adapter as peft's ``modules_to_save``.
    """
    if not lora.enabled:
        return save_hf_model(
            model, tokenizer, save_path, extra_config=extra_config, layout_of=base_path
        )
    state = gather_full_state_dict(model)
    final = Path(save_path)

    def fill(tmp: Path) -> None:
        from safetensors.torch import save_file

        adapter = tmp / ADAPTER_DIR
        adapter.mkdir()
        config = adapter_config(model, lora, base_path, head)
        (adapter / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: v.contiguous() for k, v in adapter_state_dict(state, head).items()}
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
        if lora.merge_lora:
            merged = merge_lora_state_dict(state, lora)
            _write_hf(model, merged, tokenizer, tmp, extra_config, base_path)
        elif tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    _write_atomically(final, fill)
    return final


def _write_hf(
    model,
    state,
    tokenizer,
    out: Path,
    extra_config: dict[str, Any] | None,
    layout_of: str | None = None,
) -> None:
    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    if layout_of is not None:
        match_checkpoint_layout(out, layout_of)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    if extra_config:
        cfg_file = out / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.update(extra_config)
        cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def _write_atomically(final: Path, fill: Callable[[Path], None]) -> None:
    """Rank 0 runs ``fill(tmp)`` on a fresh sibling folder, then renames it onto ``final``;
    every rank learns whether that worked (a collective). A refused write (full disk) deletes
    the partial folder and raises :class:`~fsdp_rlhf.errors.WriteFault` on rank 0."""

    def write() -> None:
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
            fill(tmp)
        except Exception as e:
            fault = write_fault(e, final, removed_partial=True)  # before the delete frees space
            shutil.rmtree(tmp, ignore_errors=True)
            if fault is None:
                raise
            raise fault from e
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        try:
            if final.exists():
                _carry_over(final, tmp)
                final.rename(old)
            tmp.rename(final)
        except OSError as e:  # what was moved is put back at the next start
            fault = write_fault(e, final)
            if fault is None:
                raise
            raise fault from e
        shutil.rmtree(old, ignore_errors=True)

    # Every rank learns whether rank 0's write worked: on failure they stop with a clear
    # message instead of waiting at a barrier until the process-group timeout.
    run_and_agree(write, f"saving the model to {final}", only_rank0=True)


def _siblings(final: Path, kind: str) -> list[Path]:
    pattern = re.compile(rf"^{re.escape(final.name)}\.{kind}-(\d+)$")
    if not final.parent.is_dir():
        return []
    return sorted(p for p in final.parent.iterdir() if pattern.match(p.name) and p.is_dir())


def recover_interrupted_export(save_path: str | Path) -> list[Path]:
    """Undo what a crash inside :func:`save_hf_model` left behind; returns the folders handled.

    Call on one process (rank 0) before anything reads ``save_path`` or a checkpoint under it.
    An ``.old-<pid>`` folder whose replacement never arrived becomes ``save_path`` again; run
    files (checkpoints, logs) already carried into a ``.tmp-<pid>`` or ``.old-<pid>`` folder go
    back into ``save_path``; then the leftovers are deleted.
    """
    final = Path(save_path)
    if not final.name:
        return []
    handled = []
    for old in _siblings(final, "old"):
        if not final.exists():
            old.rename(final)
        else:
            _carry_over(old, final)
            shutil.rmtree(old, ignore_errors=True)
        handled.append(old)
    for tmp in _siblings(final, "tmp"):
        final.mkdir(parents=True, exist_ok=True)
        _carry_over(tmp, final)
        shutil.rmtree(tmp, ignore_errors=True)
        handled.append(tmp)
    for p in handled:
        log.warning("removed %s, left by an interrupted model export", p)
    return handled


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
    ADAPTER_DIR,
}


def _is_model_file(name: str) -> bool:
    return (
        name in _MODEL_FILES or name.startswith("tokenizer") or name.endswith(_MODEL_FILE_SUFFIXES)
    )


_OUR_MARKERS = ("config.yaml", "metrics.jsonl")


def check_save_path(save_path: str, *, other_paths: dict[str, str | None]) -> None:
    """Fail before training if the final export into ``save_path`` could not work.

    The export renames a sibling temp folder onto ``save_path``, so ``save_path`` must have a
    name and a writable parent, and must not be the working directory, a mount point or an
    input model (which the export would replace). An existing non-empty folder is accepted only
    if an earlier fsdp-rlhf run owns it (its ``config.yaml`` or ``metrics.jsonl``).
    ``other_paths``: flag -> path of models the run reads (``--pretrain`` ...).
    """
    if not save_path:
        raise UserError("--save_path is required")
    p = Path(save_path)
    resolved = p.resolve()
    why = None
    if not p.name or Path.cwd().resolve().is_relative_to(resolved):
        why = "is the current directory or one of its parents"
    elif os.path.ismount(resolved):
        why = "is a mount point"
    elif p.is_file():
        why = "is a file"
    if why:
        raise UserError(
            f"--save_path {save_path}: {why}; the model is written beside it and renamed into "
            f"place, so name a folder inside it, e.g. {p / 'model'}"
        )
    for flag, other in other_paths.items():
        if other and Path(other).resolve() == resolved:
            raise UserError(f"--save_path {save_path}: is {flag}; the export would replace it")
    parent = resolved.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--save_path {save_path}: {parent} is not writable")
    # Leftovers of an interrupted export mean rank 0 may be restoring the folder right now
    # (other ranks run this check concurrently): it is ours then.
    recovering = _siblings(p, "tmp") or _siblings(p, "old")
    ours = recovering or any((p / m).exists() for m in _OUR_MARKERS)
    if p.is_dir() and any(p.iterdir()) and not ours:
        sample = sorted(e.name for e in p.iterdir())[:3]
        raise UserError(
            f"--save_path {save_path}: an existing folder not written by fsdp-rlhf (holds "
            f"{', '.join(sample)}); its model files would be replaced. Pick a new folder"
        )


def _carry_over(old: Path, new: Path) -> None:
    """Move what else lives in the old folder (logs, checkpoints, TensorBoard) into the new one,
    so replacing the model never deletes a run's history; stale weight files stay behind."""
    for entry in old.iterdir():
        if not _is_model_file(entry.name) and not (new / entry.name).exists():
            entry.rename(new / entry.name)
