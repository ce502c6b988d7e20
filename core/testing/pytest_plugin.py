"""The cadence backend conformance kit, as a pytest plugin.

Loaded through the ``pytest11`` entry point named ``cadence.testing.pytest_plugin`` (so
``-p cadence.testing.pytest_plugin`` also works, with or without the entry point, and
``-p no:cadence.testing.pytest_plugin`` turns it off). It adds:

- ``--cadence-backend NAME[,NAME...]`` (or the ini key ``cadence_backend``): the backend(s)
  the kit's checks run against; the checks skip when none is given;
- ``--cadence-backend-options JSON``: ``backend_options`` for the backend under test;
- ``--cadence-logprob-atol X``: how close two tokens' logprobs must be for a differing greedy
  token to count as a near-tie rather than a bug (default 0.01);
- the fixtures the checks use (``cadence_backend``, ``cadence_llm`` ...).

The checks themselves are test functions in ``cadence.testing.conformance`` (those of the
optional features are defined in ``cadence.testing.conformance_features`` and imported
there). Run them with ``pytest --pyargs cadence.testing.conformance --cadence-backend
NAME``, or put
``from cadence.testing.conformance import *`` in a test module of your own package and run
``pytest --cadence-backend NAME`` (docs/writing_a_backend.md). Either way their ids name the
kit, ``cadence/testing/conformance.py::test_...[NAME]``, not the module that imported them.

NOTE this module is imported by every pytest run in an environment where cadence is
installed, so it imports nothing heavy: torch and the engine load inside the fixtures.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

# Engine settings of every LLM the kit builds. Small on purpose: 10 blocks of 16 tokens cannot
# hold the whole workload, so requests get preempted; a 64-token budget chunks prefills;
# 8 sequences keep the bucket/graph count of device backends small.
KIT_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32", "seed": 0, "max_model_len": 128, "block_size": 16,
    "num_kv_blocks": 10, "max_num_seqs": 8, "max_num_batched_tokens": 64,
}
REFERENCE_BACKEND = "cpu"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cadence", "cadence backend conformance kit")
    group.addoption("--cadence-backend", default=None, metavar="NAME[,NAME...]",
                    help="run cadence's backend conformance checks against these backends")
    group.addoption("--cadence-backend-options", default=None, metavar="JSON",
                    help="backend_options (a JSON object) for the backend under test")
    group.addoption("--cadence-logprob-atol", type=float, default=None, metavar="X",
                    help="largest logprob gap of a greedy near-tie (default 0.01)")
    parser.addini("cadence_backend", "default for --cadence-backend", default="")


def backend_names(config: pytest.Config) -> list[str]:
    """The backends named by ``--cadence-backend`` or the ``cadence_backend`` ini key."""
    # default=None: the fixtures may be imported into a test module without the plugin.
    raw = config.getoption("cadence_backend", None)
    if not raw:
        try:
            raw = config.getini("cadence_backend")
        except ValueError:  # the ini key is unknown: the plugin itself is not loaded
            raw = ""
    return [n.strip() for n in str(raw).split(",") if n.strip()]


KIT_MODULE = "cadence.testing.conformance"
# Where the checks are defined: the kit module imports the optional features' checks from
# the second, and collects them as its own.
KIT_SOURCES = (KIT_MODULE, "cadence.testing.conformance_features")
# The node id of the kit's checks however they were collected, so that an author's output
# says whose check failed: cadence/testing/conformance.py::test_...[backend], never
# tests/test_conformance.py::test_... as if the author had written it.
KIT_NODE_ID = "cadence/testing/conformance.py"
_KIT_COLLECTED = pytest.StashKey[bool]()


@cache
def _kit_path() -> Path | None:
    spec = importlib.util.find_spec(KIT_MODULE)
    return Path(spec.origin).resolve() if spec is not None and spec.origin else None


def _is_kit_check(obj: object) -> bool:
    return (callable(obj) and getattr(obj, "__module__", None) in KIT_SOURCES
            and getattr(obj, "__name__", "").startswith("test_"))


class KitChecks(pytest.Module):
    """The kit's checks, collected under the kit's own node id (``KIT_NODE_ID``).

    Placed under the module that imported them, so that module's fixtures (a
    ``cadence_backend`` of its own, say) still apply; ``only`` keeps the checks it imported.
    """

    def __init__(self, *args: Any, only: frozenset[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.only = only

    def _getobj(self) -> Any:
        # By name, not by path: a path import could load a second copy under another name.
        return importlib.import_module(KIT_MODULE)

    def collect(self) -> list[Any]:
        found = super().collect()
        if self.only is None:
            return found
        return [node for node in found if getattr(node, "originalname", node.name) in self.only]


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> Any:
    # pytest --pyargs cadence.testing.conformance (or the kit's file named by path).
    if _kit_path() is not None and module_path.resolve() == _kit_path():
        return KitChecks.from_parent(parent, path=module_path, nodeid=KIT_NODE_ID)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Any:
    # A test module of the author's that imported the checks
    # (from cadence.testing.conformance import *): one KitChecks node holds them all.
    if (not _is_kit_check(obj) or isinstance(collector, KitChecks)
            or not isinstance(collector, pytest.Module)):
        return None
    if collector.stash.get(_KIT_COLLECTED, False):
        return []
    collector.stash[_KIT_COLLECTED] = True
    only = frozenset(v.__name__ for v in vars(collector.obj).values() if _is_kit_check(v))
    return KitChecks.from_parent(collector, path=_kit_path(), nodeid=KIT_NODE_ID, only=only)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cadence_conformance: a cadence backend conformance check")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # One run of every check per backend named (its name ends each id). Without a name the
    # fixture is left alone, so a test module may define its own ``cadence_backend``.
    names = backend_names(metafunc.config)
    if "cadence_backend" in metafunc.fixturenames and names:
        metafunc.parametrize("cadence_backend", names, indirect=True, scope="session")


@pytest.fixture(scope="session")
def cadence_backend(request: pytest.FixtureRequest) -> str:
    """The name of the backend under test."""
    if hasattr(request, "param"):
        return request.param
    names = backend_names(request.config)
    if not names:
        pytest.skip("no backend to check: pass --cadence-backend NAME")
    return names[0]


@pytest.fixture(scope="session")
def cadence_backend_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """``backend_options`` for the backend under test (``--cadence-backend-options``)."""
    raw = request.config.getoption("cadence_backend_options", None)
    options = json.loads(raw) if raw else {}
    if not isinstance(options, dict):
        raise pytest.UsageError("--cadence-backend-options must be a JSON object")
    return options


@pytest.fixture(scope="session")
def cadence_logprob_atol(request: pytest.FixtureRequest) -> float:
    value = request.config.getoption("cadence_logprob_atol", None)
    return 0.01 if value is None else value


@pytest.fixture(scope="session")
def cadence_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama with its tokenizer (built once per session, no hub)."""
    from cadence.testing.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("cadence-kit-model"))


# The window of the kit's sliding-window model: shorter than most of its prompts, so every
# layer's attention must leave the older keys out.
KIT_SLIDING_WINDOW = 24


@pytest.fixture(scope="session")
def cadence_window_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The kit's model as a Mistral attending to ``KIT_SLIDING_WINDOW`` tokens."""
    from cadence.testing.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("cadence-kit-window-model"),
                            sliding_window=KIT_SLIDING_WINDOW)


@pytest.fixture(scope="session")
def cadence_window_reference(cadence_window_model_dir: str) -> list[Any]:
    """The CPU backend's sync greedy outputs of the kit's workload on the window model."""
    from cadence.testing.helpers import run_workload

    llm = _make_llm(cadence_window_model_dir, REFERENCE_BACKEND,
                    disable_async_output_proc=True, backend_options={"overlap": "sync"})
    try:
        return run_workload(llm, "greedy")
    finally:
        llm.shutdown()


def _make_llm(model_dir: str, backend: str, **kwargs: Any) -> Any:
    from cadence import LLM

    return LLM(model=model_dir, backend=backend, **{**KIT_ENGINE_ARGS, **kwargs})


def _shared_llm(model_dir: str, backend: str, options: dict[str, Any],
                disable_async: bool) -> Iterator[Any]:
    llm = _make_llm(model_dir, backend, backend_options=options,
                    disable_async_output_proc=disable_async)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="session")
def cadence_llm(cadence_model_dir: str, cadence_backend: str,
                cadence_backend_options: dict[str, Any]) -> Iterator[Any]:
    """An ``LLM`` on the backend under test, async output processing on (the default)."""
    yield from _shared_llm(cadence_model_dir, cadence_backend, cadence_backend_options, False)


@pytest.fixture(scope="session")
def cadence_llm_sync(cadence_model_dir: str, cadence_backend: str,
                     cadence_backend_options: dict[str, Any]) -> Iterator[Any]:
    """The same, with ``disable_async_output_proc=True``."""
    yield from _shared_llm(cadence_model_dir, cadence_backend, cadence_backend_options, True)


@pytest.fixture(scope="session")
def cadence_reference(cadence_model_dir: str) -> dict[str, list[Any]]:
    """Greedy outputs of the CPU backend's sync strategy: the reference (``{"greedy": ...}``)."""
    from cadence.testing.helpers import run_workload

    llm = _make_llm(cadence_model_dir, REFERENCE_BACKEND, disable_async_output_proc=True,
                    backend_options={"overlap": "sync"})
    try:
        return {"greedy": run_workload(llm, "greedy")}
    finally:
        llm.shutdown()


@pytest.fixture(scope="session")
def cadence_reference_embeddings(cadence_model_dir: str) -> list[list[float]]:
    """The CPU backend's sync strategy's embeddings (the model's own pooling, normalized)
    of the kit's first three prompts: the reference for the embedding check."""
    from cadence.testing.helpers import PROMPTS

    llm = _make_llm(cadence_model_dir, REFERENCE_BACKEND, disable_async_output_proc=True,
                    backend_options={"overlap": "sync"})
    try:
        return [o.outputs.embedding for o in llm.embed(PROMPTS[:3], use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="session")
def cadence_lora_reference(cadence_model_dir: str, tmp_path_factory: pytest.TempPathFactory
                           ) -> tuple[list[Any], list[Any] | None]:
    """Two random LoRA adapters for the kit's model and the CPU backend's sync greedy
    outputs of the kit's LoRA workload (``helpers.lora_workload``); None for the outputs
    when the model's family takes no adapters."""
    from cadence import LoRARequest
    from cadence.lora.adapter import check_lora_architecture
    from cadence.testing.adapters import write_random_lora
    from cadence.testing.helpers import LORA_PARAMS, lora_workload

    try:
        check_lora_architecture(cadence_model_dir)
    except ValueError:
        return [], None
    folder = tmp_path_factory.mktemp("cadence-kit-lora")
    adapters = [
        LoRARequest("kit-qvd", 1, write_random_lora(cadence_model_dir, str(folder / "qvd"), 1,
                                                    8, ("q_proj", "v_proj", "down_proj"))),
        LoRARequest("kit-all", 2, write_random_lora(cadence_model_dir, str(folder / "all"), 2,
                                                    4))]
    llm = _make_llm(cadence_model_dir, REFERENCE_BACKEND, disable_async_output_proc=True,
                    backend_options={"overlap": "sync"}, enable_lora=True, max_loras=2)
    try:
        prompts, loras = lora_workload(adapters)
        return adapters, llm.generate(prompts, LORA_PARAMS, use_tqdm=False,
                                      lora_request=loras)
    finally:
        llm.shutdown()
