"""Hide vLLM from every import in this process and its children (``PYTHONPATH`` carries this
folder): the GPU suite rehearsed on CPU as the bare GPU box runs it, without vLLM
(``make test-gpu``)."""

import sys


class _HideVLLM:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "vllm":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None


sys.meta_path.insert(0, _HideVLLM())
