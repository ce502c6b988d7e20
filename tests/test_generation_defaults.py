"""The model's generation_config.json sampling defaults fill the fields a request leaves out,
in the Python API, ``engine generate`` and the server, as vLLM applies them; an explicit
value always wins, and ``--generation-config none`` (or ``vllm``) turns them off."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest
from engine_helpers import make_llm

from cadence import SamplingParams
from cadence.cli.main import main
from cadence.engine import LLMEngine
from cadence.engine_args import EngineArgs
from cadence.generation_defaults import describe_generation_defaults, load_generation_defaults

FILE_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
LINE = ("generation defaults from generation_config.json: temperature=0.6, top_p=0.9, "
        "top_k=20, repetition_penalty=1.1")


def _with_generation_config(src: str, dst: Path, values: dict) -> str:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**cfg, **values}))
    return str(dst)


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny Llama with sampling defaults as a chat model ships them (do_sample too)."""
    return _with_generation_config(tiny_model_dir("llama"),
                                   tmp_path_factory.mktemp("gen") / "model",
                                   {"do_sample": True, "max_new_tokens": 7, **FILE_DEFAULTS})


def _sampled(params: SamplingParams) -> dict:
    return {k: getattr(params, k)
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}


CADENCE = _sampled(SamplingParams())


# ---- resolution ----------------------------------------------------------------------------
def test_resolved_once_into_the_model_config(model, tiny_model_dir, tmp_path):
    config = EngineArgs(model=model).create_engine_config()
    assert dict(config.model_config.generation_defaults) == FILE_DEFAULTS
    for off in ("none", "vllm"):
        config = EngineArgs(model=model, generation_config=off).create_engine_config()
        assert config.model_config.generation_defaults == ()
    # A folder: that folder's file, whatever the model folder holds.
    assert load_generation_defaults(tiny_model_dir("llama"), model) == tuple(
        FILE_DEFAULTS.items())
    # Null values and fields outside the five are not defaults; top_k -1 means off.
    other = _with_generation_config(model, tmp_path / "other",
                                    {"temperature": None, "top_k": -1, "min_p": 0.05})
    assert load_generation_defaults(other) == (("top_p", 0.9), ("top_k", 0),
                                               ("min_p", 0.05), ("repetition_penalty", 1.1))


def test_bad_choices_and_files_name_the_field(model, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be one of .*'auto', 'none'"):
        load_generation_defaults(model, str(tmp_path / "missing"))
    bad = _with_generation_config(model, tmp_path / "bad", {"top_p": 0})
    with pytest.raises(ValueError, match="sets an invalid sampling default: top_p must be "
                                         r"a number in \(0, 1\].*--generation-config none"):
        EngineArgs(model=bad).create_engine_config()
    (tmp_path / "bad" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        load_generation_defaults(bad)
    assert load_generation_defaults(bad, "none") == ()


def test_start_up_line():
    assert describe_generation_defaults(()) is None
    assert describe_generation_defaults(tuple(FILE_DEFAULTS.items())) == (
        LINE + " (pass --generation-config none to ignore)")


# ---- the Python API ------------------------------------------------------------------------
def _record_params(engine) -> list[SamplingParams]:
    seen: list[SamplingParams] = []
    original = engine.add_request

    def add_request(request_id, prompt, params=None, *args, **kw):
        original(request_id, prompt, params, *args, **kw)
        seen.append(engine.output_processor.parents[request_id].children[0].sampling_params)

    engine.add_request = add_request
    return seen


def test_python_api_applies_them_without_sampling_params(model, caplog):
    with caplog.at_level(logging.WARNING, logger="cadence.llm"):
        llm = make_llm(model)
    assert [r.getMessage() for r in caplog.records if r.name == "cadence.llm"] == [
        LINE + " (pass generation_config='none' to ignore)"]
    try:
        defaults = llm.get_default_sampling_params()
        assert _sampled(defaults) == {**CADENCE, **FILE_DEFAULTS}
        # max_new_tokens is not a default: max_tokens keeps SamplingParams' 16.
        assert defaults.max_tokens == SamplingParams().max_tokens
        seen = _record_params(llm.engine)
        llm.generate("the quick brown fox", use_tqdm=False)
        # Explicit SamplingParams are used as they are (vLLM's rule for the Python API).
        llm.generate("the quick brown fox", SamplingParams(temperature=0.0, max_tokens=2),
                     use_tqdm=False)
        llm.engine.add_request("x", "a small bird", None)  # the engine's None: the same
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert [_sampled(p) for p in seen] == [
            {**CADENCE, **FILE_DEFAULTS}, {**CADENCE, "temperature": 0.0},
            {**CADENCE, **FILE_DEFAULTS}]
    finally:
        llm.shutdown()


def test_python_api_switch_off(model):
    llm = make_llm(model, generation_config="none")
    try:
        assert _sampled(llm.get_default_sampling_params()) == CADENCE
    finally:
        llm.shutdown()


# ---- engine generate -----------------------------------------------------------------------
@pytest.fixture
def cli_params(monkeypatch) -> list[SamplingParams]:
    seen: list[SamplingParams] = []
    original = LLMEngine.add_request

    def add_request(self, request_id, prompt, params=None, *args, **kw):
        seen.append(params)
        return original(self, request_id, prompt, params, *args, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    return seen


def _generate(model: str, *flags: str) -> int:
    return main(["generate", "--model", model, "--prompt", "the quick brown fox",
                 "--max-tokens", "2", "--max-model-len", "256", "--cpu-overlap", "sync",
                 *flags])


def test_cli_flags_left_out_take_the_models_defaults(model, cli_params, capsys):
    assert _generate(model, "--top-k", "5") == 0
    assert _sampled(cli_params[0]) == {**CADENCE, **FILE_DEFAULTS, "top_k": 5}
    assert f"cadence: {LINE} (pass --generation-config none to ignore)" in \
        capsys.readouterr().err
    for off in ("none", "vllm"):
        assert _generate(model, "--generation-config", off) == 0
        # Without the model's defaults the CLI is greedy, as before.
        assert _sampled(cli_params[-1]) == {**CADENCE, "temperature": 0.0}
        assert "generation defaults" not in capsys.readouterr().err


def test_cli_bad_choice_is_an_error(model, tmp_path, capsys):
    assert _generate(model, "--generation-config", str(tmp_path / "nope")) == 2
    assert "generation_config must be one of" in capsys.readouterr().err


# ---- the server ----------------------------------------------------------------------------
def test_server_fields_absent_or_null_take_the_models_defaults(model):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_async_engine import make_async

    from cadence.server.app import build_app

    async def run() -> list[SamplingParams]:
        engine = make_async(model)
        seen: list[SamplingParams] = []
        original = engine.add_request

        async def add_request(prompt, params=None, *args, **kw):
            seen.append(params)
            return await original(prompt, params, *args, **kw)

        engine.add_request = add_request
        try:
            app = build_app(engine, "tiny")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=60) as client:
                for path, body in (
                        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}],
                                                  "max_tokens": 2, "top_p": None}),
                        ("/v1/completions", {"prompt": "hello", "max_tokens": 2,
                                             "temperature": 0, "top_k": 0, "top_p": 1,
                                             "repetition_penalty": 1})):
                    r = await client.post(path, json=body)
                    assert r.status_code == 200, r.text
        finally:
            await engine.shutdown()
        return seen

    seen = asyncio.run(run())
    assert [_sampled(p) for p in seen] == [
        {**CADENCE, **FILE_DEFAULTS}, {**CADENCE, **FILE_DEFAULTS},
        {**CADENCE, "temperature": 0.0}]
