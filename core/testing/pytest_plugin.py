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

The checks themselves are test functions in ``cadence.testing.conformance``. Run them with
``pytest --pyargs cadence.testing.conformance --cadence-backend NAME``, or put
``from cadence.testing.conformance import *`` in a test module of your own package and run
``pytest --cadence-backend NAME`` (docs/writing_a_backend.md).

NOTE this module is imported by every pytest run in an environment where cadence is
installed, so it imports nothing heavy: torch and the engine load inside the fixtures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cadence_conformance: a cadence backend conformance check")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # One run of every check per backend named on the command line. Without the option the
    # fixture is left alone, so a test module may define its own ``cadence_backend``.
    names = backend_names(metafunc.config)
    if "cadence_backend" in metafunc.fixturenames and len(names) > 1:
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
