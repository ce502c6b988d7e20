"""A llama model folder written as a GGUF file, as llama.cpp's converter writes one, for the
tests of GGUF conversion (test_model_source.py) and of running its blocks
(test_quantization.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path


def _permute_rotary(w, num_heads: int):
    # llama.cpp's converter reorders q/k rows from HF's rotate-half layout to interleaved
    # pairs; transformers undoes it when reading a llama GGUF.
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _llama3_rope_freqs(rope: dict, head_dim: int):
    """llama.cpp's converter's ``rope_freqs`` tensor for Llama 3's scaling: each rotary
    frequency's divisor (its metadata keeps none of the four numbers)."""
    import numpy as np

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    orig = rope["original_max_position_embeddings"]
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_llama_gguf(model_dir: str, out_file: Path,
                     formats: Callable[[str], str | None] | None = None) -> None:
    """Write a llama safetensors folder (fp32) as llama.cpp would: its tensor names, rotary
    layout and metadata keys, with the byte-level BPE tokenizer as ``gpt2`` vocab + merges.
    ``formats(hf_name)`` names the block format a tensor is quantized to (Q8_0, Q4_0, Q4_1,
    Q5_0, Q5_1: those gguf-py can write), None to store it as fp32."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    tok = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out_file), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    kind = rope.get("rope_type", "default")
    if kind in ("linear", "yarn"):
        w.add_rope_scaling_type(getattr(gguf.RopeScalingType, kind.upper()))
        w.add_rope_scaling_factor(rope["factor"])
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab = {**tok["model"]["vocab"], **added}
    tokens = sorted(vocab, key=vocab.__getitem__)
    assert len(tokens) == cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in added else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    for name, tensor in load_file(str(Path(model_dir) / "model.safetensors")).items():
        tensor = tensor.astype(np.float32)
        if name.endswith("q_proj.weight"):
            tensor = _permute_rotary(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute_rotary(tensor, kv_heads)
        fmt = formats(name) if formats is not None and tensor.ndim == 2 else None
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if fmt is None:
            w.add_tensor(gguf_name, tensor)
        else:
            qtype = getattr(gguf.GGMLQuantizationType, fmt)
            w.add_tensor(gguf_name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(rope, cfg["head_dim"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
