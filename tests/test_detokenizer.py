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
    # Of stop strings one token completes, the one that ends first wins (vLLM's rule), even
    # where another starts earlier; equal ends go to the first in the list.
    assert find_stop_string(" Father", 7, ["Father", "ath"]) == ("ath", 2)
    assert find_stop_string(" Father", 7, ["her", "r"]) == ("her", 4)
    assert find_stop_string(" Father", 7, ["r", "her"]) == ("r", 6)


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


@pytest.fixture(scope="module")
def wordpiece():
    """A WordPiece tokenizer, whose decoder joins tokens with spaces: a decode stream puts
    one before an added token that follows another, which spaces_between_special_tokens
    takes out."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(["the cat sat on the mat"] * 20,
                            trainers.WordPieceTrainer(vocab_size=60, special_tokens=["[UNK]"]))
    tok.add_tokens([AddedToken("<a>", special=True), AddedToken("<b>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


def test_spaces_between_special_tokens_false_joins_consecutive_added_tokens(wordpiece):
    ids = wordpiece.encode("the cat <a><b><a> sat", add_special_tokens=False)
    prompt = wordpiece.encode("on the mat", add_special_tokens=False)

    def text(skip: bool, spaces: bool) -> str:
        d = IncrementalDetokenizer(wordpiece, prompt, skip, spaces)
        return "".join(d.step(t) for t in ids)

    spaced = text(False, True)
    assert spaced == " the cat <a> <b> <a> sat"  # the decoder's spaces, as a decode gives
    assert text(False, False) == " the cat <a><b><a> sat"
    # With special tokens skipped there is nothing between them to space.
    assert text(True, False) == text(True, True) == " the cat sat"


def test_a_broken_decode_stream_is_replaced_and_the_text_goes_on(tokenizer):
    """tokenizers' DecodeStream can refuse a step ("invalid prefix") and keep a broken
    state; the detokenizer starts a fresh stream for that token, as vLLM does."""
    ids = tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    real = detok._stream

    class Breaks:
        def step(self, backend, token):
            raise RuntimeError("Invalid prefix encountered")

    out = [detok.step(ids[0])]
    detok._stream = Breaks()
    out += [detok.step(t) for t in ids[1:]]
    assert detok._stream is not real and not isinstance(detok._stream, Breaks)
    assert out[1] == tokenizer.decode([ids[1]])  # the fresh stream decodes it alone
    assert "".join(out) == tokenizer.decode(ids)


def test_the_engine_and_the_server_honour_spaces_between_special_tokens(
        wordpiece, tiny_model_dir, tmp_path):
    """The option reaches a request's detokenizer: a model whose tokenizer spaces its added
    tokens, made to write only them (allowed_token_ids)."""
    import shutil

    from engine_helpers import generate, make_llm

    from cadence import SamplingParams

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama"), model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    wordpiece.save_pretrained(model)
    a, b = wordpiece.convert_tokens_to_ids(["<a>", "<b>"])
    base = SamplingParams(temperature=0.0, max_tokens=4, allowed_token_ids=[a, b],
                          skip_special_tokens=False)
    llm = make_llm(str(model))
    try:
        spaced, joined = (generate(llm, ["the cat"], SamplingParams(**{
            **{f: getattr(base, f) for f in base.__dataclass_fields__},
            "spaces_between_special_tokens": s}))[0].outputs[0] for s in (True, False))
    finally:
        llm.shutdown()
    assert spaced.token_ids == joined.token_ids
    # The first follows the prompt's word, so its space stays either way.
    tokens = wordpiece.convert_ids_to_tokens(joined.token_ids)
    assert joined.text == " " + "".join(tokens)
    assert spaced.text == " " + " ".join(tokens)
    pytest.importorskip("httpx", reason="the server part needs httpx (the test extra)")
    from test_server import serve

    async def body(client, engine):
        return await client.post("/v1/completions", json={
            "prompt": "the cat", "max_tokens": 4, "temperature": 0,
            "allowed_token_ids": [a, b], "skip_special_tokens": False,
            "spaces_between_special_tokens": False})

    r = serve(str(model), body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == joined.text, r.text


def test_a_logprob_token_text_keeps_its_word_space_on_sentencepiece_tokenizers(tmp_path):
    """SentencePiece's decoder drops the space a word's first piece stands for when the
    piece is decoded alone; a logprob's text keeps it (vLLM's), so the tokens' texts join
    up to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from cadence.detokenizer import token_text_decoder

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["the cat sat on the mat", "hello world the end"] * 50,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    ids = fast.encode("the cat sat on the mat", add_special_tokens=False)
    assert fast.decode([ids[1]]) == fast.decode([ids[1]]).lstrip()  # the decoder drops it
    texts = [token_text_decoder(fast)(i) for i in ids]
    assert "".join(texts) == " the cat sat on the mat" and texts[1].startswith(" ")


@pytest.mark.parametrize("text", RARE)
def test_a_token_holding_part_of_a_character_reads_what_it_completes(tokenizer, text):
    """vLLM's logprob text for such a token: the character it completes after the tokens
    before it (with what they began of it), or "" while it completes none."""
    from cadence.detokenizer import complete_partial_token

    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = []
    for i, t in enumerate(ids):
        alone = tokenizer.decode([t])
        pieces.append(complete_partial_token(tokenizer, t, ids[max(0, i - 4):i])
                      if alone.endswith("\ufffd") else alone)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
