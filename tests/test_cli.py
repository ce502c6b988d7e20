"""The command line explains itself: versions, help with defaults, one output format for
``engine generate``, ``engine chat`` from a pipe, honest start-up messages and clear errors."""

from __future__ import annotations

import argparse
import io
import json
import socket
import subprocess
import sys

import pytest

from cadence.cli import main as cli
from cadence.cli.main import build_parser, main

# Greedy, short and single-process: fast on two busy cores.
FAST = ["--max-model-len", "256", "--cpu-overlap", "sync", "--max-tokens", "3",
        "--ignore-eos"]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        else:
            yield parser, path, action


# ---- --version and --help -----------------------------------------------------------------
def test_version_names_cadence_torch_python_and_each_backend_without_importing_torch():
    code = ("import sys; from cadence.cli.main import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit as e:\n"
            "    print('EXIT', e.code, 'TORCH', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd="/").stdout
    from importlib import metadata

    assert f"cadence {metadata.version('cadence')}" in out
    assert f"torch {metadata.version('torch')}" in out
    assert f"Python {sys.version_info.major}.{sys.version_info.minor}" in out
    assert "  cpu: cadence " in out
    assert "EXIT 0 TORCH False" in out


def test_every_option_of_every_subcommand_has_help_that_states_its_default():
    missing, silent = [], []
    for parser, path, action in _walk(build_parser()):
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        name = " ".join(("engine", *path, action.option_strings[0]))
        if not action.help:
            missing.append(name)
            continue
        text = parser._get_formatter()._expand_help(action)
        has_default = not any(action.default is v for v in (None, False, argparse.SUPPRESS))
        if has_default and "default" not in text:
            silent.append(f"{name} (default {action.default!r}): {text}")
    assert missing == [], "options without help"
    assert silent == [], "help that does not state the default"


# ---- engine generate ----------------------------------------------------------------------
def test_generate_text_format_is_one_shape_and_prints_logprobs(model, capsys):
    assert main(["generate", "--model", model, "--prompt", "the quick brown fox", *FAST,
                 "--logprobs", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[prompt 0, sample 0] finish_reason=length"
    assert sum(line.startswith("  logprob ") for line in out) == 3
    assert "top: " in out[2]

    assert main(["generate", "--model", model, "--prompt", "a", "--prompt", "b", "--n", "2",
                 *FAST]) == 0
    headers = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[prompt")]
    assert headers == [f"[prompt {p}, sample {s}] finish_reason=length"
                       for p in (0, 1) for s in (0, 1)]


def test_generate_json_from_a_jsonl_file_with_per_line_sampling_fields(model, tmp_path,
                                                                      capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there", "n": 2, "max_tokens": 2}) + "\n\n"
                    + json.dumps({"prompt": "the quick", "logprobs": 1, "temperature": 0.7,
                                  "seed": 3, "stop": ["zzz"]}) + "\n"
                    + json.dumps({"prompt": "forced", "temperature": 0, "max_tokens": 3,
                                  "ignore_eos": True, "logit_bias": {"9": 100}}) + "\n")
    assert main(["generate", "--model", model, "--prompts-file", str(path), *FAST,
                 "--output-format", "json"]) == 0
    first, second, third = (json.loads(ln) for ln in capsys.readouterr().out.splitlines())
    assert (first["request_id"], first["prompt"]) == ("0", "hello there")
    assert [len(o["token_ids"]) for o in first["outputs"]] == [2, 2]
    assert all("logprobs" not in o for o in first["outputs"])
    (sample,) = second["outputs"]
    assert len(sample["token_ids"]) == 3 and sample["finish_reason"] == "length"
    assert [p["token_id"] for p in sample["logprobs"]] == sample["token_ids"]
    assert all(1 <= len(p["top_logprobs"]) <= 2 for p in sample["logprobs"])
    assert third["outputs"][0]["token_ids"] == [9, 9, 9]


def test_generate_prints_prompt_logprobs(model, tmp_path, capsys):
    from cadence.tokenizer_loader import load_tokenizer

    ids = load_tokenizer(model).encode("the quick brown fox")
    assert main(["generate", "--model", model, "--prompt", "the quick brown fox", *FAST,
                 "--prompt-logprobs", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[prompt 0] prompt logprobs"
    assert all(line.startswith("  logprob ") for line in out[1:len(ids)])
    assert out[len(ids)] == "[prompt 0, sample 0] finish_reason=length"
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "the quick brown fox", "prompt_logprobs": 0}) + "\n"
                    + json.dumps({"prompt": "hello"}) + "\n")
    assert main(["generate", "--model", model, "--prompts-file", str(path), *FAST,
                 "--output-format", "json"]) == 0
    first, second = (json.loads(ln) for ln in capsys.readouterr().out.splitlines())
    lp = first["prompt_logprobs"]
    assert lp[0] is None and [p["token_id"] for p in lp[1:]] == ids[1:]
    assert all(len(p["top_logprobs"]) == 1 for p in lp[1:])  # N=0: the prompt token alone
    assert "prompt_logprobs" not in second


def test_generate_reads_plain_prompts_from_stdin(model, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("first prompt\n\nsecond prompt\n"))
    assert main(["generate", "--model", model, "--prompts-file", "-", *FAST,
                 "--output-format", "json"]) == 0
    rows = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["first prompt", "second prompt"]


@pytest.mark.parametrize(("line", "words"), [
    ('{"prompt": "x", "temprature": 0.5}', ["line 2", "'temprature'", "temperature"]),
    ('{"prompt": "x", "top_p": 7}', ["line 2", "top_p must be"]),
    ('{"prompt": "x", "max_tokens": "many"}', ["line 2", "max_tokens"]),
    ('{"prompt": "x", "logit_bias": {"one": 1}}', ["line 2", "logit_bias", "'one'"]),
    ('{"temperature": 0}', ["line 2", "'prompt'"]),
    ("not json", ["line 2", "JSON"]),
])
def test_a_bad_prompts_file_line_is_an_error_naming_line_and_field(model, tmp_path, capsys,
                                                                   monkeypatch, line, words):
    from cadence.engine import LLMEngine

    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    # Every line is checked before the model loads.
    monkeypatch.setattr(LLMEngine, "__init__", lambda *a, **kw: pytest.fail("engine started"))
    assert main(["generate", "--model", model, "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: ")
    for word in words:
        assert word in err


def test_prompt_and_prompts_file_are_exclusive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--prompts-file", "-"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


# ---- engine chat --------------------------------------------------------------------------
def test_chat_keeps_the_history_and_stops_at_exit(model, monkeypatch, capsys):
    from cadence.engine import LLMEngine

    prompts: list[str] = []
    original = LLMEngine.add_request

    def add_request(self, request_id, prompt, *args, **kw):
        prompts.append(prompt["prompt"])
        return original(self, request_id, prompt, *args, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\nand then?\n/exit\nnever\n"))
    assert main(["chat", "--model", model, *FAST, "--system", "be brief"]) == 0
    replies = capsys.readouterr().out.splitlines()
    assert len(prompts) == 2 and len(replies) == 2
    assert "be brief" in prompts[0] and "hello there" in prompts[0]
    assert prompts[1].startswith(prompts[0]) or "hello there" in prompts[1]
    assert replies[0] in prompts[1] and "and then?" in prompts[1]
    assert not any("never" in p for p in prompts)


# ---- start-up messages and errors ---------------------------------------------------------
def test_backend_line_says_whether_it_was_requested(model, capsys):
    assert main(["generate", "--model", model, "--prompt", "x", *FAST]) == 0
    assert "backend 'cpu' (the default" in capsys.readouterr().err
    assert main(["generate", "--model", model, "--prompt", "x", *FAST, "--backend", "cpu"]) == 0
    assert "backend 'cpu' (requested with --backend)" in capsys.readouterr().err


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path, capsys):
    from cadence.engine_args import EngineArgs

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "n_embed": 64}))
    with pytest.raises(ValueError, match="BloomForCausalLM.*LlamaForCausalLM"):
        EngineArgs(model=str(tmp_path)).create_engine_config()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "unsupported architecture BloomForCausalLM" in err and "Qwen3ForCausalLM" in err
    assert "Traceback" not in err


def test_serve_on_a_taken_port_says_so_and_fails(model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "cadence.cli.main", "serve", "--model", model,
             "--port", str(port)], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_announces_its_address_only_once_listening(monkeypatch, capsys):
    import uvicorn

    async def app(scope, receive, send):  # an ASGI app with no lifespan support
        raise RuntimeError("not called")

    seen: dict[str, object] = {}
    original_startup = uvicorn.Server.startup

    async def startup(self, sockets=None):
        seen["before"] = capsys.readouterr().err
        await original_startup(self, sockets=sockets)

    async def main_loop(self):  # instead of serving: check the port, then stop
        seen["after"] = capsys.readouterr().err
        with socket.create_connection(sock.getsockname(), timeout=5):
            seen["connected"] = True

    monkeypatch.setattr(uvicorn.Server, "startup", startup)
    monkeypatch.setattr(uvicorn.Server, "main_loop", main_loop)
    sock = cli.bind_socket("127.0.0.1", 0)
    try:
        cli.serve_app(app, sock, "cadence: serving on PORT", log_level="warning",
                      lifespan="off")
    finally:
        sock.close()
    assert "serving" not in seen["before"]
    assert "cadence: serving on PORT" in seen["after"] and seen["connected"]


# ---- mistakes in flags and files: one line naming them, before the model loads -----------
@pytest.mark.parametrize(("flags", "words"), [
    (["--cpu-kv-cache-gb", "0"], "--cpu-kv-cache-gb must be a number of GiB > 0"),
    (["--cpu-kv-cache-gb", "nan"], "--cpu-kv-cache-gb must be"),
    (["--cpu-kv-cache-gb", "inf"], "--cpu-kv-cache-gb must be"),
    (["--max-model-len", "0"], "max_model_len must be an integer >= 1"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be an integer >= 1"),
    (["--step-timeout", "1e10"], "step_timeout must be a number of seconds"),
    (["--dtype", "float16", "--cpu-linear", "packed"], None),
])
def test_a_bad_flag_is_one_line_naming_it(model, capsys, flags, words):
    if words is None:  # only on CPUs without fp16 oneDNN support
        from cadence.backends.cpu.linear import packed_fp16_available

        if packed_fp16_available():
            pytest.skip("this CPU runs oneDNN's packed fp16 weights")
        words = "cpu linear 'packed' in float16 needs"
    assert main(["generate", "--model", model, "--prompt", "x", *FAST, *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_auto_applies_the_options_of_the_backend_it_picks(model, capsys):
    """--backend auto picks cpu here: its --cpu-* options apply (a KV cache too small for
    one sequence is refused, as with --backend cpu)."""
    assert main(["generate", "--model", model, "--prompt", "x", *FAST, "--backend", "auto",
                 "--cpu-kv-cache-gb", "0.00001"]) == 2
    assert "the KV cache holds" in capsys.readouterr().err


def test_step_timeout_inf_is_no_limit(model, capsys):
    assert main(["generate", "--model", model, "--prompt", "x", *FAST,
                 "--step-timeout", "inf"]) == 0
    assert "finish_reason=length" in capsys.readouterr().out


def test_damaged_gguf_and_config_files_are_named(model, tmp_path, capsys):
    import shutil

    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert main(["generate", "--model", str(bad), "--prompt", "x"]) == 2
    assert "is not a readable GGUF file" in capsys.readouterr().err
    folder = tmp_path / "list-config"
    shutil.copytree(model, folder)
    (folder / "config.json").write_text("[1, 2]")
    assert main(["generate", "--model", str(folder), "--prompt", "x"]) == 2
    assert "config.json must hold a JSON object" in capsys.readouterr().err


def test_generate_fails_when_a_prompt_fails(model, monkeypatch, capsys):
    """A request that ends with finish_reason=error makes the exit status non-zero."""
    from cadence.engine import LLMEngine

    step = LLMEngine.step

    def failing(self):
        outs = step(self)
        for out in outs:
            for c in out.outputs:
                if c.finished:
                    c.finish_reason = "error"
        return outs

    monkeypatch.setattr(LLMEngine, "step", failing)
    assert main(["generate", "--model", model, "--prompt", "x", *FAST]) == 1
    assert "error: 1 of 1 prompts failed" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "words"), [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-pending-requests", "0"], "--max-pending-requests must be >= 1"),
    (["--max-logprobs", "-2"], "--max-logprobs must be >= 0, or -1"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
])
def test_serve_refuses_bad_limits_before_loading(model, capsys, flags, words):
    pytest.importorskip("fastapi", reason="engine serve needs the server extra")
    assert main(["serve", "--model", model, *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_chat_without_a_template_is_refused_at_start(model, tmp_path, monkeypatch, capsys):
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(model, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(folder), *FAST]) == 2
    assert "has none; use engine generate --prompt" in capsys.readouterr().err


def test_options_of_another_backend_are_named_as_ignored(model, caplog, monkeypatch):
    """Each plugin warns about its own options when another backend runs (they would
    otherwise be dropped without a word); --enforce-eager, shared by cuda and hpu, once;
    a second configuration in the same process (engine bench builds two) says nothing
    new."""
    import logging

    from cadence import plugins
    from cadence.engine_args import EngineArgs

    monkeypatch.setattr(plugins, "_WARNED", set())

    extra = {"gpu_memory_utilization": 5.0, "hpu_bucketing": "linear", "enforce_eager": True,
             "cpu_overlap": "sync"}
    with caplog.at_level(logging.WARNING, logger="cadence.plugins"):
        EngineArgs(model=model).create_engine_config(extra)
        EngineArgs(model=model).create_engine_config(extra)
    lines = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert sorted(lines) == [
        ("backend 'cpu' ignores --enforce-eager, --gpu-memory-utilization (options of the "
         "cuda backend)"),
        "backend 'cpu' ignores --hpu-bucketing (options of the hpu backend)"]


def test_enforce_eager_is_named_as_ignored_by_the_builtin_backends_only(caplog, monkeypatch):
    """The hpu backend has no such knob (named); a plugin's backend may have one (not)."""
    import logging

    from cadence import plugins
    from cadence.backends import cuda

    monkeypatch.setattr(plugins, "_WARNED", set())

    with caplog.at_level(logging.WARNING, logger="cadence.plugins"):
        cuda.cadence_configure({"backend": "hpu", "enforce_eager": True})
        cuda.cadence_configure({"backend": "someplugin", "enforce_eager": True})
    assert [r.getMessage() for r in caplog.records] == [
        "backend 'hpu' ignores --enforce-eager (options of the cuda backend)"]
