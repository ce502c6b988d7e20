"""Sliding-window attention end to end: which layers a config windows (read as transformers
reads it), greedy output past the window equal to transformers' own ``generate`` on every
attention path, async on == off, chunked prefill and prefix-cache hits, and KV blocks freed
behind the window while a request runs.

The kernels themselves are checked in tests/test_sliding_window_kernels.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cadence import SamplingParams
from cadence.block_manager import FREED_BLOCK, BlockManager
from cadence.engine_args import EngineArgs
from cadence.model_limits import kv_window, layer_windows
from cadence.request import Request

_DROP = object()


def _variant(src: str, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    cfg_path.write_text(json.dumps(cfg))
    return str(dst)


# --------------------------------------------------------------------------------------------
# which layers attend to a window


@pytest.mark.parametrize(("cfg", "windows"), [
    ({"model_type": "mistral", "sliding_window": 32}, [32, 32]),
    ({"model_type": "mistral"}, [4096, 4096]),  # MistralConfig's default
    ({"model_type": "mistral", "sliding_window": None}, [None, None]),
    # Mistral ignores layer_types, as transformers' MistralModel does.
    ({"model_type": "mistral", "sliding_window": 32,
      "layer_types": ["full_attention", "full_attention"]}, [32, 32]),
    ({"model_type": "qwen2", "sliding_window": 32}, [None, None]),  # use_sliding_window off
    ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True,
      "max_window_layers": 1}, [None, 32]),
    ({"model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True,
      "max_window_layers": 0}, [32, 32]),
    ({"model_type": "qwen2", "use_sliding_window": True}, [None, None]),  # default 28 full
    ({"model_type": "qwen3", "sliding_window": 32, "use_sliding_window": True,
      "layer_types": ["sliding_attention", "full_attention"]}, [32, None]),
    ({"model_type": "qwen3", "sliding_window": 32, "use_sliding_window": False,
      "layer_types": ["sliding_attention", "full_attention"]}, [None, None]),
    ({"model_type": "llama", "sliding_window": 32,
      "layer_types": ["sliding_attention", "sliding_attention"]}, [None, None]),
])
def test_layer_windows_follow_transformers(cfg, windows) -> None:
    assert layer_windows({"num_hidden_layers": 2, **cfg}) == windows


@pytest.mark.parametrize(("model_type", "changes"), [
    ("mistral", {"sliding_window": 16}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16,
               "layer_types": ["full_attention", "sliding_attention"]}),
])
def test_layer_windows_equal_transformers_attention_modules(model_type, changes) -> None:
    """The windows transformers' own attention modules use (Mistral reads the config's)."""
    pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, num_hidden_layers=2, hidden_size=32,
                                  intermediate_size=32, num_attention_heads=2,
                                  num_key_value_heads=1, vocab_size=64, **changes)
    model = AutoModelForCausalLM.from_config(config)
    theirs = [getattr(layer.self_attn, "sliding_window", config.sliding_window)
              for layer in model.model.layers]
    assert layer_windows(config.to_dict()) == theirs


def test_only_an_all_windowed_model_frees_blocks() -> None:
    assert kv_window([16, 32]) == 32
    assert kv_window([16, None]) is None
    assert kv_window([None, None]) is None


@pytest.fixture(scope="module")
def mistral(tiny_model_dir) -> str:
    return tiny_model_dir("mistral")


def test_max_model_len_is_not_capped_at_the_window(mistral, tmp_path) -> None:
    model = _variant(mistral, tmp_path / "m", sliding_window=32)
    config = EngineArgs(model=model).create_engine_config()
    assert config.model_config.max_model_len == 512  # max_position_embeddings
    assert config.cache_config.sliding_window == 32
    config = EngineArgs(model=model, max_model_len=400).create_engine_config()
    assert config.model_config.max_model_len == 400


def test_a_mixed_model_keeps_every_block(tiny_model_dir, tmp_path) -> None:
    model = _variant(tiny_model_dir("qwen2"), tmp_path / "q", use_sliding_window=True,
                     sliding_window=16, max_window_layers=1, layer_types=_DROP)
    assert EngineArgs(model=model).create_engine_config().cache_config.sliding_window is None


# --------------------------------------------------------------------------------------------
# the block manager frees blocks behind the window


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=1000))


def test_blocks_behind_the_window_are_freed_and_keep_their_cache_identity() -> None:
    bm = BlockManager(32, 4, sliding_window=10)
    req = _request("a", 30)
    bm.allocate(req, 30)
    req.num_computed_tokens = 30
    bm.cache_full_blocks(req)  # registers the full blocks, then frees the dead ones
    # The next query (position 30) sees keys 21..30: blocks 0..4 (tokens 0..19) are dead.
    table = bm.get_block_table("a")
    assert table[:5] == [FREED_BLOCK] * 5 and len(table) == 8
    assert bm.num_free_blocks == 32 - 3
    bm.check_invariants()
    # The freed blocks stay in the prefix cache: the same prompt hits all of them, and takes
    # no reference on those behind its own window.
    other = _request("b", 30)
    assert bm.get_computed_blocks(other) == 28
    assert bm.get_block_table("b")[:4] == [FREED_BLOCK] * 4
    bm.check_invariants()
    bm.free(other)
    bm.free(req)
    bm.check_invariants()
    assert bm.num_free_blocks == 32


def test_nothing_is_freed_without_a_window() -> None:
    bm = BlockManager(16, 4)
    req = _request("a", 30)
    bm.allocate(req, 30)
    req.num_computed_tokens = 30
    bm.free_out_of_window(req)
    assert FREED_BLOCK not in bm.get_block_table("a")[1:] and bm.num_free_blocks == 8


# --------------------------------------------------------------------------------------------
# greedy output past the window equals transformers

WINDOW = 16
VARIANTS = {  # name -> (tiny model kind, config changes)
    "mistral": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-max-window-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW,
                                          "max_window_layers": 1, "layer_types": _DROP}),
    "qwen3-layer-types": ("qwen3", {"use_sliding_window": True, "sliding_window": 24,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
}
PROMPTS = [[(7 * i + 3) % 600 + 2 for i in range(40)], [(5 * i + 11) % 600 + 2 for i in range(5)],
           [(3 * i + 1) % 600 + 2 for i in range(23)]]
NUM_TOKENS = 48
# A cache with room for every prompt here at max_model_len=256 with nothing freed (3 * 64
# blocks of 4 tokens), so no test preempts unless it asks to. Left to the default, the cache
# is sized from free memory: a million blocks, whose bookkeeping costs seconds per engine
# and check_invariants (O(num_blocks)) a tenth of a second per call.
NUM_KV_BLOCKS = 256


@pytest.fixture(scope="module")
def windowed_model(tiny_model_dir, tmp_path_factory):
    """``windowed_model(name)`` -> the model folder of VARIANTS[name]."""
    built: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in built:
            kind, changes = VARIANTS[name]
            built[name] = _variant(tiny_model_dir(kind), tmp_path_factory.mktemp(name) / "m",
                                   **changes)
        return built[name]

    return make


@pytest.fixture(scope="module")
def windowed(windowed_model):
    """``windowed(name)`` -> (model folder, transformers' greedy tokens for PROMPTS)."""
    built: dict[str, tuple[str, list[list[int]]]] = {}

    def make(name: str) -> tuple[str, list[list[int]]]:
        if name not in built:
            import torch
            from transformers import AutoModelForCausalLM

            model = windowed_model(name)
            hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
            want = [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS,
                                min_new_tokens=NUM_TOKENS, do_sample=False)[0, len(p):].tolist()
                    for p in PROMPTS]
            built[name] = (model, want)
        return built[name]

    return make


def _greedy(model: str, prompts=PROMPTS, **kw) -> list[list[int]]:
    from engine_helpers import generate, make_llm

    llm = make_llm(model, num_kv_blocks=NUM_KV_BLOCKS, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = generate(llm, [{"prompt_token_ids": p} for p in prompts], params)
        bm = llm.engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_past_the_window_equals_transformers(windowed, name, attention) -> None:
    model, want = windowed(name)
    got = _greedy(model, backend_options={"overlap": "sync", "attention": attention},
                  block_size=4)
    assert got == want


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_chunked_prefill_and_a_prefix_hit(windowed, attention) -> None:
    """Chunks of 8 tokens (queries start mid-sequence) and a second run of the same prompts
    that hits the prefix cache; the first prompt's early blocks were freed behind the
    window during the first run and are still cached."""
    from engine_helpers import generate, make_llm

    model, want = windowed("mistral")
    llm = make_llm(model, block_size=4, max_num_batched_tokens=8, num_kv_blocks=NUM_KV_BLOCKS,
                   backend_options={"overlap": "sync", "attention": attention})
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    first = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, params)]
    bm = llm.engine.block_manager
    hits = bm.num_cached_hits
    second = [list(o.outputs[0].token_ids) for o in generate(llm, prompts, params)]
    assert bm.num_cached_hits > hits
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()
    assert first == want and second == want


def test_async_on_equals_off_under_preemption(windowed_model) -> None:
    """Seeded sampling and greedy, chunked prefill, and a cache small enough to preempt."""
    from engine_helpers import generate, make_llm, summarize

    model = windowed_model("mistral")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True,
                             logprobs=1) if i % 2 else
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
              for i in range(len(prompts))]
    results = []
    for off in (False, True):
        llm = make_llm(model, block_size=4, max_num_batched_tokens=8, num_kv_blocks=20,
                       disable_async_output_proc=off)
        results.append(summarize(generate(llm, prompts, params)))
        assert llm.engine.stats.num_preemptions > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        llm.shutdown()
    assert results[0] == results[1]


def test_blocks_in_use_stay_within_the_window(windowed_model) -> None:
    """One long request decoding far past the window holds a bounded number of blocks."""
    from engine_helpers import make_llm

    model = windowed_model("mistral")
    llm = make_llm(model, block_size=4, max_num_batched_tokens=8, num_kv_blocks=NUM_KV_BLOCKS)
    engine = llm.engine
    bm = engine.block_manager
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, bm.num_blocks - bm.num_free_blocks)
        bm.check_invariants()
    engine.step()  # the last output is finalized one step late with async output on
    # Keys from c + 1 - W through c + chunk - 1: 16 - 1 + 8 tokens over 4-token blocks, plus
    # one partial block; without freeing it would be (40 + 150) / 4 = 48.
    assert most <= (WINDOW - 1 + 8) // 4 + 2
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()


def test_mixed_layers_free_nothing(windowed_model) -> None:
    from engine_helpers import make_llm

    model = windowed_model("qwen2-max-window-layers")
    llm = make_llm(model, block_size=4, num_kv_blocks=NUM_KV_BLOCKS)
    engine = llm.engine
    bm = engine.block_manager
    engine.add_request("long", {"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, bm.num_blocks - bm.num_free_blocks)
    engine.step()
    assert most == 80 // 4  # the whole sequence stays: layer 0 reads all of it
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()


def test_hpu_emulation_greedy_past_the_window(windowed, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    model, want = windowed("mistral")
    got = _greedy(model, backend="hpu", block_size=4, max_num_batched_tokens=32,
                  max_model_len=128, max_num_seqs=4)
    assert got == want
