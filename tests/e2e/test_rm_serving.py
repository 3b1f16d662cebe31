"""The reward model `train-rm` saves is served by vLLM (pooling runner) with the same scores
as transformers' AutoModelForSequenceClassification."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import REPO

SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

if __name__ == "__main__":
    path = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Human: cat dog\\nAssistant: good happy kind", "Human: sun\\nAssistant: bad sad no"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        ref = [hf(torch.tensor([i])).logits.item() for i in ids]
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=path, runner="pooling", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=1 << 28)
    outs = llm.classify([TokensPrompt(prompt_token_ids=i) for i in ids], use_tqdm=False,
                        pooling_params=PoolingParams(use_activation=False))
    print("RESULT " + json.dumps({"hf": ref, "vllm": [o.outputs.probs[0] for o in outs]}))
"""


@pytest.mark.slow
@pytest.mark.long
def test_vllm_serves_the_saved_reward_model(trained_rm, tmp_path):
    script = tmp_path / "serve_rm.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), trained_rm],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["hf"] == pytest.approx(result["vllm"], abs=1e-4)
    assert result["hf"][0] != pytest.approx(result["hf"][1], abs=1e-3)  # a real, non-constant head
