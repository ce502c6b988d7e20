"""The conformance kit and ``engine bench`` on the mixture-of-experts families.

Two kit checks (async output on == off, batch composition) on Qwen2-MoE, collected as a
third-party package collects the kit, and ``engine bench throughput`` on a Mixtral and a
Qwen2-MoE folder. The whole kit and ``engine bench compare`` on every family are run by
hand (docs/models.md); this module keeps the MoE share of the suite cheap. The kit once
found Qwen2-MoE's shared-expert gate batch-dependent; tests/test_moe.py pins that down
directly (a kit run shows it only after a cached-prefix run changes the batch shapes).
"""

from __future__ import annotations

import json

import pytest

from cadence.testing.conformance import (  # noqa: F401
    test_batch_composition_and_padding_do_not_change_outputs,
    test_overlap_on_equals_off,
)
from cadence.testing.pytest_plugin import (  # noqa: F401
    cadence_llm,
    cadence_llm_sync,
    cadence_logprob_atol,
)


@pytest.fixture(scope="session", params=["qwen2_moe"])  # the param names the kit's ids
def cadence_model_dir(request: pytest.FixtureRequest, tokenizer_dir: str,
                      tmp_path_factory: pytest.TempPathFactory) -> str:
    from family_factory import build_family_model

    return build_family_model(request.param, tmp_path_factory.mktemp(request.param),
                              tokenizer_dir)


@pytest.fixture(scope="session")
def cadence_backend() -> str:
    return "cpu"


@pytest.fixture(scope="session")
def cadence_backend_options() -> dict:
    return {"overlap": "sync"}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_engine_bench_throughput_runs_the_family(name, tokenizer_dir, tmp_path) -> None:
    from family_factory import build_family_model

    from cadence.cli.main import main

    model = build_family_model(name, tmp_path / "m", tokenizer_dir)
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", model, "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "4", "--disable-tqdm",
                 "--cpu-kv-cache-gb", "0.05", "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["num_prompts"] == 2 and data["num_output_tokens"] == 8
    assert data["output_tokens_per_s"] > 0
