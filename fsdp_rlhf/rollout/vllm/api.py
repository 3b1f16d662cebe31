"""The vLLM internals the adapter calls, as data, and the check that they still have the shape
it was written for.

Kept free of vLLM imports: the tables are checked against the installed vLLM at engine start
(``engine.check_vllm_internals``) and against recorded signatures of other vLLM versions
in the tests (tests/unit/test_vllm_versions.py), without installing them.
"""

from __future__ import annotations

import importlib
import inspect

# "what": (class, attribute, parameter names the call passes by keyword)
Expected = dict[str, tuple[type, str, tuple[str, ...]]]
# "what": (module, class, attribute, parameter names the call passes by keyword)
Calls = dict[str, tuple[str, str, str, tuple[str, ...]]]

# The engine: weight reload through the worker (v1 and v2 model runners; the CPU runners
# subclass them), the in-process external-launcher executor and engine client, the LLM methods.
ENGINE_CALLS: Calls = {
    "Worker.reload_weights": ("vllm.v1.worker.gpu_worker", "Worker", "reload_weights", ()),
    "GPUModelRunner.reload_weights": (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "reload_weights",
        ("weights_iterator",),
    ),
    "v2 GPUModelRunner.reload_weights": (
        "vllm.v1.worker.gpu.model_runner",
        "GPUModelRunner",
        "reload_weights",
        ("weights_iterator",),
    ),
    "LLM.collective_rpc": ("vllm", "LLM", "collective_rpc", ("method", "kwargs")),
    "LLM.reset_prefix_cache": ("vllm", "LLM", "reset_prefix_cache", ()),
    "LLM.sleep": ("vllm", "LLM", "sleep", ("level",)),
    "LLM.wake_up": ("vllm", "LLM", "wake_up", ("tags",)),
    "ExecutorWithExternalLauncher._init_executor": (
        "vllm.v1.executor.uniproc_executor",
        "ExecutorWithExternalLauncher",
        "_init_executor",
        (),
    ),
    "InprocClient.shutdown": ("vllm.v1.engine.core_client", "InprocClient", "shutdown", ()),
}

# Asynchronous training: requests driven one engine step at a time, and new weights loaded
# while requests are in flight (their KV cache recomputed: reset_running_requests).
STREAMING_CALLS: Calls = {
    "LLMEngine.add_request": ("vllm.v1.engine.llm_engine", "LLMEngine", "add_request", ()),
    "LLMEngine.step": ("vllm.v1.engine.llm_engine", "LLMEngine", "step", ()),
    "LLMEngine.abort_request": ("vllm.v1.engine.llm_engine", "LLMEngine", "abort_request", ()),
    "LLMEngine.has_unfinished_requests": (
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "has_unfinished_requests",
        (),
    ),
    "LLM.reset_prefix_cache(reset_running_requests)": (
        "vllm",
        "LLM",
        "reset_prefix_cache",
        ("reset_running_requests",),
    ),
}

# rollout/vllm/moe.py, recording routed experts on CPU (--router_replay; checked only then, and
# only against the installed vLLM: the recorder runs on 0.32): the capture hook vLLM's own
# recorder uses, and the V1 runner calling the model with the flat batch's ids and positions.
MOE_CALLS: Calls = {
    "BaseRouter.set_capture_fn": (
        "vllm.model_executor.layers.fused_moe.router.base_router",
        "BaseRouter",
        "set_capture_fn",
        (),
    ),
    "GPUModelRunner._model_forward": (
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner",
        "_model_forward",
        ("input_ids", "positions"),
    ),
}

# rollout/vllm/moe.py, reading vLLM's own routed-experts capture (--router_replay on CUDA):
# the engine argument that turns it on (an ``EngineArgs`` field: ``LLM`` takes it by keyword)
# and the rows each finished completion carries. Read in the 0.26.0 and 0.33.0 wheels too.
CAPTURE_CALLS: Calls = {
    "EngineArgs(enable_return_routed_experts)": (
        "vllm.engine.arg_utils",
        "EngineArgs",
        "__init__",
        ("enable_return_routed_experts",),
    ),
    "CompletionOutput(routed_experts)": (
        "vllm.outputs",
        "CompletionOutput",
        "__init__",
        ("routed_experts",),
    ),
}

# vLLM 0.32 and 0.33's design of that capture: the auxiliary-output connector, whose scheduler
# side builds each step's metadata for the worker, takes the worker's rows (on every TP rank but
# the first the adapter's take_output returns none: moe.rows_on_first_rank_only) and resets
# with the prefix cache. Checked when an engine's scheduler has one.
CONNECTOR_CALLS: Calls = {
    "AuxOutputSchedulerConnector.build_connector_meta": (
        "vllm.distributed.aux_output_connector.connector",
        "AuxOutputSchedulerConnector",
        "build_connector_meta",
        ("scheduler_output", "requests"),
    ),
    "AuxOutputSchedulerConnector.take_output": (
        "vllm.distributed.aux_output_connector.connector",
        "AuxOutputSchedulerConnector",
        "take_output",
        ("request", "output"),
    ),
    "AuxOutputSchedulerConnector.reset": (
        "vllm.distributed.aux_output_connector.connector",
        "AuxOutputSchedulerConnector",
        "reset",
        (),
    ),
}

# Vision-language models: after a weight update the encoder outputs cached per image are stale
# (the scheduler's record of them and the runner's tensors both go).
VISION_CALLS: Calls = {
    "LLMEngine.reset_encoder_cache": (
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "reset_encoder_cache",
        (),
    ),
}

# rollout/vllm/lora.py: adapters built from tensors in memory.
LORA_CALLS: Calls = {
    "LoRAModel.from_lora_tensors": (
        "vllm.lora.lora_model",
        "LoRAModel",
        "from_lora_tensors",
        (
            "lora_model_id",
            "tensors",
            "peft_helper",
            "device",
            "dtype",
            "model_vocab_size",
            "weights_mapper",
        ),
    ),
    "PEFTHelper.from_dict": ("vllm.lora.peft_helper", "PEFTHelper", "from_dict", ("config_dict",)),
    "PEFTHelper.validate_legal": (
        "vllm.lora.peft_helper",
        "PEFTHelper",
        "validate_legal",
        ("lora_config",),
    ),
    "LoRAModelManager.add_adapter": (
        "vllm.lora.model_manager",
        "LoRAModelManager",
        "add_adapter",
        (),
    ),
    "LoRAModelManager.remove_adapter": (
        "vllm.lora.model_manager",
        "LoRAModelManager",
        "remove_adapter",
        ("adapter_id",),
    ),
    "WorkerLoRAManager.list_adapters": (
        "vllm.lora.worker_manager",
        "WorkerLoRAManager",
        "list_adapters",
        (),
    ),
}


def resolve(calls: Calls) -> tuple[Expected, list[str]]:
    """Import each call's class; returns the resolved table and one line per missing class."""
    expected, problems = {}, []
    for what, (module, cls, attr, params) in calls.items():
        try:
            expected[what] = (getattr(importlib.import_module(module), cls), attr, params)
        except (ImportError, AttributeError) as e:
            problems.append(f"{what}: {module}.{cls} is gone ({type(e).__name__})")
    return expected, problems


def signature_problems(expected: Expected) -> list[str]:
    """One line per attribute that is gone or lost a parameter (empty when all are as expected).

    Looked up statically, so nothing is imported or bound; classmethods are unwrapped. A method
    that takes ``**kwargs`` loses no keyword: it forwards them (vLLM 0.26's v2 runner's
    ``reload_weights(*args, **kwargs)`` hands them to the v1 runner's, checked on its own)."""
    problems = []
    for what, (cls, name, params) in expected.items():
        fn = inspect.getattr_static(cls, name, None)
        if fn is None:
            problems.append(f"{what} is gone")
            continue
        fn = fn.__func__ if isinstance(fn, classmethod | staticmethod) else fn
        accepted = inspect.signature(fn).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
            continue
        missing = set(params) - set(accepted)
        if missing:
            problems.append(f"{what} lost parameters {sorted(missing)}")
    return problems


def check_calls(calls: Calls) -> list[str]:
    """Problems of ``calls`` against the installed vLLM (empty when all are as expected)."""
    expected, problems = resolve(calls)
    return problems + signature_problems(expected)
