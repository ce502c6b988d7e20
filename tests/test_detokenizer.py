"""Incremental detokenization and stop-string search (no model needed)."""

from __future__ import annotations

import pytest

from cadence.detokenizer import IncrementalDetokenizer, find_stop_string

TEXTS = ["café résumé naïve", "中文 text and more 中文", "emoji 😀 then 🎉 end",
         "plain ascii words only"]
# Characters the test tokenizer never saw in training: byte-level BPE splits them into bytes.
RARE = ["Жизнь ℵ ŵ", "𝔘𝔫𝔦 ➿ ok"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.mark.parametrize("text", TEXTS + RARE)
@pytest.mark.parametrize("fast", [True, False])
def test_incremental_text_equals_decode_even_when_characters_split(tokenizer, text, fast):
    prompt = tokenizer.encode("the cat says", add_special_tokens=False)
    ids = tokenizer.encode(" " + text, add_special_tokens=False)
    # The test tokenizer's byte-level BPE must really split some character over tokens,
    # or this test would prove nothing.
    pieces = [tokenizer.decode([i]) for i in ids]
    if text in RARE:
        assert any("\ufffd" in p for p in pieces)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    if not fast:
        detok._stream = None  # force the prefix/read-offset path
        detok._ids, detok._read_offset = list(prompt), len(prompt)
        detok._prefix_offset = max(len(prompt) - 6, 0)
    out = [detok.step(t) for t in ids]
    assert "".join(out) == tokenizer.decode(ids)
    assert not any("\ufffd" in piece for piece in out)


def test_find_stop_string_searches_only_the_new_tail():
    text = "hello world, stop here"
    assert find_stop_string(text, 4, ["here"]) == ("here", 18)
    assert find_stop_string(text, 4, ["hello"]) is None  # ended before the new text
    # A stop string straddling old and new text is found.
    assert find_stop_string("abcSTO" + "P!", 2, ["STOP"]) == ("STOP", 3)
    # The earliest match wins when several end in the new text.
    assert find_stop_string("xx ab cd", 5, ["cd", "ab"]) == ("ab", 3)


def test_token_text_decoder_equals_decode_for_every_id(tokenizer):
    from cadence.detokenizer import token_text_decoder

    assert not tokenizer.clean_up_tokenization_spaces  # else the fast path is not taken
    fast = token_text_decoder(tokenizer)
    assert fast.__code__ is not token_text_decoder(_SlowOnly(tokenizer)).__code__
    for i in range(len(tokenizer)):  # special tokens included: logprobs show them too
        assert fast(i) == tokenizer.decode([i]), i


class _SlowOnly:
    """A tokenizer without a Rust backend, or one that cleans up spaces after decoding."""

    def __init__(self, tok, clean_up: bool = False):
        self.tok, self.clean_up_tokenization_spaces = tok, clean_up

    def decode(self, ids):
        return "<" + self.tok.decode(ids) + ">"


def test_token_text_decoder_keeps_the_wrapper_where_it_differs(tokenizer):
    from cadence.detokenizer import token_text_decoder

    class CleansUp(_SlowOnly):
        _tokenizer = tokenizer._tokenizer

    for tok in (_SlowOnly(tokenizer), CleansUp(tokenizer, clean_up=True)):
        assert token_text_decoder(tok)(5) == "<" + tokenizer.decode([5]) + ">"


def test_token_text_decoder_keeps_a_class_that_rewrites_decoded_text(tokenizer):
    import copy

    from cadence.detokenizer import token_text_decoder

    class Rewrites(type(tokenizer)):  # as CPM's fast tokenizer maps a placeholder to a space
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).replace("a", "@")

    tok = copy.copy(tokenizer)
    tok.__class__ = Rewrites
    ids = [i for i in range(len(tokenizer)) if "a" in tokenizer.decode([i])][:5]
    assert ids
    decode = token_text_decoder(tok)
    assert [decode(i) for i in ids] == [tok.decode([i]) for i in ids]
    assert all("@" in decode(i) for i in ids)
