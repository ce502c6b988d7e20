"""Structured output (docs/structured_output.md): sampled outputs of a tiny random model at
temperature 1 always follow their JSON schema, regex, choice or grammar; async output on ==
off and preempted == unpreempted for seeded requests; every sampling feature combines with
it; a bad constraint is refused without harming others."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_helpers import generate, make_llm, summarize
from cadence import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "additionalProperties": False,
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "role", "ok"]}
POINTS = {"type": "array", "minItems": 1, "maxItems": 3,
          "items": {"type": "object", "additionalProperties": False,
                    "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                   "tag": {"enum": ["a", "b"]}},
                    "required": ["x", "tag"]}}
REGEX = r"[a-c]{2,5}-\d{1,3}"
CHOICES = ["yes", "no", "maybe so", "naïve"]
# Sums of one-digit numbers, at most three terms.
EBNF = 'root ::= num (" + " num){0,2} " = ?"\nnum ::= [0-9]'
EBNF_RE = r"[0-9]( \+ [0-9]){0,2} = \?"


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def _mixed(count: int, seed0: int = 0, **extra) -> list[SamplingParams]:
    """``count`` requests per constraint, seeded, at temperature 1."""
    kinds = [so(json=PERSON, disable_any_whitespace=True), so(json=json.dumps(POINTS),
             disable_any_whitespace=True), so(regex=REGEX), so(choice=CHOICES),
             so(grammar=EBNF), so(json_object=True, disable_any_whitespace=True)]
    extra.setdefault("max_tokens", 64)
    return [SamplingParams(temperature=1.0, seed=seed0 + i, structured_outputs=k, **extra)
            for i in range(count) for k in kinds]


def _check(text: str, constraint: StructuredOutputsParams) -> None:
    kind = constraint.kind
    if kind == "json":
        schema = constraint.json if isinstance(constraint.json, dict) \
            else json.loads(constraint.json)
        jsonschema.validate(json.loads(text), schema)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(EBNF_RE, text), text


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model):
    llm = make_llm(model, max_num_seqs=256)
    yield llm
    llm.shutdown()


def _features() -> list[SamplingParams]:
    """Every sampling feature beside a constraint, with n > 1."""
    return [
        SamplingParams(temperature=1.0, top_k=5, top_p=0.8, seed=1, n=3, max_tokens=64,
                       logprobs=3, structured_outputs=so(json=PERSON,
                                                         disable_any_whitespace=True)),
        SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=1.5,
                       frequency_penalty=1.0, repetition_penalty=1.3, seed=2, n=2,
                       max_tokens=32, structured_outputs=so(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=16, min_tokens=3, logprobs=2,
                       structured_outputs=so(choice=CHOICES)),
        SamplingParams(temperature=1.0, max_tokens=32, n=4,
                       structured_outputs=so(grammar=EBNF)),
    ]


def test_hundreds_of_samples_follow_their_constraint_with_every_feature(llm):
    features = _features()
    params = _mixed(50) + features  # 300 requests + 10 samples, one generate call
    prompts = ["the cat sat on"] * (len(params) - len(features)) + \
        ["hello there", "a dog ran", "why", "one two"]
    outs = generate(llm, prompts, params)
    json_object_ok = 0
    for o, p in zip(outs, params):
        assert len(o.outputs) == p.n
        for c in o.outputs:
            if p.structured_outputs.kind == "json_object" and c.finish_reason == "length":
                continue  # any JSON object may be deeper than max_tokens; the rest must stop
            assert c.finish_reason == "stop", (c.text, p.structured_outputs.kind)
            _check(c.text, p.structured_outputs)
            json_object_ok += p.structured_outputs.kind == "json_object"
            if p.logprobs is not None:
                # Logprobs are of the masked logits: the sampled token's is finite.
                for tok, d in zip(c.token_ids, c.logprobs):
                    assert d[tok].logprob > float("-inf")
    assert json_object_ok >= 5
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    # Distinct seeds give distinct outputs: the mask constrains, it does not determine.
    assert len({o.outputs[0].text for o, p in zip(outs, params)
                if p.structured_outputs.kind == "json"}) > 20
    assert len({c.text for c in outs[-4].outputs}) > 1  # seed + i per sample


def _seeded() -> list[SamplingParams]:
    return _mixed(1, seed0=100, max_tokens=40) + [
        SamplingParams(temperature=0.9, top_k=20, seed=7, n=2, logprobs=2, max_tokens=40,
                       presence_penalty=0.5, structured_outputs=so(json=PERSON)),
        SamplingParams(temperature=1.0, seed=8, max_tokens=30, stop=["-"],
                       structured_outputs=so(regex=REGEX)),
        SamplingParams(temperature=0.8, seed=9, max_tokens=30)]


PROMPTS = ["the cat sat on the mat", "a dog ran in the park today", "café résumé naïve",
           "hello", "she said that the weather was fine and warm", "why"]


def _run(model: str, **kw):
    llm = make_llm(model, **kw)
    params = _seeded()
    eng = llm.engine
    # Grammars compile on a worker thread, and a request waits for its grammar before it is
    # scheduled; compiled first, every request is admitted at once whatever the machine's
    # load, so the steps (and the preemptions a small cache forces) are the same each run.
    for p in params:
        if p.structured_outputs is not None:
            eng.structured.compiler.submit(p.structured_outputs).result()
    outs = generate(llm, [PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    for o, p in zip(outs, params):
        for c in o.outputs:
            if c.finish_reason == "stop" and p.structured_outputs is not None \
                    and c.stop_reason is None and p.structured_outputs.kind != "json_object":
                _check(c.text, p.structured_outputs)
    result = summarize(outs), eng.stats.num_preemptions
    llm.shutdown()
    return result


@pytest.fixture(scope="module")
def reference(model):
    """Seeded constrained requests, async output processing off: what every other way of
    running them must reproduce token for token."""
    return _run(model, disable_async_output_proc=True)[0]


def test_async_output_on_equals_off_under_preemption(model, reference):
    got, num_preemptions = _run(model, num_kv_blocks=20, block_size=8, max_model_len=128)
    assert num_preemptions > 0  # recomputed requests keep their grammar state
    assert got == reference


def test_process_worker_equals_the_reference(model, reference):
    # The default CPU strategy: the bitmask is computed here while the worker runs the
    # forward, and sent to it before it samples.
    got, _ = _run(model, backend_options={"overlap": "process"})
    assert got == reference


def test_async_scheduling_equals_the_reference(model, reference):
    # Constrained requests sit out the step planned while their token is in flight.
    got, _ = _run(model, async_scheduling=True)
    assert got == reference


def test_strings_with_a_length_hold_no_raw_control_characters(llm):
    """xgrammar writes a string with min/maxLength as any character but quote, backslash,
    CR and LF: raw control characters, which JSON forbids in a string (json.loads refuses
    the reply). Pushed towards those bytes, the outputs still parse strictly."""
    tok = llm.engine.tokenizer
    controls = {i for i in range(len(tok))
                if any(0 < ord(ch) < 0x20 and ch not in "\t\n\r"
                       for ch in tok.decode([i]))}
    assert controls
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3,
                                                     "maxLength": 8}},
              "required": ["s"], "additionalProperties": False}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40,
                             logit_bias={t: 8.0 for t in controls},
                             structured_outputs=so(json=schema, disable_any_whitespace=True))
              for i in range(8)]
    for out in generate(llm, ["a"] * len(params), params):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)  # strict: no raw control character


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"allOf": [{"type": "string"}, {"enum": ["yes", "no"]}]}, "allOf"),
    ({"type": "object", "properties": {"v": {"type": "number", "multipleOf": 0.5}}},
     "multipleOf on a number at properties.v"),
    ({"type": "string", "format": "date", "maxLength": 4}, "pattern or format"),
    ({"type": "string", "format": "color"}, "format 'color'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}},
     "not at the root"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
])
def test_schema_keywords_xgrammar_would_ignore_are_refused(llm, schema, named):
    """xgrammar compiles these and drops the keyword, so a finished output could break the
    schema; the request is refused, naming the keyword and where it is."""
    with pytest.raises(ValueError, match=re.escape(named)) as e:
        llm.engine.add_request("x", "hello", SamplingParams(structured_outputs=so(json=schema)))
    assert str(e.value).startswith("structured_outputs.json is invalid")
    assert not llm.engine.has_unfinished_requests()


def test_compact_json_and_lark_grammars_as_vllm_takes_them(llm):
    """disable_any_whitespace writes JSON with no whitespace at all (vLLM's layout); an
    integer's multipleOf is enforced; a grammar in Lark's syntax is read as Lark."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7,
                                                     "minimum": 0, "maximum": 999},
                                               "t": {"type": "array", "maxItems": 2,
                                                     "items": {"type": "boolean"}}},
              "required": ["n", "t"], "additionalProperties": False}
    lark = 'start: item ("," item)*\nitem: "dog" | "cat"'
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=c)
              for i, c in enumerate([so(json=schema, disable_any_whitespace=True)] * 4
                                    + [so(grammar=lark)] * 2)]
    outs = [o.outputs[0] for o in generate(llm, ["a"] * len(params), params)]
    for out in outs[:4]:
        assert out.finish_reason == "stop" and not re.search(r"\s", out.text), out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert value["n"] % 7 == 0
    for out in outs[4:]:
        assert re.fullmatch(r"(dog|cat)(,(dog|cat))*", out.text), out.text


def test_bad_constraint_is_refused_and_others_run(llm):
    eng = llm.engine
    good = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                          structured_outputs=so(choice=CHOICES))
    eng.add_request("good", "hello", good)
    for bad, needle in [(so(json={"type": "objectx"}), "objectx"),
                        (so(regex="(ab"), "parenthesis"),
                        (so(grammar="root ::= foo"), "foo")]:
        with pytest.raises(ValueError, match=needle):
            eng.add_request("bad", "hello", SamplingParams(structured_outputs=bad))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == ["good"]
    assert outs[-1].outputs[0].text in CHOICES
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("held_first", [True, False])
def test_a_sample_id_held_for_its_grammar_is_in_use(llm, held_first):
    """n=2 names its samples '0_a' and '1_a'. While a constrained request's samples wait
    for their grammar they are not in the scheduler yet, and another request with one of
    their ids must still be refused at once: accepted, it crashed the step that admitted
    them, and every request with it."""
    from cadence.sampling_params import FieldError

    eng = llm.engine
    held = SamplingParams(n=2, temperature=0.0, max_tokens=4,
                          structured_outputs=so(choice=["yes", "no"]))
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    first, second = (("a", held), ("0_a", plain)) if held_first else \
        (("0_a", SamplingParams(temperature=0.0, max_tokens=4,
                                structured_outputs=so(choice=["yes"]))),
         ("a", SamplingParams(n=2, temperature=0.0, max_tokens=4)))
    eng.add_request(first[0], "hello", first[1])
    with pytest.raises(FieldError, match="'0_a' of one of its samples is in use"):
        eng.add_request(second[0], "hello", second[1])
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.request_id for o in outs if o.finished] == [first[0]]
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_compile_failure_and_abort_while_compiling_touch_only_their_request(llm, monkeypatch):
    import threading

    eng = llm.engine
    compiler = eng.structured.compiler
    real = compiler._compile
    release = threading.Event()

    def compile_(params):
        if params.kind == "regex" and params.regex == "x+":
            raise ValueError("structured_outputs.regex does not compile: (test)")
        if params.kind == "regex" and params.regex == "y+":
            release.wait(30)
        return real(params)

    monkeypatch.setattr(compiler, "_compile", compile_)
    good = SamplingParams(temperature=1.0, seed=5, max_tokens=20,
                          structured_outputs=so(choice=CHOICES))
    eng.add_request("good", "hello", good)
    eng.add_request("fails", "hello", SamplingParams(structured_outputs=so(regex="x+")))
    eng.add_request("aborted", "hello", SamplingParams(n=2, structured_outputs=so(regex="y+")))
    outs = eng.step() + eng.step()
    eng.abort_request("aborted")
    release.set()
    while eng.has_unfinished_requests():
        outs += eng.step()
    final = {o.request_id: o for o in outs if o.finished}
    assert final["good"].outputs[0].text in CHOICES
    assert final["fails"].outputs[0].finish_reason == "error"
    assert "(test)" in final["fails"].error
    assert [c.finish_reason for c in final["aborted"].outputs] == ["abort", "abort"]
    assert eng.structured.num_waiting == 0
    assert eng.block_manager.num_free_blocks == eng.num_blocks


@pytest.mark.parametrize("kw, needle", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": 3}, "JSON schema"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 1]}, "non-empty list"),
    ({"json_object": "yes"}, "json_object"),
    ({"grammar": ""}, "non-empty string"),
])
def test_params_validation(kw, needle):
    with pytest.raises(ValueError, match=needle):
        StructuredOutputsParams(**kw)


def test_params_from_dict_and_sampling_params():
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert sp.structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a+"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="a+")
    assert sp.for_sample(1).structured_outputs is sp.structured_outputs


def test_missing_xgrammar_is_a_clear_error(monkeypatch):
    import sys

    from cadence.structured_output.compiler import import_xgrammar

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install xgrammar"):
        import_xgrammar()


def _fail_the_third_bitmask(monkeypatch) -> list[int]:
    """Make the third bitmask the engine computes fail; returns the calls' row counts."""
    from cadence.structured_output import manager

    real_fill, calls = manager.fill_bitmask, []

    def fails_once(reqs, width):
        calls.append(len(reqs))
        if len(calls) == 3:
            raise RuntimeError("matcher state lost")
        return real_fill(reqs, width)

    monkeypatch.setattr(manager, "fill_bitmask", fails_once)
    return calls


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2},
                                   {"pipeline_parallel_size": 2}])
def test_ranks_get_the_bitmask_after_the_step(model, monkeypatch, caplog, split):
    """TP=2 and PP=2 (mp executor): greedy constrained requests give one process's tokens.
    A constrained step goes to the ranks before its bitmask exists; the bitmask follows it
    as a message of its own, computed while the ranks run the forward (a first stage, which
    samples nothing, leaves it unread). A bitmask that cannot be computed fails its step on
    the ranks that sample, collecting it raises the engine's own error, the group stays
    up, and the engine runs the step's requests again."""
    import logging

    kinds = [so(regex=REGEX), so(choice=CHOICES), so(json=PERSON, disable_any_whitespace=True),
             so(grammar=EBNF)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=k)
              for k in kinds] + [SamplingParams(temperature=0.0, max_tokens=8)]
    prompts = PROMPTS[:len(params)]
    single = make_llm(model)
    try:
        want = [o.outputs[0].token_ids for o in generate(single, prompts, params)]
    finally:
        single.shutdown()
    llm = make_llm(model, **split)
    try:
        eng, executor = llm.engine, llm.engine.backend
        pids, sent, real_send = list(executor.worker_pids), [], executor._send_all

        def recording(msg):
            if isinstance(msg, tuple):
                sent.append(msg[0] if msg[1] is not None else "no bitmask")
            elif msg != "ping":
                grammar = msg.sampling.grammar
                sent.append("step" if grammar is None else
                            "step, bitmask to follow" if not grammar.is_ready else
                            "step with its bitmask")
            real_send(msg)

        monkeypatch.setattr(executor, "_send_all", recording)
        for p in params[:-1]:
            eng.structured.compiler.submit(p.structured_outputs).result()
        outs = generate(llm, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        for o, p in zip(outs[:-1], params):
            if o.outputs[0].finish_reason == "stop":
                _check(o.outputs[0].text, p.structured_outputs)
        late = [i for i, m in enumerate(sent) if m == "step, bitmask to follow"]
        assert late and "step with its bitmask" not in sent
        assert [sent[i + 1] for i in late] == ["bitmask"] * len(late)
        assert sent.count("bitmask") == len(late)

        _fail_the_third_bitmask(monkeypatch)
        sent.clear()
        with caplog.at_level(logging.WARNING):
            again = generate(llm, prompts, params)
        assert "no bitmask" in sent  # the ranks were told, and failed that step
        assert "matcher state lost" in caplog.text  # what collect raised
        assert [o.outputs[0].token_ids for o in again] == want
        assert executor.worker_pids == pids  # no rank was lost or restarted
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_bitmask_fails_its_step_on_the_cpu_worker(model, monkeypatch, caplog,
                                                           async_scheduling):
    """The CPU ``process`` strategy sends a constrained step before its bitmask; when the
    bitmask cannot be computed the worker is told and fails that step. The failure is the
    step's, raised when its reply is read, so the replies of later steps stay paired with
    their own steps (with async scheduling too), and the requests run again."""
    import logging

    kinds = [so(regex=REGEX), so(choice=CHOICES), so(json=PERSON, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=k)
              for k in kinds] + [SamplingParams(temperature=0.0, max_tokens=8)]
    prompts = PROMPTS[:len(params)]
    llm = make_llm(model, async_scheduling=async_scheduling,
                   backend_options={"overlap": "process"})
    try:
        eng = llm.engine
        want = [o.outputs[0].token_ids for o in generate(llm, prompts, params)]
        pid = eng.backend.worker_pid
        calls = _fail_the_third_bitmask(monkeypatch)
        with caplog.at_level(logging.WARNING):
            again = generate(llm, prompts, params)
        assert len(calls) > 3 and "matcher state lost" in caplog.text
        assert [o.outputs[0].token_ids for o in again] == want
        assert eng.backend.worker_pid == pid  # the worker was not lost or restarted
        assert eng.block_manager.num_free_blocks == eng.num_blocks
    finally:
        llm.shutdown()


def _slow_grammars(monkeypatch, seconds: float) -> None:
    """Every grammar compiles ``seconds`` longer (a hard schema)."""
    import time

    from cadence.structured_output.compiler import GrammarCompiler

    compile_ = GrammarCompiler._compile

    def slow(self, params):
        time.sleep(seconds)
        return compile_(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)


@pytest.mark.parametrize("extra", [{}, {"async_scheduling": True}], ids=["plain", "async"])
def test_a_grammar_that_compiles_for_long_holds_up_nothing(model, monkeypatch, extra):
    """The engine waits for a grammar in short slices when nothing else can run: the output
    arrives when it compiles, as it would at once."""
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so(choice=CHOICES))
    want = generate(make_llm(model, **extra), ["one two"], params)[0].outputs[0].text
    _slow_grammars(monkeypatch, 1.0)
    llm = make_llm(model, **extra)
    try:
        assert generate(llm, ["one two"], params)[0].outputs[0].text == want
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_an_abort_and_a_shutdown_are_served_while_a_grammar_compiles(model, monkeypatch):
    import asyncio
    import time

    from test_async_engine import make_async

    _slow_grammars(monkeypatch, 15.0)
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so(regex="[a-z]+"))

    async def main():
        engine = make_async(model)
        start = time.monotonic()
        try:
            async def consume():
                return [out async for out in engine.generate("one two", params,
                                                             request_id="slow")]

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.5)
            await engine.abort("slow")
            outs = await asyncio.wait_for(task, timeout=4)
            assert outs and outs[-1].finished
            assert outs[-1].outputs[0].finish_reason == "abort"
        finally:
            await asyncio.wait_for(engine.shutdown(), timeout=4)
        return time.monotonic() - start

    assert asyncio.run(main()) < 6  # not the 15 s the grammar takes
