"""Model families through the whole CUDA backend (on the CPU: interpreted Triton kernels,
graph padding, the side-stream copier, the fused MoE kernels; on a GPU: the same, compiled):
greedy tokens equal transformers' ``generate``.

As in tests/test_cuda_kernels.py, ``TRITON_INTERPRET=1`` is set before triton is first
imported when there is no GPU; one launch costs ~0.2 s there, so prompts stay short.
"""

from __future__ import annotations

import os

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from family_factory import FAMILIES, build_family_model, load_reference

from cadence import LLM, SamplingParams

PROMPTS = [[(7 * i + 3) % 600 + 2 for i in range(12)], [(5 * i + 11) % 600 + 2 for i in range(5)]]
NUM_TOKENS = 6


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cuda_backend_equals_transformers(name, tokenizer_dir, tmp_path, monkeypatch) -> None:
    """On the CPU with interpreted kernels; on a GPU with the compiled ones (float32 there
    too, against transformers on the CPU: TF32 stays off for matmuls by default)."""
    from cadence.backend import ProbeResult
    from cadence.backends.cuda import moe_kernels
    from cadence.backends.cuda.backend import CudaBackend

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        monkeypatch.setattr(CudaBackend, "probe",
                            classmethod(lambda cls: ProbeResult(True, "")))
    fused_calls = []  # the MoE families run the fused Triton kernels, not the expert loop
    fused = moe_kernels.fused_experts
    monkeypatch.setattr(moe_kernels, "fused_experts",
                        lambda *a, **kw: fused_calls.append(1) or fused(*a, **kw))
    model = build_family_model(name, tmp_path / "m", tokenizer_dir)
    hf = load_reference(model)
    want = [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS,
                        min_new_tokens=NUM_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]
    llm = LLM(model=model, backend="cuda", dtype="float32", max_model_len=64,
              num_kv_blocks=32, backend_options={"device": "cuda" if on_gpu else "cpu",
                                               "cuda_graph_max_bs": 4})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert bool(fused_calls) == (FAMILIES[name][0] in ("mixtral", "qwen2_moe", "qwen3_moe"))
    finally:
        llm.shutdown()


def test_triton_decode_soft_caps_like_the_torch_reference() -> None:
    """The interpreted decode kernel caps the scores as capped_attention does (Gemma 2)."""
    from cadence.backends.cuda.triton_kernels import paged_decode
    from cadence.layers.paged_attention import capped_attention

    dev = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    g = torch.Generator().manual_seed(0)
    h, kvh, d, n, bs, cap, scale = 4, 2, 16, 13, 4, 3.0, 0.4
    q = torch.randn(1, h, d, generator=g) * 2
    k = torch.randn(n, kvh, d, generator=g) * 2
    v = torch.randn(n, kvh, d, generator=g)
    blocks = -(-n // bs)
    kc, vc = torch.zeros(blocks * bs, kvh, d), torch.zeros(blocks * bs, kvh, d)
    kc[:n], vc[:n] = k, v
    table = torch.arange(blocks, dtype=torch.int32)[None]
    got = paged_decode(q.to(dev), kc.to(dev), vc.to(dev), table.to(dev),
                       torch.tensor([n], dtype=torch.int32, device=dev), bs, scale,
                       soft_cap=cap).cpu()
    want = capped_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0),
                            v.transpose(0, 1).repeat_interleave(2, 0),
                            torch.ones(1, n, dtype=torch.bool), scale, cap).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
