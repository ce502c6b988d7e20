"""Model families beyond Llama, exact against transformers: tiny random-weight models built
from transformers' config classes with each family's distinctive options on
(tests/family_factory.py).

- the model alone (a dense reference attention) gives transformers' logits;
- through the engine, greedy tokens equal transformers' own ``generate`` over prompts of a
  few dozen tokens, with the CPU backend's compiled kernels and with its torch path;
- async output processing on == off with seeded sampling and chunked prefill;
- the HPU backend's emulation gives the same greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_factory import FAMILIES, build_family_model, load_reference

from cadence import SamplingParams
from cadence.config import ModelConfig
from cadence.forward_context import set_forward_context
from cadence.model_loader import load_model
from cadence.models import supported_architectures

PROMPTS = [[(7 * i + 3) % 600 + 2 for i in range(40)], [(5 * i + 11) % 600 + 2 for i in range(5)],
           [(3 * i + 1) % 600 + 2 for i in range(23)]]
NUM_TOKENS = 32
NAMES = sorted(FAMILIES)


class DenseAttention:
    """Reference AttentionImpl: causal SDPA per sequence of a packed batch, no cache; takes
    every attention feature a family may pass."""

    def forward(self, layer_idx: int, q, k, v, metadata: list[int],
                sliding_window: int | None = None, scale: float | None = None,
                soft_cap: float | None = None):
        outs, start = [], 0
        for n in metadata:
            qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [H, S, D]
            i = torch.arange(n)
            mask = i[None, :] <= i[:, None]
            if sliding_window is not None:
                mask &= i[None, :] > i[:, None] - sliding_window
            if soft_cap is not None:
                group = qs.shape[0] // ks.shape[0]
                ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
                scores = qs @ ks.transpose(1, 2) * (scale or qs.shape[-1] ** -0.5)
                scores = (torch.tanh(scores / soft_cap) * soft_cap).masked_fill(~mask, -1e30)
                out = torch.softmax(scores, dim=-1) @ vs
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
            outs.append(out.transpose(0, 1))
            start += n
        return torch.cat(outs)


@pytest.fixture(scope="module")
def family(tokenizer_dir, tmp_path_factory):
    """``family(name)`` -> (model folder, transformers' greedy tokens for PROMPTS)."""
    built: dict[str, tuple[str, list[list[int]]]] = {}

    def make(name: str) -> tuple[str, list[list[int]]]:
        if name not in built:
            path = build_family_model(name, tmp_path_factory.mktemp(name), tokenizer_dir)
            hf = load_reference(path)
            want = [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS,
                                min_new_tokens=NUM_TOKENS, do_sample=False)[0, len(p):].tolist()
                    for p in PROMPTS]
            built[name] = (path, want)
        return built[name]

    return make


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers(family, name) -> None:
    path, _ = family(name)
    with open(f"{path}/config.json") as f:
        assert json.load(f)["architectures"][0] in supported_architectures()
    # 256: within Phi-3's original_max_position_embeddings, so LongRoPE's short factors.
    ours, _ = load_model(ModelConfig(model=path, max_model_len=256))
    hf = load_reference(path)
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    with torch.no_grad():
        with set_forward_context(DenseAttention(), [len(p) for p in PROMPTS]):
            logits = ours.compute_logits(ours(ids, positions))
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert logits.dtype == torch.float32
    # Larger weights than usual make larger logits: the last bits differ by more.
    torch.testing.assert_close(logits, want, atol=5e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def _greedy(model: str, **kw) -> list[list[int]]:
    from engine_helpers import generate, make_llm

    llm = make_llm(model, **kw)
    try:
        # min_tokens, as transformers' min_new_tokens: EOS is banned, not just ignored.
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
        outs = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers(family, name, attention) -> None:
    model, want = family(name)
    got = _greedy(model, block_size=4,
                  backend_options={"overlap": "sync", "attention": attention})
    assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_async_on_equals_off(family, name) -> None:
    """Seeded sampling and greedy side by side, prompts cut into 8-token chunks."""
    from engine_helpers import generate, make_llm, summarize

    model, _ = family(name)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS * 2]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True,
                             logprobs=1) if i % 2 else
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    results = []
    for off in (False, True):
        llm = make_llm(model, block_size=4, max_num_batched_tokens=8,
                       disable_async_output_proc=off)
        results.append(summarize(generate(llm, prompts, params)))
        llm.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("name", NAMES)
def test_hpu_emulation_greedy(family, name, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    model, want = family(name)
    got = _greedy(model, backend="hpu", block_size=4, max_num_batched_tokens=64,
                  max_model_len=128, max_num_seqs=4)
    assert got == want


@pytest.mark.parametrize(("name", "rename"), [
    # The original GPT-2 checkpoints name the body bare (h.0..., wte) and store the masks.
    ("gpt2-layer-scaled", lambda n: n.removeprefix("transformer.")),
    # Pythia's checkpoints call the head embed_out.
    ("gpt_neox", lambda n: "embed_out.weight" if n == "lm_head.weight" else n),
])
def test_older_checkpoint_names_load(family, name, rename) -> None:
    from cadence.model_loader import iterate_weights

    path, _ = family(name)
    ours, _ = load_model(ModelConfig(model=path, max_model_len=512))
    renamed, _ = load_model(ModelConfig(model=path, max_model_len=512))
    extra = [("h.0.attn.bias", torch.ones(1, 1, 8, 8))] if name.startswith("gpt2") else \
        [("gpt_neox.layers.0.attention.masked_bias", torch.tensor(-1e9))]
    renamed.load_weights([(rename(n), t) for n, t in iterate_weights(path)] + extra)
    for (n, a), (_, b) in zip(ours.state_dict().items(), renamed.state_dict().items(),
                              strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="unexpected weights"):
        renamed.load_weights([("transformer.h.0.attn.nonsense", torch.zeros(1))])


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_longrope_long_factors_past_the_original_context(family, attention) -> None:
    """max_model_len past original_max_position_embeddings (256) takes LongRoPE's long
    factors for every position; transformers takes them for a prompt that long too."""
    path, _ = family("phi3")
    prompt = [(11 * i + 5) % 600 + 2 for i in range(300)]
    hf = load_reference(path)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                       do_sample=False)[0, len(prompt):].tolist()
    from engine_helpers import make_llm

    llm = make_llm(path, max_model_len=512, backend_options={"overlap": "sync",
                                                             "attention": attention})
    try:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == want
    finally:
        llm.shutdown()


def test_phi3_windows_every_layer_when_set() -> None:
    from cadence.model_limits import layer_windows

    assert layer_windows({"model_type": "phi3", "num_hidden_layers": 2,
                          "sliding_window": 16}) == [16, 16]
    assert layer_windows({"model_type": "phi3", "num_hidden_layers": 2,
                          "sliding_window": None}) == [None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_first_rms_norm_matches_olmo2_bit_for_bit(dtype) -> None:
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from cadence.layers.norm import RMSNormWeightFirst

    theirs, ours = Olmo2RMSNorm(64, eps=1e-6).to(dtype), RMSNormWeightFirst(64, 1e-6).to(dtype)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.1)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    assert torch.equal(ours(x), theirs(x))


def test_a_backend_without_a_feature_refuses_the_model() -> None:
    """An AttentionImpl that predates the scale keyword fails naming it, instead of
    attending with head_dim ** -0.5; models that need no feature still run on it."""
    from cadence.layers.attention import attend, attention_features

    class OldAttention:
        def forward(self, layer_idx, q, k, v, metadata, sliding_window=None):
            return q

    q = torch.zeros(2, 4, 16)
    assert attention_features(16, scale=0.25) == {}  # the default scale is not passed
    with set_forward_context(OldAttention(), None):
        assert attend(0, q, q, q, attention_features(16)) is q
        with pytest.raises(NotImplementedError, match="scale=0.1"):
            attend(0, q, q, q, attention_features(16, scale=0.1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_soft_cap_like_the_torch_reference(ops, dtype) -> None:
    """The compiled decode and prefill kernels cap the scores as capped_attention does."""
    from cadence.layers.paged_attention import capped_attention

    g = torch.Generator().manual_seed(0)
    h, kvh, d, n, bs, cap, scale = 4, 2, 16, 37, 4, 3.0, 0.4
    q = torch.randn(n, h, d, generator=g).to(dtype) * 2
    k = torch.randn(n, kvh, d, generator=g).to(dtype) * 2
    v = torch.randn(n, kvh, d, generator=g).to(dtype)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    want = capped_attention(q.float().transpose(0, 1), k.float().transpose(0, 1)
                            .repeat_interleave(2, 0), v.float().transpose(0, 1)
                            .repeat_interleave(2, 0), mask, scale, cap).transpose(0, 1)
    out = torch.empty_like(q)
    ops.prefill_attention(q, k, v, out, torch.tensor([0]), torch.tensor([n]), scale, 0, cap)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    blocks = -(-n // bs)
    kc = torch.zeros(blocks * bs, kvh, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc[:n], vc[:n] = k, v
    table = torch.arange(blocks, dtype=torch.int32)[None]
    last = ops.paged_decode_attention(q[-1:], kc.view(blocks, bs, kvh, d),
                                      vc.view(blocks, bs, kvh, d), table,
                                      torch.tensor([n], dtype=torch.int32), scale, 0, cap)
    torch.testing.assert_close(last.float(), want[-1:], atol=tol, rtol=tol)
    assert not torch.allclose(last.float(), torch.nn.functional.scaled_dot_product_attention(
        q[-1:].float().transpose(0, 1), k.float().transpose(0, 1).repeat_interleave(2, 0),
        v.float().transpose(0, 1).repeat_interleave(2, 0), scale=scale).transpose(0, 1),
        atol=1e-3)  # the cap changed the output
