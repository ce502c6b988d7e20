"""Models as users name them: Hub ids through the Hugging Face cache, GGUF files converted
once, and folders without a tokenizer refused at start. Nothing here touches the network: the
Hub cache is laid out in a temporary folder the way huggingface_hub writes it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from engine_helpers import generate, make_llm
from gguf_helpers import write_llama_gguf

from cadence import EngineArgs, SamplingParams
from cadence.model_source import TOKENIZER_FILES, resolve_model_source

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, online mode, an unreachable endpoint."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    # Port 9 (discard) refuses at once: a download attempt fails fast and offline-safe.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    return cache


def _add_snapshot(cache: Path, repo_id: str, commit: str, source: str,
                  ref: str | None = "main") -> Path:
    """Copy ``source`` into the cache as ``repo_id`` at ``commit`` (with ``ref`` pointing at it)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_hub_id_resolves_from_cache_and_runs(hub_cache, tiny_model_dir):
    snapshot = _add_snapshot(hub_cache, "org/tiny-llama", COMMIT_A, tiny_model_dir("llama"))
    assert EngineArgs(model="org/tiny-llama").resolve_model() == str(snapshot)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (got,) = generate(make_llm("org/tiny-llama"), ["the cat"], params)
    (expected,) = generate(make_llm(tiny_model_dir("llama")), ["the cat"], params)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids


def test_revision_picks_branch_or_commit(hub_cache, tiny_model_dir):
    main = _add_snapshot(hub_cache, "org/m", COMMIT_A, tiny_model_dir("llama"))
    other = _add_snapshot(hub_cache, "org/m", COMMIT_B, tiny_model_dir("llama"), ref="v2")
    assert resolve_model_source("org/m") == str(main)
    assert resolve_model_source("org/m", revision="v2") == str(other)
    assert resolve_model_source("org/m", revision=COMMIT_B) == str(other)


def test_hub_id_not_cached_offline_says_so(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="not in the Hugging Face cache") as e:
        resolve_model_source("org/absent")
    assert "HF_HUB_OFFLINE=1 forbids a download" in str(e.value)
    assert str(hub_cache) in str(e.value)


def test_hub_id_not_cached_download_failure_gives_the_reason(hub_cache):
    with pytest.raises(ValueError, match="the download failed: ") as e:
        resolve_model_source("org/absent", revision="v1")
    msg = str(e.value)
    assert "'org/absent' (revision 'v1')" in msg and "not in the Hugging Face cache" in msg
    assert "ConnectError" in msg  # the network's reason, not only "not found locally"


def test_existing_path_shaped_like_hub_id_stays_local(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir("llama"), tmp_path / "models" / "tiny")
    assert resolve_model_source("models/tiny") == "models/tiny"
    with pytest.raises(ValueError, match="revision='v1' applies to Hub ids"):
        resolve_model_source("models/tiny", revision="v1")


def test_folder_without_tokenizer_names_the_files(tmp_path, tiny_model_dir):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir("llama"), folder,
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    with pytest.raises(ValueError, match="no tokenizer in") as e:
        EngineArgs(model=str(folder)).create_engine_config()
    assert all(name in str(e.value) for name in TOKENIZER_FILES)
    # A separate tokenizer folder is what the message suggests, and it works.
    config = EngineArgs(model=str(folder), tokenizer=tiny_model_dir("llama")).create_engine_config()
    assert config.model_config.tokenizer == tiny_model_dir("llama")


@pytest.fixture
def gguf_file(tmp_path, monkeypatch, tiny_model_dir) -> Path:
    pytest.importorskip("gguf")
    from cadence import gguf_model

    # Not CADENCE_CACHE_DIR: the CPU kernels are cached under it too, and would be rebuilt.
    monkeypatch.setattr(gguf_model, "cache_root", lambda: tmp_path / "cadence-cache")
    out = tmp_path / "ggufs" / "tiny-llama.gguf"
    out.parent.mkdir()
    write_llama_gguf(tiny_model_dir("llama"), out)
    return out


def test_gguf_greedy_equals_safetensors(gguf_file, tiny_model_dir, caplog):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["the cat runs over the", "café 中文 😀 and"]
    with caplog.at_level(logging.WARNING, logger="cadence.gguf_model"):
        converted = resolve_model_source(str(gguf_file))
    assert converted.startswith(str(gguf_file.parent.parent / "cadence-cache" / "gguf"))
    assert [r.getMessage() for r in caplog.records] == [
        f"converting {gguf_file} from GGUF into {converted} (once; later runs reuse it)"]
    expected = generate(make_llm(tiny_model_dir("llama")), prompts, params)
    got = generate(make_llm(str(gguf_file)), prompts, params)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in expected]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]


@pytest.mark.parametrize("kind", ["llama-rope-llama3", "llama-rope-yarn", "llama-rope-linear"])
def test_gguf_rope_scaling_survives_conversion(kind, tmp_path, monkeypatch, tiny_model_dir):
    """A GGUF's RoPE scaling, as llama.cpp's converter records it (Llama 3's as a
    rope_freqs tensor, linear and yarn as metadata), which transformers' GGUF loader leaves
    out: the converted model's prompt logprobs are the original folder's."""
    pytest.importorskip("gguf")
    from cadence import gguf_model

    monkeypatch.setattr(gguf_model, "cache_root", lambda: tmp_path / "cadence-cache")
    out = tmp_path / f"{kind}.gguf"
    write_llama_gguf(tiny_model_dir(kind), out)
    converted = json.loads((Path(resolve_model_source(str(out))) / "config.json").read_text())
    want = json.loads((Path(tiny_model_dir(kind)) / "config.json").read_text())
    assert converted["rope_parameters"] == want["rope_parameters"]
    prompt = {"prompt_token_ids": [(7 * i) % 300 + 3 for i in range(200)]}
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (got,) = generate(make_llm(str(out)), [prompt], params)
    (ref,) = generate(make_llm(tiny_model_dir(kind)), [prompt], params)
    for g, r in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
        (tg, lg), (tr, lr) = next(iter(g.items())), next(iter(r.items()))
        assert tg == tr and abs(lg.logprob - lr.logprob) < 1e-4


def test_gguf_rope_scaling_cadence_cannot_reproduce_is_refused(tmp_path, monkeypatch):
    """Divisors no Llama 3 scaling gives, and a scaling type cadence does not convert, are
    refused by name rather than run with the wrong positions."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from cadence.gguf_rope import gguf_rope_parameters, llama3_divisors

    def reader(divisors=None, **meta):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.gguf"
        w = gguf.GGUFWriter(str(out), "llama")
        for key, value in meta.items():
            getattr(w, f"add_{key}")(value)
        w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
        if divisors is not None:
            w.add_tensor("rope_freqs.weight", np.array(divisors, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return gguf.GGUFReader(str(out))

    real = llama3_divisors(500000.0, 128, 8.0, 1.0, 4.0, 8192)  # Llama 3.1's
    assert gguf_rope_parameters(reader(real), 500000.0, 128) == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert gguf_rope_parameters(reader([1.0] * 64), 500000.0, 128) is None
    assert gguf_rope_parameters(reader(), 500000.0, 128) is None
    bumpy = list(real)
    bumpy[40] *= 1.5
    with pytest.raises(ValueError, match="not Llama 3's RoPE scaling"):
        gguf_rope_parameters(reader(bumpy), 500000.0, 128)
    with pytest.raises(ValueError, match="RoPE scaling 'longrope'.*linear and yarn"):
        gguf_rope_parameters(reader(rope_scaling_type=gguf.RopeScalingType.LONGROPE,
                                    rope_scaling_factor=2.0), 10000.0, 64)
    # gguf 0.10 (the oldest the extra allows) has no ReaderField.contents(): the scaling
    # is read from the field's parts there.
    from types import SimpleNamespace

    from cadence.gguf_rope import _field

    yarn = reader(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0,
                  rope_scaling_orig_ctx_len=128)
    for key in ("general.architecture", "llama.rope.scaling.type",
                "llama.rope.scaling.factor", "llama.rope.scaling.original_context_length"):
        f = yarn.fields[key]
        old = SimpleNamespace(name=f.name, parts=f.parts, data=f.data, types=f.types)
        assert _field(SimpleNamespace(fields={key: old}), key) == _field(yarn, key)
    with pytest.raises(ValueError, match="yarn_log_multiplier"):
        gguf_rope_parameters(reader(rope_scaling_type=gguf.RopeScalingType.YARN,
                                    rope_scaling_factor=4.0,
                                    rope_scaling_yarn_log_mul=0.1), 10000.0, 64)


def test_gguf_folder_reuses_the_cached_conversion(gguf_file, caplog):
    first = resolve_model_source(str(gguf_file))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cadence.gguf_model"):
        assert resolve_model_source(str(gguf_file.parent)) == first
    assert caplog.records == []
    shutil.copy(gguf_file, gguf_file.with_name("other.gguf"))
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model_source(str(gguf_file.parent))


def test_one_cache_root_for_models_kernels_and_tunings(tmp_path, monkeypatch):
    from cadence import default_model, gguf_model
    from cadence.backends.cpu import kernels
    from cadence.backends.cpu import linear_choice as cpu_choice

    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path / "c"))
    assert gguf_model.cache_root() == tmp_path / "c" / "models"
    assert kernels.cache_root() == tmp_path / "c" / "kernels"
    assert cpu_choice._verdict_file() == tmp_path / "c" / "tuning" / "linear.json"
    assert default_model._cache_dir().parent == tmp_path / "c" / "models"
    monkeypatch.delenv("CADENCE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_model.cache_root() == tmp_path / "xdg" / "cadence" / "models"
    assert kernels.cache_root() == tmp_path / "xdg" / "cadence" / "kernels"
