"""Rollout contract, HF engine, weight streaming, sleep logic and the vLLM adapter's assumptions
(single process; the only vLLM cost here is one import in the last test)."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from fsdp_rlhf.config import BackendConfig, RolloutConfig
from fsdp_rlhf.rollout import HFEngine, RolloutOutput, SamplingConfig, stream_actor_weights
from fsdp_rlhf.rollout.groups import own_prompt_range, tp_blocks
from fsdp_rlhf.rollout.sleep import SleepTracker

PAD, EOS = 0, 1


def _out(logprobs=True) -> RolloutOutput:
    prompts = [[5, 6, 7], [5, 6, 7], [8], [8]]
    responses = [[10, 11, EOS], [12], [13, 14], [15, 16, 17, 18]]
    lps = [[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6], [-1.0, -1.1, -1.2, -1.3]] if logprobs else None
    return RolloutOutput.from_lists(
        prompts, responses, ["stop", "length", "length", "length"], lps, pad_id=PAD, n=2
    )


def test_rollout_output_padding_and_sequences():
    out = _out()
    assert out.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [PAD, PAD, 8], [PAD, PAD, 8]]
    assert out.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]
    assert out.response_ids[0].tolist() == [10, 11, EOS, PAD]
    assert out.response_lengths.tolist() == [3, 1, 2, 4]
    assert out.engine_logprobs.dtype == torch.float32
    assert out.engine_logprobs[1].tolist() == pytest.approx([-0.4, 0, 0, 0])
    ids, mask = out.sequences()
    assert ids.shape == mask.shape == (4, 7)
    assert ids[2].tolist() == [PAD, PAD, 8, 13, 14, PAD, PAD]
    assert mask[2].tolist() == [0, 0, 1, 1, 1, 0, 0]
    assert _out(logprobs=False).engine_logprobs is None


def test_rollout_output_rejects_bad_rows():
    with pytest.raises(ValueError, match="finish reasons"):
        RolloutOutput.from_lists([[1]], [[2]], ["abort"], None, pad_id=PAD, n=1)
    with pytest.raises(ValueError, match="logprobs"):
        RolloutOutput.from_lists([[1]], [[2, 3]], ["length"], [[-1.0]], pad_id=PAD, n=1)
    with pytest.raises(ValueError, match="samples per prompt"):
        RolloutOutput.from_lists([[1]] * 3, [[2]] * 3, ["length"] * 3, None, pad_id=PAD, n=2)
    empty = RolloutOutput.from_lists([], [], [], [], pad_id=PAD, n=4)
    assert len(empty.finish_reasons) == 0 and empty.sequences()[0].shape == (0, 0)


def test_sampling_config():
    assert SamplingConfig(max_new_tokens=4, temperature=0.0).is_greedy
    assert SamplingConfig(max_new_tokens=4, greedy=True, temperature=0.7).is_greedy
    assert not SamplingConfig(max_new_tokens=4).is_greedy
    for bad in (
        dict(max_new_tokens=0),
        dict(max_new_tokens=1, n=0),
        dict(max_new_tokens=1, top_p=0.0),
        dict(max_new_tokens=1, temperature=-1.0),
    ):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    cfg = RolloutConfig(generate_max_len=33, temperature=0.9, top_p=0.8, top_k=20)
    s = SamplingConfig.from_rollout_config(cfg, n=4, seed=3)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.n, s.seed) == (
        33,
        0.9,
        0.8,
        20,
        4,
        3,
    )


def test_tp_blocks_and_prompt_ranges():
    assert tp_blocks(4, 2) == [[0, 1], [2, 3]]
    assert tp_blocks(2, 1) == [[0], [1]]
    with pytest.raises(ValueError, match="must divide"):
        tp_blocks(4, 3)
    assert own_prompt_range([3, 2], 0) == (0, 3)
    assert own_prompt_range([3, 2], 1) == (3, 5)
    assert own_prompt_range([0, 2], 0) == (0, 0)


def test_sleep_tracker_levels():
    off = SleepTracker(enabled=False, level=2)  # CPU: everything is a no-op
    assert not off.sleep() and off.wake(None) == []
    off.check_ready()

    one = SleepTracker(enabled=True, level=1)
    assert one.sleep() and not one.sleep()  # a second sleep does nothing
    with pytest.raises(RuntimeError, match="wake_up"):
        one.check_ready()
    with pytest.raises(RuntimeError, match="wake_up"):
        one.on_weight_update()  # weights must be awake to receive a sync
    assert one.wake(["weights"]) == ["weights"]
    with pytest.raises(RuntimeError, match="kv_cache"):
        one.check_ready()
    assert one.wake(None) == ["kv_cache"]  # only what still sleeps
    one.check_ready()  # level 1 kept the weights: no sync needed

    two = SleepTracker(enabled=True, level=2)
    two.sleep()
    two.wake(["weights"])
    two.wake(["kv_cache"])
    with pytest.raises(RuntimeError, match="full update_weights"):
        two.check_ready()
    two.on_weight_update()
    two.check_ready()
    with pytest.raises(ValueError, match="subset"):
        two.wake(["optimizer"])
    with pytest.raises(ValueError):
        SleepTracker(enabled=True, level=3)


def _model(path):
    from fsdp_rlhf.models.load import load_causal_lm

    return load_causal_lm(path, BackendConfig(), torch.device("cpu"))


def _greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding with full forwards, no cache, no padding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def _responses(out) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(out.response_ids, out.response_mask, strict=True)]


PROMPTS = [[20, 21, 22, 23, 24], [30, 31], [40, 41, 42]]


def test_hf_engine_greedy_stop_and_logprobs(tiny_qwen2):
    from fsdp_rlhf.models.forward import response_logprobs
    from fsdp_rlhf.models.inputs import forward_inputs

    model = _model(tiny_qwen2)
    engine = HFEngine(copy.deepcopy(model), pad_token_id=PAD, eos_token_ids=[EOS], seed=0)
    greedy = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=8, greedy=True))
    # left padding must not shift positions: equals unpadded argmax decoding
    assert _responses(greedy) == [_greedy_reference(model, p, 8) for p in PROMPTS]
    assert greedy.finish_reasons == ["length"] * 3

    stop = _responses(greedy)[0][2]
    cut = engine.generate(
        PROMPTS, SamplingConfig(max_new_tokens=8, greedy=True, stop_token_ids=(stop,))
    )
    first = _responses(greedy)[0].index(stop)
    assert _responses(cut)[0] == _responses(greedy)[0][: first + 1]
    assert cut.finish_reasons[0] == "stop"

    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, n=2)
    out = engine.generate(PROMPTS, sampling)
    ids, mask = out.sequences()
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, forward_inputs(ids, mask), out.response_ids.shape[1], temperature=0.7
        )
    assert ((lp - out.engine_logprobs).abs() * out.response_mask).max() < 1e-4
    assert (out.engine_logprobs[out.response_mask == 0] == 0).all()


def test_hf_engine_samples_rng_and_update(tiny_qwen2):
    model = _model(tiny_qwen2)
    a = HFEngine(copy.deepcopy(model), pad_token_id=PAD, eos_token_ids=[EOS], seed=5)
    b = HFEngine(copy.deepcopy(model), pad_token_id=PAD, eos_token_ids=[EOS], seed=5)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, n=3)
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    out = a.generate(PROMPTS, sampling)
    assert torch.equal(torch.rand(3), expected)  # the training RNG did not move
    assert _responses(out) == _responses(b.generate(PROMPTS, sampling))  # same seed, same rows
    assert out.response_ids.shape[0] == 9
    assert out.prompt_ids[3:6].tolist() == [[0, 0, 0, 30, 31]] * 3  # prompt-major
    assert len({tuple(r) for r in _responses(out)[:3]}) >= 2

    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    nbytes = a.update_weights(stream_actor_weights(changed, torch.float32))
    assert nbytes == 4 * sum(p.numel() for p in model.parameters())
    greedy = SamplingConfig(max_new_tokens=6, greedy=True)
    ref = HFEngine(changed, pad_token_id=PAD, eos_token_ids=[EOS], seed=0)
    assert _responses(a.generate(PROMPTS, greedy)) == _responses(ref.generate(PROMPTS, greedy))
    with pytest.raises(ValueError, match="complete"):
        a.update_weights([("model.norm.weight", torch.ones(128))])
    with pytest.raises(KeyError, match="not a parameter"):
        a.update_weights([("model.nope.weight", torch.ones(1))])


def test_stream_actor_weights_names(tiny_qwen2, tiny_qwen2_tied):
    from fsdp_rlhf.rollout.hf_engine import HFEngine
    from fsdp_rlhf.rollout.weight_sync import hf_param_name, sync_weights

    untied = _model(tiny_qwen2)
    names = [n for n, _ in stream_actor_weights(untied, torch.bfloat16)]
    assert names == [n for n, _ in untied.named_parameters()]
    assert all(t.dtype == torch.bfloat16 for _, t in stream_actor_weights(untied, torch.bfloat16))

    tied = _model(tiny_qwen2_tied)
    streamed = list(stream_actor_weights(tied, torch.float32))
    names = [n for n, _ in streamed]
    assert names.count("lm_head.weight") == 1 and names.count("model.embed_tokens.weight") == 1
    weights = dict(streamed)
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]  # alias, no copy

    assert (
        hf_param_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight")
        == "model.layers.0.mlp.up_proj.weight"
    )
    engine = HFEngine(copy.deepcopy(tied), pad_token_id=PAD, eos_token_ids=[EOS], seed=0)
    stats = sync_weights(tied, engine, torch.float32)
    embed = tied.get_input_embeddings().weight.numel()
    assert stats.bytes == 4 * (sum(p.numel() for p in tied.parameters()) + embed)
    assert stats.seconds > 0 and stats.bytes_per_s > 0


def test_vllm_adapter_assumptions(tiny_qwen2):
    """Fails loudly when a vLLM upgrade breaks what the adapter relies on."""
    pytest.importorskip("vllm")  # the adapter imports vLLM (absent on the GPU box)
    import vllm

    from fsdp_rlhf.rollout.vllm import engine as ve

    assert ve.check_vllm_internals() == vllm.__version__
    assert vllm.__version__ in ve.TESTED_VLLM_VERSIONS, (
        f"vLLM {vllm.__version__}: re-run tests/distributed/test_rollout.py, then add it to "
        "TESTED_VLLM_VERSIONS"
    )
    cfg = RolloutConfig(generate_max_len=16, vllm_tensor_parallel_size=2)
    kw = ve.engine_kwargs(
        tiny_qwen2,
        cfg,
        tp_size=2,
        prompt_max_len=48,
        dtype=torch.bfloat16,
        seed=3,
        trust_remote_code=False,
    )
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert kw["max_model_len"] == 64 and kw["dtype"] == "bfloat16" and kw["seed"] == 3
    assert kw["logprobs_mode"] == "processed_logprobs"
    if not torch.cuda.is_available():
        assert kw["kv_cache_memory_bytes"] == ve.GiB  # tiny model: the 1 GiB floor
        assert ve.cpu_kv_cache_bytes(tiny_qwen2, 64, 1, torch.float32, 0.5) == ve.GiB // 2
        # whole prefills (seeded CPU generators cannot rewind), in a budget that keeps the
        # compiled engine's one-forward warm-up small but always fits one full-length sequence
        assert kw["enable_chunked_prefill"] is False
        assert kw["max_num_batched_tokens"] == ve.CPU_STEP_TOKENS
        assert ve.cpu_scheduler_kwargs(8192)["max_num_batched_tokens"] == 8192
    greedy = ve.sampling_params(SamplingConfig(max_new_tokens=5, greedy=True, top_k=-1), None)
    assert (greedy.temperature, greedy.top_k, greedy.logprobs, greedy.max_tokens) == (0.0, 0, 0, 5)
    sampled = ve.sampling_params(
        SamplingConfig(max_new_tokens=5, n=4, stop_token_ids=(7,), return_logprobs=False), 11
    )
    assert (sampled.n, sampled.seed, sampled.stop_token_ids, sampled.logprobs) == (4, 11, [7], None)
    assert ve.request_seed(1, 0, 2) == ve.request_seed(1, 0, 2) != ve.request_seed(1, 1, 2)
    # router replay: what the CPU recorder relies on, and the engine it asks for
    assert ve.check_vllm_internals(router_replay=True) == vllm.__version__
    kw = ve.engine_kwargs(
        tiny_qwen2, cfg, tp_size=2, prompt_max_len=48, dtype=torch.float32, seed=3,
        trust_remote_code=False, router_replay=True,
    )  # fmt: skip
    if torch.cuda.is_available():
        assert kw["enable_return_routed_experts"]
    else:  # the recorder's hooks are not in vLLM's compiled graph
        assert kw["enforce_eager"] and "enable_return_routed_experts" not in kw


def test_vllm_lora_assumptions_and_rank_sizes(tiny_qwen2):
    pytest.importorskip("vllm")  # the adapter imports vLLM (absent on the GPU box)
    from fsdp_rlhf.errors import UserError
    from fsdp_rlhf.rollout.vllm import engine as ve
    from fsdp_rlhf.rollout.vllm import lora

    assert lora.check_lora_internals() == []
    ve.check_vllm_internals(lora=True)
    kw = ve.engine_kwargs(
        tiny_qwen2,
        RolloutConfig(generate_max_len=16),
        tp_size=1,
        prompt_max_len=48,
        dtype=torch.float32,
        seed=3,
        trust_remote_code=False,
        lora_rank=12,
    )
    assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, 16, 1)
    assert lora.max_lora_rank(8) == 8 and lora.max_lora_rank(1) == 1
    with pytest.raises(UserError, match="--lora_rank 600"):
        lora.max_lora_rank(600)


def test_adapter_sync_moves_only_the_adapters(tiny_qwen2):
    from fsdp_rlhf.config import LoraConfig
    from fsdp_rlhf.models.lora import add_lora
    from fsdp_rlhf.rollout import AdapterSpec, sync_adapter

    class Recorder:
        def wake_up(self, tags=None):
            pass

        def update_adapter(self, weights, spec):
            self.weights, self.spec = dict(weights), spec
            return sum(t.numel() * t.element_size() for t in self.weights.values())

    actor = add_lora(_model(tiny_qwen2), LoraConfig(lora_rank=4))
    engine, spec = Recorder(), AdapterSpec(rank=4, alpha=16, target_modules=("q_proj",))
    stats = sync_adapter(actor, engine, torch.bfloat16, spec)
    adapters = {n: p for n, p in actor.named_parameters() if p.requires_grad}
    assert stats.bytes == 2 * sum(p.numel() for p in adapters.values()) and engine.spec is spec
    assert len(engine.weights) == len(adapters) == 2 * 7 * 2  # A and B, 7 Linears, 2 layers
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert torch.equal(
        engine.weights[name],
        adapters["model.layers.1.mlp.down_proj.lora_B.default.weight"].bfloat16(),
    )


def test_cpu_engine_uses_the_compile_cache_that_loads_unless_the_user_chose(monkeypatch):
    pytest.importorskip("vllm")  # the adapter imports vLLM (absent on the GPU box)
    from fsdp_rlhf.rollout.vllm import engine as ve

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    ve._cpu_compile_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    ve._cpu_compile_cache()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"


def test_model_runner_is_named_v1_or_v2_from_the_worker():
    """The runner vLLM picked (V2 on CUDA with Triton, V1 on CPU), read on the worker."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1

    from fsdp_rlhf.rollout.vllm import engine as ve

    class Worker:
        def __init__(self, runner):
            self.model_runner = runner

    class FakeLLM:
        def __init__(self, runner):
            self.worker = Worker(runner)

        def collective_rpc(self, fn):
            return [fn(self.worker)]

    xpu_v2 = type("XPUModelRunnerV2", (V2,), {})  # subclasses count (vLLM's XPU V2 runner)
    assert ve.model_runner(FakeLLM(xpu_v2.__new__(xpu_v2)))[0] == "v2"
    v1 = V1.__new__(V1)
    assert ve.model_runner(FakeLLM(v1)) == ("v1", "vllm.v1.worker.gpu_model_runner.GPUModelRunner")


def test_a_weight_reload_drops_the_served_adapter_until_the_next_sync(monkeypatch):
    """Both runners' reload_weights remove every adapter (reset_lora_state): the engine must not
    name the old one (the worker would look for it at its placeholder path), nor answer with the
    base model silently."""
    pytest.importorskip("vllm")
    from fsdp_rlhf.rollout.sleep import SleepTracker
    from fsdp_rlhf.rollout.vllm import engine as ve

    class FakeLLM:
        def collective_rpc(self, fn, args=(), kwargs=None):
            return [None]

        def reset_prefix_cache(self):
            pass

    engine = ve.VLLMEngine.__new__(ve.VLLMEngine)
    engine.llm, engine._sleep = FakeLLM(), SleepTracker(False, 1)
    engine._lora_id, engine._adapter_dropped = 3, False  # adapter 3 served
    engine.vision = None  # a text model
    # a checkpoint whose names are transformers' own, of no architecture with a reload adapter
    engine._checkpoint = SimpleNamespace(convert=lambda weights: weights)
    engine._architectures = ()
    monkeypatch.setattr(ve, "_reload_weights_inplace", lambda llm, weights, archs=(): list(weights))
    engine.update_weights([("w", torch.zeros(2))])
    assert engine._lora_request() is None
    with pytest.raises(RuntimeError, match="update_adapter must follow"):
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2))


def test_vllm_decorates_a_private_decoder_class_not_transformers_own(tmp_path):
    """OLMo 2 goes through vLLM's Transformers backend, which decorates the decoder class it
    builds from for torch.compile; transformers' own class must stay usable by the trainer."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig, AutoModel
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Model
    from vllm.compilation.decorators import support_torch_compile

    from fsdp_rlhf.rollout.vllm import engine as ve
    from fsdp_rlhf.testing.tiny import build_family

    path = str(build_family(tmp_path, "olmo2"))
    config = AutoConfig.from_pretrained(path)
    with ve.private_decoder_class(path, trust_remote_code=False):
        with torch.device("meta"):
            built = type(AutoModel.from_config(config))  # what vLLM's backend decorates
        support_torch_compile(built)
    assert built is not Olmo2Model and issubclass(built, Olmo2Model)
    with torch.device("meta"):
        assert type(AutoModel.from_config(config)) is Olmo2Model  # the mapping is restored
        Olmo2Model(config)  # raised "Current vLLM config is not set" when vLLM decorated it
