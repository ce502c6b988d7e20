"""How long a context a model allows: max_position_embeddings, stretched by YaRN or dynamic
NTK RoPE scaling as vLLM reads it; past the trained positions output still equals
transformers' cached generate."""

from __future__ import annotations

import pytest

from cadence.engine_args import EngineArgs


@pytest.mark.parametrize(("kind", "longest"), [
    ("llama", 512),               # no scaling
    ("llama-rope-linear", 512),   # linear scaling is not a longer context
    ("llama-rope-dynamic", 1024),  # 512 x factor 2
    ("llama-rope-yarn", 512),     # original 128 x factor 4
])
def test_the_longest_context_follows_rope_scaling(tiny_model_dir, kind, longest):
    model = tiny_model_dir(kind)
    cfg = EngineArgs(model=model, max_model_len=longest).create_engine_config()
    assert cfg.model_config.max_model_len == longest
    with pytest.raises(ValueError, match=f"larger than the model allows.*{longest}"):
        EngineArgs(model=model, max_model_len=longest + 1).create_engine_config()


def test_dynamic_ntk_past_the_trained_positions_equals_transformers(tiny_model_dir):
    pytest.importorskip("torch")
    from engine_helpers import greedy_pair

    model = tiny_model_dir("llama-rope-dynamic")
    prompt = [(13 * i) % 400 + 5 for i in range(500)]  # fits in the 512 trained positions
    got, want = greedy_pair(model, prompt, 40, max_model_len=600)
    assert got == want
