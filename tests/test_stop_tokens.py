"""Stop tokens as real models use them: every ``eos_token_id`` that generation_config.json
lists stops generation (and is banned below min_tokens), and the token that stops a request
(an EOS or a ``stop_token_ids`` entry) is in ``token_ids`` and logprobs but not in ``text``,
unless ``include_stop_str_in_output`` (vLLM's rule), streamed or not, offline or served.

The tiny random models never pick ``</s>`` on their own, so the tests take a token that greedy
decoding of the prompt does produce (``target``, the k-th generated token) and either list it
in generation_config.json or swap its lm_head row with ``</s>``'s, which makes the model pick
``</s>`` exactly where it would have picked ``target``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_helpers import edit_config_json, generate, make_llm

from cadence import LLM, SamplingParams
from cadence.output_state import OutputKind

EOS_TEXT = "</s>"
NUM_REF = 16
# Its greedy continuation starts with whole ASCII characters, so texts compare plainly.
MESSAGES = [{"role": "user", "content": "what is the sun"}]


@dataclass
class Case:
    model: str  # the unmodified tiny llama
    prompt: list[int]  # the chat-rendered prompt's token ids
    ref: list[int]  # its greedy continuation, ignoring EOS
    k: int  # ref[k] == target is the first occurrence of target
    target: int
    unused: int  # a token id greedy decoding of the prompt never produces
    eos: int  # the tokenizer's EOS (</s>)


@pytest.fixture(scope="module")
def llm_for():
    """``llm_for(model, async_output=True)``: one LLM per model and setting, for the module
    (building one costs seconds)."""
    built: dict[tuple[str, bool], LLM] = {}

    def get(model: str, async_output: bool = True) -> LLM:
        if (model, async_output) not in built:
            built[model, async_output] = make_llm(
                model, disable_async_output_proc=not async_output)
        return built[model, async_output]

    yield get
    for llm in built.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def case(tiny_model_dir, llm_for) -> Case:
    model = tiny_model_dir("llama")
    llm = llm_for(model)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    ref = list(generate(llm, [{"prompt_token_ids": prompt}], SamplingParams(
        max_tokens=NUM_REF, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids)
    eos = tok.eos_token_id
    # A target with whole characters of its own after whole characters, so leaving its
    # text out (or not) shows in the text.
    k = next(i for i in range(2, NUM_REF) if ref[i] not in ref[:i] + [eos]
             and "\ufffd" not in tok.decode(ref[:i + 1])
             and tok.decode(ref[:i + 1]) != tok.decode(ref[:i]))
    unused = next(t for t in range(2, len(tok)) if t not in ref)
    assert eos not in ref
    return Case(model, prompt, ref, k, ref[k], unused, eos)


def _copy(case: Case, dst: Path, eos_ids: list[int] | None) -> str:
    shutil.copytree(case.model, dst)
    path = dst / "generation_config.json"
    if eos_ids is None:
        path.unlink()
    else:
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = eos_ids
        path.write_text(json.dumps(cfg))
    return str(dst)


@pytest.fixture(scope="module")
def multi_eos_model(case, tmp_path_factory) -> str:
    """generation_config.json lists three EOS ids, like Llama 3 Instruct's; the model only
    ever reaches the last one."""
    return _copy(case, tmp_path_factory.mktemp("multi-eos") / "m",
                 [case.eos, case.unused, case.target])


@pytest.fixture(scope="module")
def eos_model(case, tmp_path_factory) -> str:
    """The tiny llama with lm_head rows of ``target`` and ``</s>`` swapped: it says ``</s>``
    at position k."""
    from safetensors.torch import load_file, save_file

    dst = Path(_copy(case, tmp_path_factory.mktemp("eos-swap") / "m", [case.eos]))
    weights = load_file(dst / "model.safetensors")
    head = weights["lm_head.weight"]
    head[[case.eos, case.target]] = head[[case.target, case.eos]].clone()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def _run(llm: LLM, case: Case, **kw):
    kw.setdefault("max_tokens", NUM_REF)
    return generate(llm, [{"prompt_token_ids": case.prompt}],
                    SamplingParams(temperature=0.0, **kw))[0].outputs[0]


def _hf_generate(model: str, prompt: list[int], **kw) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


# ---- several EOS ids ----------------------------------------------------------------------
def test_every_generation_config_eos_stops(llm_for, case, multi_eos_model):
    llm = llm_for(multi_eos_model)
    assert set(llm.engine.eos_token_ids) == {case.eos, case.unused, case.target}
    out = _run(llm, case, logprobs=1)
    assert list(out.token_ids) == case.ref[:case.k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.text == _run(llm, case, max_tokens=case.k, ignore_eos=True).text
    assert len(out.logprobs) == case.k + 1 and case.target in out.logprobs[-1]
    # transformers' generate() stops on the same list.
    assert _hf_generate(multi_eos_model, case.prompt, max_new_tokens=NUM_REF) \
        == list(out.token_ids)

    out = _run(llm, case, max_tokens=case.k + 3, ignore_eos=True)
    assert list(out.token_ids) == case.ref[:case.k + 3] and out.finish_reason == "length"


def test_min_tokens_bans_every_eos(llm_for, case, multi_eos_model):
    llm = llm_for(multi_eos_model)
    min_tokens = case.k + 3
    out = _run(llm, case, min_tokens=min_tokens)
    eos_ids = {case.eos, case.unused, case.target}
    assert not eos_ids & set(out.token_ids[:min_tokens])
    assert out.token_ids[:case.k] == case.ref[:case.k] and out.token_ids[case.k] != case.target
    assert _hf_generate(multi_eos_model, case.prompt, max_new_tokens=NUM_REF,
                        min_new_tokens=min_tokens) == list(out.token_ids)
    # Under ignore_eos too (vLLM's and transformers' rule): min_tokens is that many tokens of
    # text, and only after them may an EOS come, and not end the output.
    ignored = _run(llm, case, min_tokens=min_tokens, ignore_eos=True)
    assert list(ignored.token_ids[:min_tokens]) == list(out.token_ids[:min_tokens])


def test_a_stop_string_ends_the_output_only_past_min_tokens(llm_for, case):
    """vLLM's rule: the token that completes a stop string must come after the first
    ``min_tokens``, as an EOS or a stop id may only come after them."""
    llm = llm_for(case.model)
    tok = llm.get_tokenizer()
    stop = tok.decode(case.ref[:case.k + 1])  # complete with the output's (k + 1)-th token
    out = _run(llm, case, stop=[stop], min_tokens=case.k)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert list(out.token_ids) == case.ref[:case.k + 1] and out.text == ""
    out = _run(llm, case, stop=[stop], min_tokens=case.k + 1)
    assert out.finish_reason == "length" and list(out.token_ids) == case.ref


def test_eos_falls_back_to_config_json_then_the_tokenizer(case, tmp_path):
    """As transformers' generate(): without a generation config, config.json's
    eos_token_id (a list too); without either, the tokenizer's."""
    both = edit_config_json(_copy(case, tmp_path / "m", None),
                            eos_token_id=[case.eos, case.unused])
    llm = make_llm(both)
    try:
        assert llm.engine.eos_token_ids == (case.eos, case.unused)
    finally:
        llm.shutdown()
    bare = edit_config_json(_copy(case, tmp_path / "bare", None), drop=("eos_token_id",))
    llm = make_llm(bare)
    try:
        assert llm.engine.eos_token_ids == (case.eos,) and llm.engine.eos_token_id == case.eos
    finally:
        llm.shutdown()


def test_generation_config_none_ignores_the_file_for_eos_too(case, tmp_path):
    """The advice of a broken file's error, followed: the file is not read at all; null
    entries of a list are skipped, and a value that is no token id names the file."""
    broken = _copy(case, tmp_path / "broken", None)
    (Path(broken) / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation-config none"):
        make_llm(broken)
    llm = make_llm(broken, generation_config="none")
    try:
        assert llm.engine.eos_token_ids == (case.eos,)  # config.json's
    finally:
        llm.shutdown()
    holes = _copy(case, tmp_path / "holes", [case.unused, None])
    llm = make_llm(holes)
    try:
        assert llm.engine.eos_token_ids == (case.unused,)
    finally:
        llm.shutdown()
    bad = _copy(case, tmp_path / "bad", ["two"])
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a "
                                         r"token id or a list of them, got \['two'\]"):
        make_llm(bad)


# ---- the stop token's text ----------------------------------------------------------------
@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
def test_eos_text_is_left_out(llm_for, case, eos_model, skip):
    llm = llm_for(eos_model)
    out = _run(llm, case, skip_special_tokens=skip, logprobs=1)
    assert list(out.token_ids) == case.ref[:case.k] + [case.eos]
    assert out.finish_reason == "stop" and out.stop_reason is None
    before = _run(llm, case, max_tokens=case.k, skip_special_tokens=skip).text
    assert out.text == before and EOS_TEXT not in out.text
    assert len(out.logprobs) == case.k + 1 and case.eos in out.logprobs[-1]
    # Asked for, it is there like a stop string would be; ignored, it is just a token.
    out = _run(llm, case, skip_special_tokens=skip, include_stop_str_in_output=True)
    assert out.text == before + ("" if skip else EOS_TEXT)
    out = _run(llm, case, skip_special_tokens=skip, ignore_eos=True, max_tokens=case.k + 2)
    assert (EOS_TEXT in out.text) is not skip and out.finish_reason == "length"


def test_stop_token_id_text_is_left_out(llm_for, case):
    llm = llm_for(case.model)
    out = _run(llm, case, stop_token_ids=[case.target], logprobs=1)
    assert list(out.token_ids) == case.ref[:case.k + 1]
    assert out.finish_reason == "stop" and out.stop_reason == case.target
    assert out.text == _run(llm, case, max_tokens=case.k, ignore_eos=True).text
    assert len(out.logprobs) == case.k + 1 and case.target in out.logprobs[-1]
    out = _run(llm, case, stop_token_ids=[case.target], include_stop_str_in_output=True)
    assert out.text == _run(llm, case, max_tokens=case.k + 1, ignore_eos=True).text
    assert out.stop_reason == case.target


STREAM_PARAMS = {
    "eos": {"skip_special_tokens": False},
    "eos-included": {"skip_special_tokens": False, "include_stop_str_in_output": True},
    "stop-token": {"stop_token_ids": ["target"]},
    "stop-token-included": {"stop_token_ids": ["target"], "include_stop_str_in_output": True},
}


@pytest.mark.parametrize("name", list(STREAM_PARAMS))
@pytest.mark.parametrize("async_on", [True, False], ids=["async_output", "sync_output"])
def test_streamed_deltas_equal_the_final_text(llm_for, case, eos_model, name, async_on):
    kw = dict(STREAM_PARAMS[name])
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = [case.target]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_REF, logprobs=1, **kw)
    llm = llm_for(case.model if "stop_token_ids" in kw else eos_model, async_on)
    final = generate(llm, [{"prompt_token_ids": case.prompt}], params)[0].outputs[0]
    eng = llm.engine
    eng.add_request("s", {"prompt_token_ids": case.prompt}, params,
                    output_kind=OutputKind.DELTA)
    deltas = []
    while eng.has_unfinished_requests():
        deltas += [o.outputs[0] for o in eng.step()]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == list(final.token_ids)
    assert len([lp for d in deltas for lp in d.logprobs]) == len(final.token_ids)
    assert deltas[-1].finish_reason == final.finish_reason == "stop"
    n = case.k + 1 if kw.get("include_stop_str_in_output") else case.k
    assert final.text == _run(llm, case, max_tokens=n, ignore_eos=True,
                              skip_special_tokens=params.skip_special_tokens).text


def test_server_leaves_the_eos_text_out(llm_for, case, eos_model):
    pytest.importorskip("httpx", reason="the server tests need httpx (the test extra)")
    pytest.importorskip("fastapi", reason="the server tests need the server extra")
    from test_server import events, serve

    before = _run(llm_for(eos_model), case, max_tokens=case.k,
                  skip_special_tokens=False).text
    base = {"max_tokens": NUM_REF, "temperature": 0, "skip_special_tokens": False}

    async def body(client, engine):
        req = {**base, "prompt": case.prompt, "logprobs": 1}
        whole = (await client.post("/v1/completions", json=req)).json()["choices"][0]
        assert whole["text"] == before and whole["finish_reason"] == "stop"
        assert whole["stop_reason"] is None and len(whole["logprobs"]["tokens"]) == case.k + 1
        chunks = events((await client.post("/v1/completions",
                                           json={**req, "stream": True})).text)
        texts = [c["text"] for ch in chunks for c in ch["choices"]]
        assert "".join(texts) == before and not any(EOS_TEXT in t for t in texts)
        shown = (await client.post("/v1/completions", json={
            **req, "include_stop_str_in_output": True})).json()["choices"][0]
        assert shown["text"] == before + EOS_TEXT

        # Chat: the reply never ends in the EOS's text, streamed or not; ignoring EOS shows
        # where it was.
        req = {**base, "messages": MESSAGES}
        whole = (await client.post("/v1/chat/completions", json=req)).json()["choices"][0]
        content = whole["message"]["content"]
        assert whole["finish_reason"] == "stop" and EOS_TEXT not in content
        ignored = (await client.post("/v1/chat/completions", json={
            **req, "ignore_eos": True})).json()["choices"][0]["message"]["content"]
        assert ignored.startswith(content + EOS_TEXT)
        chunks = events((await client.post("/v1/chat/completions",
                                           json={**req, "stream": True})).text)
        texts = [c["delta"].get("content", "") for ch in chunks for c in ch["choices"]]
        assert "".join(texts) == content and not any(EOS_TEXT in t for t in texts)

    serve(eos_model, body)
