"""A failed final export on rank 0 ends every rank at once (no wait for the collective
timeout), and a successful one still works on two ranks."""

from __future__ import annotations

import time
from pathlib import Path

from tests.dist_utils import run_distributed


def _export(rank: int, world: int, model_path: str, save_path: str) -> str:
    from fsdp_rlhf.config import BackendConfig
    from fsdp_rlhf.distributed.env import PeerFailure
    from fsdp_rlhf.errors import WriteFault
    from fsdp_rlhf.models.load import load_causal_lm
    from fsdp_rlhf.models.save import save_hf_model
    from tests.dist_utils import current_env

    model = load_causal_lm(model_path, BackendConfig(), current_env().device)
    started = time.monotonic()
    try:
        save_hf_model(model, None, save_path)
    except PeerFailure as e:
        return f"peer {time.monotonic() - started:.1f} {e}"
    except WriteFault as e:
        return f"own {e}"
    return "ok"


def test_export_failure_on_rank0_reaches_every_rank(tiny_qwen2, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # the export folder's parent is a file: rank 0's mkdir fails
    out = run_distributed(_export, 2, tiny_qwen2, str(blocker / "model"), timeout=300)
    assert (
        out[0] == f"own not a directory while writing {blocker}/model (the partial copy was "
        "removed)"
    ), out
    kind, seconds, *msg = out[1].split()
    assert kind == "peer" and float(seconds) < 60, out[1]
    assert "saving the model to" in " ".join(msg) and "rank 0" in " ".join(msg)


def test_export_succeeds_on_two_ranks(tiny_qwen2, tmp_path):
    out = run_distributed(_export, 2, tiny_qwen2, str(tmp_path / "model"), timeout=300)
    assert out == ["ok", "ok"]
    assert (Path(tmp_path) / "model" / "config.json").is_file()
    assert not list(tmp_path.glob("model.tmp-*")) and not list(tmp_path.glob("model.old-*"))
