"""Model families through the whole CUDA backend on the CPU (interpreted Triton kernels,
graph padding, the side-stream copier): greedy tokens equal transformers' ``generate``.

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

from family_factory import FAMILIES, build_family_model

from cadence import LLM, SamplingParams

PROMPTS = [[(7 * i + 3) % 600 + 2 for i in range(12)], [(5 * i + 11) % 600 + 2 for i in range(5)]]
NUM_TOKENS = 6
# Families the Triton kernels cannot run yet (attention soft-capping): refused at start-up.
CUDA_REFUSED = {"gemma2"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests cover this on a GPU")
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cuda_backend_code_on_cpu_equals_transformers(name, tokenizer_dir, tmp_path,
                                                      monkeypatch) -> None:
    from transformers import AutoModelForCausalLM

    from cadence.backend import ProbeResult
    from cadence.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))
    model = build_family_model(name, tmp_path / "m", tokenizer_dir)
    if name in CUDA_REFUSED:
        with pytest.raises(ValueError, match="needs soft_cap, which this backend's attention"):
            LLM(model=model, backend="cuda", dtype="float32", max_model_len=64,
                num_kv_blocks=32, backend_options={"device": "cpu"})
        return
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    want = [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS,
                        min_new_tokens=NUM_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in PROMPTS]
    llm = LLM(model=model, backend="cuda", dtype="float32", max_model_len=64,
              num_kv_blocks=32, backend_options={"device": "cpu", "cuda_graph_max_bs": 4})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()
