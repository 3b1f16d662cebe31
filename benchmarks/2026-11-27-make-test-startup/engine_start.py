"""One in-process vLLM engine start on a tiny Qwen2 (1 rank, TP 1), timed in phases; prints JSON."""

import json
import os
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

t_torch = time.perf_counter()
os.environ.update(
    MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
)
from fsdp_rlhf.distributed.env import free_port  # noqa: E402

os.environ["MASTER_PORT"] = str(free_port())
dist.init_process_group("gloo")
from fsdp_rlhf.config import RolloutConfig  # noqa: E402
from fsdp_rlhf.rollout import SamplingConfig, build_rollout_groups  # noqa: E402
from fsdp_rlhf.rollout.vllm.engine import VLLMEngine  # noqa: E402

t_import = time.perf_counter()
model = sys.argv[1]
cfg = RolloutConfig(
    vllm_tensor_parallel_size=1, generate_max_len=8, enforce_eager=True, vllm_kvcache_space_gib=0.25
)
engine = VLLMEngine(
    model,
    cfg,
    groups=build_rollout_groups(1),
    prompt_max_len=32,
    dtype=torch.float32,
    seed=7,
    pad_token_id=0,
)
t_engine = time.perf_counter()
engine.generate([[1, 2, 3, 4]], SamplingConfig(max_new_tokens=8, greedy=True))
t_gen = time.perf_counter()
print(
    json.dumps(
        {
            "import_torch_s": t_torch - t0,
            "import_vllm_adapter_s": t_import - t_torch,
            "engine_start_s": t_engine - t_import,
            "first_generate_s": t_gen - t_engine,
        }
    )
)
os._exit(0)
