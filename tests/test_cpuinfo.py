"""The CPU's flags, and torch's ATEN_CPU_CAPABILITY capping them: an AVX-512 machine that is
told to act as an AVX2 one must compile, choose dtypes and report as one."""

from __future__ import annotations

import pytest

from cadence import cpuinfo
from cadence.backends.cpu import dtype as cpu_dtype
from cadence.backends.cpu import kernels


@pytest.fixture
def capped(monkeypatch):
    """cpu_info() re-read under a given ATEN_CPU_CAPABILITY; the cache is restored after."""
    def cap(value: str | None) -> cpuinfo.CpuInfo:
        if value is None:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", value)
        cpuinfo.cpu_info.cache_clear()
        cpuinfo._torch_facts.cache_clear()  # a child asked under another cap is stale
        return cpuinfo.cpu_info()

    yield cap
    monkeypatch.undo()
    cpuinfo.cpu_info.cache_clear()
    cpuinfo._torch_facts.cache_clear()


def test_avx2_cap_hides_the_wider_flags(capped) -> None:
    full = capped(None)
    assert full.isa_limit is None
    info = capped("avx2")
    assert info.isa_limit == "avx2"
    assert not any(f.startswith(("avx512", "amx")) for f in info.flags)
    assert not info.has_native_bf16
    # Everything at or below AVX2 is kept as the hardware reports it.
    assert info.flags == {f for f in full.flags if not f.startswith(("avx512", "amx"))}
    assert cpuinfo.describe(2, "float32")["isa_limit"] == "avx2"


def test_default_cap_hides_avx_too_and_unknown_values_hide_nothing(capped) -> None:
    full = capped(None)
    info = capped("default")
    assert not any(f.startswith(("avx", "fma", "amx")) for f in info.flags)
    for value in ("avx512", "AVX512", "zen9"):
        assert capped(value).flags == full.flags
        assert cpuinfo.cpu_info().isa_limit is None
    assert "isa_limit" not in cpuinfo.describe(2, "float32")


def test_capped_kernels_target_the_level_and_build_apart(capped, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    sources = [kernels.Path(kernels.__file__).parent / "csrc" / s for s in kernels._SOURCES]
    capped(None)
    native_flags, native_dir = kernels.cflags(), kernels._build_dir(sources)
    assert "-march=native" in native_flags
    capped("avx2")
    flags = kernels.cflags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert "-mtune=native" in flags and "-fopenmp" in flags
    assert kernels._build_dir(sources) != native_dir
    capped("default")
    assert "-march=x86-64-v2" in kernels.cflags()


def test_dtype_auto_under_the_avx2_cap_is_float32(capped, tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    capped("avx2")
    assert cpu_dtype.resolve_auto_dtype(str(tmp_path)) == "float32"
    assert "no native bf16" in capsys.readouterr().err


def test_packed_bf16_gemm_is_refused_by_name_on_an_avx2_cpu(capped) -> None:
    import torch

    from cadence.backends.cpu import linear as cpu_linear
    from cadence.backends.cpu import linear_choice as cpu_choice

    lin = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    capped("avx2")
    assert not cpu_linear.packed_bf16_available()
    with pytest.raises(ValueError, match=r"needs AVX-512 .* or AVX-NE-CONVERT.*--cpu-linear torch"):
        cpu_linear.PackedLinear(lin)
    with pytest.raises(ValueError, match="--dtype float32"):
        cpu_choice.choose_linear("packed", torch.nn.Sequential(lin), torch.bfloat16)
    assert cpu_choice.choose_linear("auto", torch.nn.Sequential(lin), torch.bfloat16) == "torch"
    # fp32 packs at any level oneDNN runs at.
    assert cpu_linear.PackedLinear(lin.float()).weight_dtype == torch.float32


def _run(code: str) -> dict:
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_torch_facts_come_from_a_child_when_torch_is_not_loaded() -> None:
    import torch

    got = _run("import json, sys\n"
               "from cadence.cpuinfo import _torch_facts, torch_facts, describe\n"
               "facts = torch_facts(); machine = describe(facts['num_threads'], 'float32')\n"
               "loaded = 'torch' in sys.modules\n"
               "_torch_facts.cache_clear(); sys.executable = '/nonexistent/python'\n"
               "print(json.dumps({'facts': facts, 'machine': machine, 'loaded': loaded,\n"
               "                  'failed': torch_facts()}))")
    assert not got["loaded"]
    assert got["facts"]["version"] == torch.__version__
    assert got["facts"]["capability"] == str(torch.backends.cpu.get_cpu_capability())
    assert got["facts"]["num_threads"] >= 1
    assert got["machine"]["torch_cpu_capability"] == got["facts"]["capability"]
    # A child that cannot start leaves the facts unknown rather than failing a benchmark.
    assert got["failed"] == {"version": "unknown", "capability": "unknown", "num_threads": None}


def test_torch_facts_ask_torch_itself_once_it_is_loaded(monkeypatch) -> None:
    import subprocess

    import torch

    def no_child(*a, **kw):
        raise AssertionError("torch is loaded; no child interpreter should be started")

    monkeypatch.setattr(subprocess, "run", no_child)
    cpuinfo._torch_facts.cache_clear()
    try:
        facts = cpuinfo.torch_facts()
        facts["version"] = "changed by a caller"  # a copy: the cached facts stay
        facts = cpuinfo.torch_facts()
    finally:
        cpuinfo._torch_facts.cache_clear()
    assert facts == {"version": torch.__version__,
                     "capability": str(torch.backends.cpu.get_cpu_capability()),
                     "num_threads": torch.get_num_threads()}


def test_bench_records_leave_the_engine_process_without_torch(tiny_model_dir) -> None:
    """The engine process of a CPU engine whose model runs in a worker process never loads
    torch; the bench's env and machine blocks must not load it either (it changed what
    async output processing measured)."""
    model = tiny_model_dir("llama")
    got = _run("import json, sys\n"
               "from cadence import LLM\n"
               "from cadence.bench.report import env_info, machine_info\n"
               f"llm = LLM(model={model!r}, backend_options={{'kv_cache_gb': 0.05}})\n"
               "env, machine = env_info(llm.engine), machine_info(llm.engine)\n"
               "print(json.dumps({'loaded': 'torch' in sys.modules, 'env': env,\n"
               "                  'machine': machine}))")
    assert not got["loaded"]
    assert got["env"]["backend_env"]["cpu_threads"] == str(got["machine"]["threads"])
    assert got["env"]["torch"] == got["env"]["backend_env"]["torch"] != "unknown"
