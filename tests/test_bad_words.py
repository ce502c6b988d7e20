"""``SamplingParams.bad_words`` (vLLM's field): a word's completing token is banned where
the output's last tokens begin it, so the output never holds the word's token sequence; a
one-token word is never sampled; the outputs are the same with async scheduling (where the
newest token is still on the device when the next step is planned), on the worker process,
the emulated HPU (the CUDA backend's CPU mode: tests/test_cuda_async_scheduling.py); bad
values are refused."""

from __future__ import annotations

import pytest
from engine_helpers import generate, make_llm, summarize

from cadence import SamplingParams
from cadence.request_intake import bad_words_token_ids

PROMPTS = [[5, 9, 11, 40, 2, 7], [3, 4, 100, 8, 8], [42, 17]]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _contains(seq: list[int], sub: tuple[int, ...]) -> bool:
    return any(tuple(seq[i:i + len(sub)]) == sub for i in range(len(seq) - len(sub) + 1))


@pytest.fixture(scope="module")
def words(model):
    """Bad words made of pieces of the unconstrained greedy outputs (two-token words whose
    tokenization is what the output holds, and one one-token word), and those outputs."""
    llm = make_llm(model)
    try:
        tok = llm.get_tokenizer()
        plain = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS],
                         SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        chosen: list[str] = []
        for out in plain:
            ids = out.outputs[0].token_ids
            for i in range(2, len(ids) - 1):
                word = tok.decode(ids[i:i + 2])
                if word.strip() and tuple(ids[i:i + 2]) in bad_words_token_ids(tok, [word]):
                    chosen.append(word)
                    break
        one = tok.decode(plain[2].outputs[0].token_ids[:1])
        assert len(chosen) >= 2, "no two-token word round-trips through the tokenizer"
        return chosen + [one], plain, bad_words_token_ids(tok, chosen + [one])
    finally:
        llm.shutdown()


PARAMS = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=4, max_tokens=16, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2, seed=1)]


def _run(model: str, bad: list[str], **kw):
    import dataclasses

    llm = make_llm(model, **kw)
    try:
        params = [dataclasses.replace(p, bad_words=bad) for p in PARAMS]
        outs = generate(llm, [{"prompt_token_ids": p} for p in PROMPTS], params)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
        return outs
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def baseline(model, words):
    """The outputs with the bad words on the CPU backend's sync strategy."""
    return _run(model, words[0])


def test_the_output_never_holds_a_bad_word(baseline, words) -> None:
    _, plain, seqs = words
    assert any(_contains(o.outputs[0].token_ids, s) for o in plain for s in seqs)
    outs = baseline
    for out in outs:
        for c in out.outputs:
            for s in seqs:
                assert not _contains(c.token_ids, s), (c.token_ids, s)
    # Greedy changes exactly where a bad word would have been completed.
    assert outs[0].outputs[0].token_ids != plain[0].outputs[0].token_ids


@pytest.mark.parametrize("how", [
    {"async_scheduling": True, "backend_options": {"overlap": "process"}},
    {"backend_options": {"overlap": "process"}},
    {"disable_async_output_proc": True},
])
def test_the_same_outputs_however_the_steps_run(model, words, baseline, how) -> None:
    assert summarize(_run(model, words[0], **how)) == summarize(baseline)


def test_emulated_hpu_with_async_scheduling_equals_cpu(model, words, baseline,
                                                       monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_HPU_EMULATE", "1")
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    got = _run(model, words[0], backend="hpu", async_scheduling=True, max_model_len=128)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in baseline]


def test_bad_values_are_refused() -> None:
    for value in ([""], ["  "], [3], {"a": 1}):
        with pytest.raises(ValueError, match="bad_words") as e:
            SamplingParams(bad_words=value)
        assert e.value.param == "bad_words"
    assert SamplingParams(bad_words="cat").bad_words == ["cat"]
    assert SamplingParams(bad_words=[]).bad_words is None


def test_a_word_and_its_spaced_form_ending_alike_are_both_banned() -> None:
    """Two pending pairs of one row may ban the same token (a word and its spaced form,
    "New York" and " New York", end in the same token): a repeated index must not undo the
    ban the other wrote."""
    import torch

    from cadence.layers.sampler import ban_if_newest

    pairs = [[(3, 4), (2, 4)], [(1, 5)]]
    for newest, banned in (([3, 0], {(0, 4)}), ([2, 1], {(0, 4), (1, 5)}), ([0, 0], set())):
        out = ban_if_newest(torch.zeros(2, 6), pairs, torch.tensor(newest))
        assert {tuple(i) for i in torch.isinf(out).nonzero().tolist()} == banned, newest


def test_tokenization_follows_vllms_rule() -> None:
    table = {"cat": [7], " cat": [8], "big cat": [9, 7], " big cat": [10, 11, 7],
             "x": [3], " x": [0, 3]}

    class Tok:
        def encode(self, text, add_special_tokens=False):
            return table[text]

    assert bad_words_token_ids(Tok(), ["cat"]) == ((7,), (8,))
    # The spaced form of a different length is left out, as vLLM leaves it.
    assert bad_words_token_ids(Tok(), ["big cat"]) == ((9, 7),)
    assert bad_words_token_ids(Tok(), ["x", "x"]) == ((3,),)
    assert bad_words_token_ids(Tok(), ["cat"], vocab_size=8) == ((7,),)
