"""The GPU box has no `datasets` (docs/gpu.md): every command's modules import without it; it
is imported where data is loaded."""

from __future__ import annotations

import subprocess
import sys

BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError("datasets hidden by the test")
sys.meta_path.insert(0, Block())
import fsdp_rlhf.cli, fsdp_rlhf.doctor
import fsdp_rlhf.trainers.offline.rm, fsdp_rlhf.trainers.offline.sft, fsdp_rlhf.trainers.offline.dpo
import fsdp_rlhf.trainers.ppo
assert "datasets" not in sys.modules
print("ok")
"""


def test_command_modules_import_without_datasets():
    proc = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
