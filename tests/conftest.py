"""Shared fixtures: a locally trained tokenizer and tiny random-weight model folders.

Everything is built once per test session in a temporary directory; transformers is only
imported when a fixture that needs it is first used.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import model_factory`

import model_factory


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Folder with the byte-level BPE test tokenizer (bos <s>, eos </s>, a chat template)."""
    return model_factory.build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str
) -> Callable[[str], str]:
    """Factory: ``tiny_model_dir(kind)`` -> HF model folder (weights + tokenizer), cached.

    Kinds are ``model_factory.KINDS``: llama, llama-tied, llama-mqa, mistral, qwen2, qwen3,
    llama-rope-llama3, llama-rope-yarn, llama-rope-linear, llama-rope-dynamic.
    """
    built: dict[str, str] = {}

    def make(kind: str = "llama") -> str:
        if kind not in built:
            out = tmp_path_factory.mktemp(f"model-{kind}")
            built[kind] = model_factory.build_tiny_model(kind, out, tokenizer_dir)
        return built[kind]

    return make


@pytest.fixture(scope="module")
def ops():
    """The compiled CPU kernel module (backends/cpu/csrc), built once per machine."""
    import os

    from cadence.backends.cpu import kernels

    if os.environ.get("CADENCE_CPU_KERNELS") == "0" or kernels._compiler() is None:
        pytest.skip("the CPU kernels are disabled here (CADENCE_CPU_KERNELS=0 or no compiler)")
    mod = kernels.load_kernels()
    if mod is None:  # a None cached by an earlier test that turned the kernels off
        mod = kernels._loaded["cpu"] = kernels._build()
    assert mod is not None, "the kernel build failed with a compiler present (see the warning)"
    return mod


@pytest.fixture
def restore_threads():
    """Puts torch's thread count back after a test that changes it."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def checkpoint_reads(monkeypatch) -> list[str]:
    """The names of the safetensors tensors read from disk while the test runs, in order
    (every ``get_tensor`` through ``safetensors.safe_open``); clear it between loads."""
    import safetensors

    read: list[str] = []
    real = safetensors.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return read
