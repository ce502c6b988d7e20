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


def _without(model: str, dst, *keys: str, **changes) -> str:
    """A copy of ``model`` whose config.json lacks ``keys`` (and has ``changes``)."""
    import shutil

    from engine_helpers import edit_config_json

    shutil.copytree(model, dst)
    return edit_config_json(str(dst), drop=keys, **changes)


def test_a_config_without_max_position_embeddings_takes_transformers_default(
        tiny_model_dir, tmp_path):
    """transformers loads it with its config class's default (LlamaConfig: 2048); a
    model_type it does not know either is named, with the flag that sets the length."""
    model = _without(tiny_model_dir("llama"), tmp_path / "m", "max_position_embeddings")
    assert EngineArgs(model=model).create_engine_config().model_config.max_model_len == 2048
    assert EngineArgs(model=model, max_model_len=64).create_engine_config() \
        .model_config.max_model_len == 64
    odd = _without(tiny_model_dir("llama"), tmp_path / "odd", "max_position_embeddings",
                   max_position_embeddings=None)
    assert EngineArgs(model=odd).create_engine_config().model_config.max_model_len == 2048


def test_a_config_without_architectures_is_known_by_its_model_type(tiny_model_dir, tmp_path):
    """transformers' AutoModelForCausalLM picks the class from model_type; so does cadence,
    and a model_type it cannot load is refused before any backend starts."""
    from engine_helpers import make_llm

    from cadence import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = make_llm(tiny_model_dir("llama"))
    try:
        ref = want.generate(["hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        want.shutdown()
    model = _without(tiny_model_dir("llama"), tmp_path / "m", "architectures")
    llm = make_llm(model)
    try:
        got = llm.generate(["hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    assert got == ref
    odd = _without(tiny_model_dir("llama"), tmp_path / "odd", "architectures",
                   model_type="not-a-family")
    with pytest.raises(ValueError, match="config.json names no architectures, and its "
                                         "model_type 'not-a-family' is none cadence knows"):
        EngineArgs(model=odd).create_engine_config()
