"""Hugging Face transformers baselines on the same prompts: static-batch ``generate`` and
continuous batching ``generate_batch``; and a helper that builds a small random-weight model
(for the model-size sweep, where host work dominates).

Throughput counts the *requested* output tokens (as vLLM's benchmark does for HF): a static
batch runs to its longest output length, and the extra tokens of shorter requests are waste.
"""

from __future__ import annotations

import time
from typing import Any

_TORCH_DTYPES = ("float32", "bfloat16", "float16")


def load_hf_model(model_dir: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    return model


def _generation_kwargs(temperature: float) -> dict[str, Any]:
    if temperature <= 0:
        return {"do_sample": False}
    # top_k=0 disables HF's default top-k of 50, matching the engine's unfiltered sampling.
    return {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}


def run_hf_generate(model: Any, prompts: list[list[int]], out_lens: list[int],
                    batch_size: int, temperature: float, progress: bool = False
                    ) -> dict[str, Any]:
    """``model.generate`` on static batches of ``batch_size`` prompts, padded on the left."""
    import torch

    pad = model.config.pad_token_id
    if pad is None:
        pad = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(prompts), desc="hf_generate", dynamic_ncols=True)
    computed = 0
    start = time.perf_counter()
    for g0 in range(0, len(prompts), batch_size):
        group = prompts[g0:g0 + batch_size]
        n_new = max(out_lens[g0:g0 + batch_size])
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new,
                                 min_new_tokens=n_new, pad_token_id=pad,
                                 **_generation_kwargs(temperature))
        computed += (out.shape[1] - width) * len(group)
        if bar is not None:
            bar.update(len(group))
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return _record("hf_generate", prompts, sum(out_lens), elapsed, batch_size,
                   num_computed_tokens=computed)


def run_hf_generate_batch(model: Any, prompts: list[list[int]], out_lens: list[int],
                          batch_size: int, temperature: float, progress: bool = False
                          ) -> dict[str, Any]:
    """transformers' continuous batching, sized explicitly (auto-sizing costs ~6 s per call).

    It has one ``max_new_tokens`` for all requests; EOS is disabled so that every request
    runs to it, and the throughput counts the tokens it actually returned, capped per request
    at the requested length.
    """
    from transformers import GenerationConfig

    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers version has no generate_batch")
    n_new = max(out_lens)
    page = 256
    per_req = -(-(max(len(p) for p in prompts) + n_new) // page)
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=per_req * min(batch_size, len(prompts)) + 2,
        max_batch_tokens=max(256, min(2048, sum(len(p) for p in prompts))),
        max_requests_per_batch=batch_size, allow_block_sharing=False)
    gen = GenerationConfig(max_new_tokens=n_new, eos_token_id=None, pad_token_id=0,
                           **_generation_kwargs(temperature))
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen,
                                   continuous_batching_config=cb, progress_bar=progress)
    elapsed = time.perf_counter() - start
    lens = [len(r.generated_tokens) for r in results.values()]
    if len(lens) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(lens)} of {len(prompts)} results")
    useful = sum(min(n, want) for n, want in zip(lens, out_lens))
    return _record("hf_generate_batch", prompts, useful, elapsed, batch_size,
                   num_computed_tokens=sum(lens))


def _record(name: str, prompts: list[list[int]], num_out: int, elapsed: float,
            batch_size: int, **extra: Any) -> dict[str, Any]:
    num_in = sum(len(p) for p in prompts)
    return {
        "name": name, "batch_size": batch_size, "num_prompts": len(prompts),
        "num_input_tokens": num_in, "num_output_tokens": num_out, "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed, **extra,
    }


def make_small_model(source_dir: str, out_dir: str, num_layers: int = 4,
                     hidden_size: int = 128, seed: int = 0, num_experts: int = 0,
                     experts_per_token: int = 2) -> str:
    """A random-weight Llama with ``source_dir``'s tokenizer and vocabulary, shrunk in depth
    and width: the same host work per token with a tiny fraction of the forward cost.

    ``num_experts`` > 0 makes it a Qwen3-MoE instead (every layer sparse, top
    ``experts_per_token`` renormalized, each expert 3/8 of the hidden size wide, Qwen3-30B-
    A3B's proportion): a model to compare the ways of splitting experts over ranks."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = AutoConfig.from_pretrained(source_dir).to_dict()
    src.pop("quantization_config", None)
    heads = max(1, hidden_size // 64)
    src.update(num_hidden_layers=num_layers, hidden_size=hidden_size,
               intermediate_size=hidden_size * 3, num_attention_heads=heads,
               num_key_value_heads=heads, head_dim=hidden_size // heads,
               architectures=["LlamaForCausalLM"], model_type="llama")
    torch.manual_seed(seed)
    if num_experts > 0:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        if not 1 <= experts_per_token <= num_experts:
            raise ValueError(f"experts_per_token must be in [1, {num_experts}], got "
                             f"{experts_per_token}")
        src.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                   num_experts=num_experts, num_experts_per_tok=experts_per_token,
                   moe_intermediate_size=hidden_size * 3 // 8, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(src)).to(torch.float32)
    else:
        model = LlamaForCausalLM(LlamaConfig.from_dict(src)).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(out_dir)
    for name in ("generation_config.json",):
        import shutil
        from pathlib import Path

        if (Path(source_dir) / name).is_file():
            shutil.copy(Path(source_dir) / name, Path(out_dir) / name)
    return out_dir
