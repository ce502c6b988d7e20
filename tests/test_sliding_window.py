"""Models with sliding-window attention: cadence attends to the whole context, so it runs
them only where that is exact (no sequence longer than the window), and says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cadence.engine_args import EngineArgs


def _variant(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def mistral(tiny_model_dir) -> str:
    return tiny_model_dir("mistral")


def test_a_default_length_is_capped_at_the_window(mistral, tmp_path, capsys):
    model = _variant(mistral, tmp_path / "m", sliding_window=32)
    config = EngineArgs(model=model).create_engine_config()
    assert config.model_config.max_model_len == 32
    assert "capped at the model's sliding attention window (32 tokens)" in \
        capsys.readouterr().out


def test_a_longer_explicit_length_is_refused(mistral, tmp_path):
    model = _variant(mistral, tmp_path / "m", sliding_window=32)
    with pytest.raises(ValueError, match=r"--max-model-len 32 or less"):
        EngineArgs(model=model, max_model_len=64).create_engine_config()
    assert EngineArgs(model=model, max_model_len=24).create_engine_config() \
        .model_config.max_model_len == 24


@pytest.mark.parametrize(("changes", "windowed"), [
    ({"sliding_window": None}, False),
    ({"sliding_window": 32, "use_sliding_window": False}, False),  # Qwen2's switch
    ({"sliding_window": 32, "use_sliding_window": True}, True),
    ({"sliding_window": 32, "layer_types": ["full_attention"] * 2}, False),
    ({"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]}, True),
])
def test_which_configs_attend_to_a_window(mistral, tmp_path, changes, windowed):
    model = _variant(mistral, tmp_path / "m", **changes)
    max_len = EngineArgs(model=model).create_engine_config().model_config.max_model_len
    assert (max_len == 32) == windowed


def test_greedy_within_the_window_equals_transformers(mistral, tmp_path):
    """Inside the window full attention is the window's attention: same greedy tokens."""
    pytest.importorskip("torch")
    from engine_helpers import greedy_pair

    model = _variant(mistral, tmp_path / "m", sliding_window=48)
    got, want = greedy_pair(model, list(range(10, 30)), 28, max_model_len=48)
    assert got == want
