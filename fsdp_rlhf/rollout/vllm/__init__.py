"""The in-process vLLM engine and the vLLM internals it relies on.

Nothing is imported here: importing vLLM takes seconds and must only happen when the vLLM engine
is used (``from fsdp_rlhf.rollout.vllm.engine import VLLMEngine``). Inside this package ``vllm``
still names the real vLLM: every import is absolute.

    engine.py   VLLMEngine: one tensor-parallel slice per torchrun rank; the only vLLM importer
    api.py      the vLLM internals the adapter calls, as data, and their check
    lora.py     LoRA adapters for the engine, from tensors in memory
    moe.py      MoE in the engine: CPU experts' weight sync, router replay
    reload.py   loaders the in-place reload does not see (gpt-oss experts, attention sinks)
"""
