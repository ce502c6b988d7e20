"""CPU tests of the CUDA backend's host logic: buckets and padding, input packing, the overlap
order against a recorded event log, the double-buffer waits, memory sizing, options, plugin
hooks and the probe. No GPU and no triton needed."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cadence.backends.cuda as plugin
from cadence.backend import ModelInput, PostSample, SamplerOutput, SamplingMetadata
from cadence.backends.cuda import CudaOptions
from cadence.backends.cuda.backend import (
    OVERLAP_ORDER,
    CudaBackend,
    execute_overlapped,
    kv_cache_bytes,
    profile_input,
)
from cadence.backends.cuda.buffers import InputStager, OutputCopier
from cadence.backends.cuda.graphs import (
    bucket_for,
    capture_sizes,
    graph_layout,
    pack_padded,
    pad_decode,
)
from cadence.layers.sampler import DeviceSample


def _sampling(n: int) -> SamplingMetadata:
    return SamplingMetadata([0.0] * n, [0] * n, [1.0] * n, [0.0] * n, [None] * n, [0] * n, True)


def _decode(seq_lens: list[int], tables: list[list[int]]) -> ModelInput:
    n = len(seq_lens)
    return ModelInput([5 + i for i in range(n)], [s - 1 for s in seq_lens],
                      [100 + i for i in range(n)], [1] * n, seq_lens, tables, n,
                      list(range(n)), _sampling(n))


# -- buckets and padding ----------------------------------------------------------------------

def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in itertools.pairwise(sizes[3:]))
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_sizes(0)


def test_bucket_for() -> None:
    sizes = capture_sizes(32)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16,
                                                                          24, 32]
    assert bucket_for(33, sizes) is None  # above the largest bucket: eager


def test_pad_decode_rows_are_inert() -> None:
    mi = _decode([7, 3, 20], [[4], [2], [9, 1]])
    padded = pad_decode(mi, 8, dummy_block=99)
    assert padded.input_ids[:3] == mi.input_ids and len(padded.input_ids) == 8
    assert padded.slot_mapping == [100, 101, 102] + [-1] * 5  # the KV write skips these
    assert padded.seq_lens == [7, 3, 20] + [1] * 5
    assert padded.block_tables == [[4], [2], [9, 1]] + [[99]] * 5
    with pytest.raises(ValueError):
        pad_decode(mi, 2, 99)
    prefill = ModelInput([1, 2], [0, 1], [0, 1], [2], [2], [[0]], 0, [0], _sampling(1))
    with pytest.raises(ValueError):
        pad_decode(prefill, 4, 99)


def test_pack_padded_into_graph_layout() -> None:
    layout = graph_layout(8, width=3)
    flat = np.full(layout.size, -7, dtype=np.int64)
    padded = pad_decode(_decode([7, 3, 20], [[4], [2], [9, 1]]), 4, dummy_block=99)
    pack_padded(flat, layout, padded)
    views = layout.split(torch.from_numpy(flat))
    assert views.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert views.slot_mapping[:4].tolist() == [100, 101, 102, -1]
    assert views.seq_lens[:4].tolist() == [7, 3, 20, 1]
    assert views.block_tables[:4, 0].tolist() == [4, 2, 9, 99]
    assert views.block_tables[2, 1] == 1
    assert layout.size_for_rows(4) == layout.tables_offset + 12


# -- the overlap order --------------------------------------------------------------------------

class FakeDevice:
    """Stands in for the GPU: records when each device step is called into the shared log."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def launch(self, mi: ModelInput) -> str:
        self.log.append("dev:launch")
        return "logits"

    def sample(self, logits: str, sampling: SamplingMetadata) -> str:
        assert logits == "logits"
        self.log.append("dev:sample")
        return "sampled"

    def start_copy(self, sampled: str) -> str:
        assert sampled == "sampled"
        self.log.append("dev:copy")
        return "handle"

    def finish_copy(self, handle: str) -> SamplerOutput:
        self.log.append("dev:sync")
        return SamplerOutput([42])


def test_execute_overlapped_order() -> None:
    device_log: list[str] = []
    events: list[str] = []
    post = PostSample(lambda: device_log.append("host:post_sample"))
    out = execute_overlapped(FakeDevice(device_log), _decode([3], [[0]]), post, events)
    assert out.sampled_token_ids == [42]
    assert tuple(events) == OVERLAP_ORDER
    # post_sample runs after the launch is enqueued and before sampling is.
    assert device_log == ["dev:launch", "host:post_sample", "dev:sample", "dev:copy",
                          "dev:sync"]
    assert post.called


def test_post_sample_error_stops_the_step_before_sampling() -> None:
    device_log: list[str] = []

    def boom() -> None:
        raise RuntimeError("host work failed")

    with pytest.raises(RuntimeError, match="host work failed"):
        execute_overlapped(FakeDevice(device_log), _decode([3], [[0]]), PostSample(boom))
    assert device_log == ["dev:launch"]


def test_cuda_backend_execute_uses_the_overlap_strategy() -> None:
    backend = object.__new__(CudaBackend)  # no GPU: skip __init__, drive the device steps
    device_log: list[str] = []
    fake = FakeDevice(device_log)
    backend.launch, backend.sample = fake.launch, fake.sample
    backend.start_copy, backend.finish_copy = fake.start_copy, fake.finish_copy
    backend.event_log = []
    for _ in range(2):
        post = PostSample(lambda: device_log.append("host:post_sample"))
        assert backend.execute(_decode([3], [[0]]), post).sampled_token_ids == [42]
    assert backend.event_log == list(OVERLAP_ORDER) * 2
    assert device_log.count("host:post_sample") == 2


# -- double buffers -------------------------------------------------------------------------

class FakeEvent:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")

    def record(self, stream: object = None) -> None:
        self.log.append(f"record {self.name}")


def test_input_stager_waits_on_a_buffer_before_refilling_it() -> None:
    log: list[str] = []
    stager = InputStager(16, "cpu")
    stager._events = [FakeEvent("A", log), FakeEvent("B", log)]
    for step in range(3):
        out = stager.stage(4, lambda a, s=step: (log.append("fill"), a.__setitem__(
            slice(None), s)))
        assert out.tolist() == [step] * 4
    assert log == ["wait A", "fill", "record A", "wait B", "fill", "record B",
                   "wait A", "fill", "record A"]


def test_output_copier_alternates_buffers_and_copies_logprobs() -> None:
    log: list[str] = []
    copier = OutputCopier("cpu", max_rows=2)
    copier._events = [FakeEvent("A", log), FakeEvent("B", log)]
    first = copier.start(DeviceSample(torch.tensor([3, 4, 5])))  # grows past max_rows
    lp = (torch.tensor([-0.5]), torch.tensor([1]), torch.tensor([[3, 1]]),
          torch.tensor([[-0.5, -1.0]]))
    second = copier.start(DeviceSample(torch.tensor([9]), lp, [2]))
    assert (first.buffer, second.buffer) == (0, 1)
    assert copier.finish(first).sampled_token_ids == [3, 4, 5]
    out = copier.finish(second)
    assert out.sampled_token_ids == [9]
    assert out.logprobs == [(-0.5, 1, [3, 1], [-0.5, -1.0])]
    assert log == ["wait A", "record A", "wait B", "record B", "wait A", "wait B"]


# -- memory, options, plugin ------------------------------------------------------------------

def test_kv_cache_bytes() -> None:
    gib = 1 << 30
    # 100 GiB card, 10 GiB free; torch holds 80 GiB reserved, so 10 GiB is used outside it.
    assert kv_cache_bytes(100 * gib, 10 * gib, 20 * gib, 80 * gib, 0.9) == 60 * gib
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(100 * gib, 90 * gib, 20 * gib, 10 * gib, 0.1)


def test_profile_input_is_the_largest_step_and_writes_nothing() -> None:
    mi = profile_input(max_tokens=100, max_seqs=8, max_model_len=64)
    assert mi.num_tokens == 100 and mi.num_seqs == 8 and mi.num_decodes == 0
    assert sum(mi.query_lens) == 100 and max(mi.query_lens) == 64  # the longest prompt
    assert min(mi.query_lens) >= 1
    assert set(mi.slot_mapping) == {-1}
    assert len(mi.sampling.temperature) == len(mi.sample_seq_indices) == 8
    small = profile_input(max_tokens=8192, max_seqs=2, max_model_len=16)
    assert small.num_tokens == 32 and small.query_lens == [16, 16]
    # With speculative drafts a step samples up to 1 + k rows per sequence: so does the
    # profile, or the sampler's buffers outgrow what the KV cache left them.
    spec = profile_input(max_tokens=100, max_seqs=8, max_model_len=64, rows_per_seq=4)
    assert len(spec.sampled_rows()) == len(spec.sampling.temperature) == 4 * 8
    assert sum(spec.query_lens) == 100 and max(spec.query_lens) == 64
    assert spec.sampled_rows()[:4] == [60, 61, 62, 63]
    assert spec.sample_seq_indices[:5] == [0, 0, 0, 0, 1]


@pytest.mark.parametrize(("context_len", "fused_context", "dims"),
                         [(0, False, 4), (0, True, 4), (5, True, 4), (5, False, 3)])
def test_prefill_attention_kernel_choice_and_values(monkeypatch, context_len: int,
                                                    fused_context: bool, dims: int) -> None:
    """SDPA's fused kernels (CUDA and CPU) take only 4-D inputs (3-D runs the math kernel and
    its [H, Lq, Lk] scores): fresh prompts always go 4-D, context chunks only when asked
    (the CUDA backend asks; the CPU keeps the math kernel there for exactness). Every choice
    is checked against softmax attention written out."""
    import cadence.backends.cuda.attention as attn
    from cadence.layers import paged_attention as ref

    assert attn.run_prefills is ref.run_prefills
    torch.manual_seed(0)
    lq, heads, kvh, dim = 7, 4, 2, 16
    q = torch.randn(lq, heads, dim)
    k, v = torch.randn(context_len + lq, kvh, dim), torch.randn(context_len + lq, kvh, dim)
    seen: list[int] = []
    sdpa = ref.F.scaled_dot_product_attention

    def spy(query, *a, **kw):
        seen.append(query.dim())
        return sdpa(query, *a, **kw)

    monkeypatch.setattr(ref.F, "scaled_dot_product_attention", spy)
    out = ref.prefill_attention(q, k, v, context_len, dim ** -0.5, fused_context)
    monkeypatch.undo()
    assert seen == [dims]
    kr = k.repeat_interleave(heads // kvh, dim=1)
    vr = v.repeat_interleave(heads // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * dim ** -0.5
    allowed = torch.arange(context_len + lq)[None] <= torch.arange(context_len,
                                                                    context_len + lq)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    expected = torch.einsum("hqk,khd->qhd", probs, vr)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_init_makes_the_backend_device_current(monkeypatch) -> None:
    """Triton launches on the current device, not the tensors': "cuda:1" must become it."""
    from cadence.backends.cuda import runtime

    current: list[torch.device] = []
    monkeypatch.setattr(runtime.torch.cuda, "set_device", current.append)
    monkeypatch.setattr(runtime, "ModelRunner", lambda config, device: ("runner", device))
    be = SimpleNamespace(options=CudaOptions(device="cuda:1"), config=None)
    runtime.init(be)
    assert be.device == torch.device("cuda", 1) and current == [be.device]
    assert be.runner == ("runner", be.device)


def test_a_rank_takes_the_gpu_it_can_see(monkeypatch) -> None:
    """mp: every GPU of the host is visible and a rank takes cuda:LOCAL_RANK. ray: Ray makes
    the one GPU of the rank's bundle its only visible device (CUDA_VISIBLE_DEVICES), so the
    second rank on a node takes cuda:0, not cuda:1."""
    from cadence.backends.cuda import runtime

    assert [runtime.rank_device(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [runtime.rank_device(r, 1) for r in range(3)] == [0, 0, 0]
    with pytest.raises(ValueError, match="rank 5 is rank 2 on its host, which has 2 visible"):
        runtime.rank_device(2, 2, 5)
    with pytest.raises(ValueError, match="which has 0 visible GPUs"):
        runtime.rank_device(0, 0)

    current: list[torch.device] = []
    monkeypatch.setattr(runtime.torch.cuda, "set_device", current.append)
    monkeypatch.setattr(runtime, "ModelRunner", lambda config, device: ("runner", device))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    parallel = SimpleNamespace(world_size=4)
    for visible, expected in ((1, 0), (2, 1)):
        monkeypatch.setattr(runtime.torch.cuda, "device_count", lambda n=visible: n)
        be = SimpleNamespace(options=CudaOptions(),
                             config=SimpleNamespace(parallel_config=parallel))
        runtime.init(be)
        assert be.device == torch.device("cuda", expected) and current[-1] == be.device


def _config(**opts: object) -> SimpleNamespace:
    return SimpleNamespace(backend_option=lambda k, d=None: opts.get(k, d),
                           backend_options=opts, scheduler_config=SimpleNamespace(max_num_seqs=64))


def test_cuda_options() -> None:
    default = CudaOptions.from_config(_config())
    assert (default.enforce_eager, default.gpu_memory_utilization) == (False, 0.9)
    assert default.cuda_graph_max_bs == 64  # capped by max_num_seqs
    opts = CudaOptions.from_config(_config(enforce_eager=True, cuda_graph_max_bs=16))
    assert opts.enforce_eager and opts.cuda_graph_max_bs == 16
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CudaOptions.from_config(_config(gpu_memory_utilization=1.5))
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        CudaOptions(cuda_graph_max_bs=0)


def test_cli_options_and_configure() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--enforce-eager", action="store_true")  # another plugin's copy
    plugin.cadence_add_cli_options(parser=parser)
    args = vars(parser.parse_args(["--enforce-eager", "--gpu-memory-utilization", "0.5",
                                   "--cuda-graph-max-bs", "32"]))
    config = {"backend": "cuda", "dtype": "auto", **args}
    plugin.cadence_configure(config=config)
    assert config["dtype"] == "bfloat16"
    assert config["backend_options"] == {"enforce_eager": True, "gpu_memory_utilization": 0.5,
                                         "cuda_graph_max_bs": 32}
    other = {"backend": "cpu", **args}
    plugin.cadence_configure(config=other)
    assert "backend_options" not in other


def test_async_scheduling_is_on_by_default_unless_asked_otherwise() -> None:
    from dataclasses import asdict

    from cadence.cli.main import build_parser
    from cadence.engine_args import EngineArgs

    def resolved(argv: list[str], backend: str = "cuda") -> object:
        ns = build_parser().parse_args(["generate", "--prompt", "x", "--backend", backend,
                                        *argv])
        config = asdict(EngineArgs.from_cli_args(ns)[0])
        plugin.cadence_configure(config=config)
        return config["async_scheduling"]

    assert resolved([]) is True
    assert resolved(["--no-async-scheduling"]) is False
    assert resolved(["--async-scheduling"]) is True
    # Async output turned off asks for the sync engine; the default does not override it.
    assert resolved(["--disable-async-output-proc"]) is None
    assert resolved([], backend="cpu") is None  # another backend's choice, not CUDA's


_PROBE_SCRIPT = """
import json, sys
from cadence.plugins import get_registry
import cadence.backends.cuda.backend as b
reg = get_registry()
r = b.CudaBackend.probe()
try:
    reg.select("cuda")
    err = ""
except ValueError as e:
    err = str(e)
import torch
print(json.dumps({"available": r.available, "reason": r.reason, "select_error": err,
                  "registered": "cuda" in reg.backends,
                  "triton": "triton" in sys.modules,
                  "cuda_init": torch.cuda.is_initialized()}))
"""


def test_probe_in_a_fresh_process() -> None:
    proc = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], capture_output=True,
                          text=True, timeout=120, check=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["registered"]
    assert not res["triton"], "probing or importing the cuda backend imported triton"
    assert not res["cuda_init"], "probing initialised CUDA"
    if torch.version.cuda is None:
        assert not res["available"] and "not a CUDA build" in res["reason"]
        assert "not available" in res["select_error"] and "not a CUDA build" in res[
            "select_error"]


@pytest.mark.parametrize("line, cuda", [("cuda: Optional[str] = None", None),
                                        ("cuda = '12.4'", "12.4"),
                                        ("cuda: Optional[str] = '12.8'", "12.8")])
def test_probe_reads_torch_version_file_without_importing_torch(tmp_path, monkeypatch, line,
                                                                cuda) -> None:
    import importlib.util

    import cadence.backends.cuda.backend as b

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "version.py").write_text(f"from typing import Optional\n__version__ = '9.9.9'\n"
                                    f"{line}\nhip: Optional[str] = None\n")
    real = importlib.util.find_spec
    triton_spec = real("json")  # any spec: "triton is installed"

    def fake(name: str, *a: object) -> object:
        if name == "torch":
            return SimpleNamespace(submodule_search_locations=[str(pkg)])
        return triton_spec if name == "triton" else real(name, *a)

    monkeypatch.setattr(b.importlib.util, "find_spec", fake)
    assert b._torch_version_file() == ("9.9.9", cuda)
    monkeypatch.setattr(b, "_nvidia_device_missing", lambda: None)
    r = CudaBackend.probe()
    if cuda is None:
        assert not r.available and r.reason == "torch 9.9.9 is not a CUDA build"
    else:
        assert r.available and r.reason == f"torch 9.9.9, CUDA {cuda}"
        monkeypatch.setattr(b, "_nvidia_device_missing", lambda: "no NVIDIA device found (x)")
        assert CudaBackend.probe().reason == "no NVIDIA device found (x)"
        triton_spec = None
        assert "triton is not installed" in CudaBackend.probe().reason


def test_probe_device_check_honours_cuda_visible_devices(monkeypatch) -> None:
    import cadence.backends.cuda.backend as b

    for hidden in ("", "-1", " -1,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert "hides all" in b._nvidia_device_missing()


def test_sampler_builds_every_parameter_tensor_through_host_tensor(monkeypatch) -> None:
    """On CUDA, ``torch.tensor(values, device=cuda)`` is a pageable copy that first waits for
    the forward; the sampler must build its per-step tensors with ``host_tensor`` (pinned,
    non-blocking). Checked on the CPU: with every feature on, no other call names a device."""
    from cadence.backend import SamplingMetadata
    from cadence.layers import sampler

    calls: list[dict] = []
    real = torch.tensor

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    meta = SamplingMetadata(
        temperature=[0.0, 0.7, 1.3], top_k=[0, 5, 0], top_p=[1.0, 0.9, 0.8],
        min_p=[0.0, 0.05, 0.0], seeds=[None, 3, None], output_lens=[1, 2, 3], all_greedy=False,
        presence_penalty=[0.0, 0.5, 0.0], frequency_penalty=[0.1, 0.0, 0.0],
        repetition_penalty=[1.0, 1.2, 1.0], prompt_token_ids=[[1, 2], [3], [4, 5, 6]],
        output_token_ids=[[7], [8, 9], []], banned_token_ids=[[0], [], [2]],
        num_logprobs=[2, -1, 0], max_num_logprobs=2)
    monkeypatch.setattr(sampler.torch, "tensor", spy)
    out = sampler.sample(torch.randn(3, 11), meta, torch.Generator().manual_seed(0))
    monkeypatch.undo()
    assert out.token_ids.shape == (3,)
    assert calls, "host_tensor builds on the host with torch.tensor"
    assert all("device" not in kw for kw in calls), calls
    pinned = sampler.host_tensor([1.0, 2.0], torch.float32, torch.device("cpu"))
    assert pinned.tolist() == [1.0, 2.0] and pinned.dtype == torch.float32


def test_launch_makes_the_device_current_in_the_stepping_thread(monkeypatch) -> None:
    """AsyncLLM steps the engine from its own thread, where the current device is 0 again."""
    from cadence.backends.cuda import runtime

    current = [0]
    calls: list[torch.device] = []
    monkeypatch.setattr(runtime.torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(runtime.torch.cuda, "set_device",
                        lambda d: (calls.append(d), current.__setitem__(0, d.index)))
    be = SimpleNamespace(device=torch.device("cuda", 1))
    runtime.ensure_current_device(be)
    runtime.ensure_current_device(be)
    assert calls == [torch.device("cuda", 1)]  # set once, then already current
    runtime.ensure_current_device(SimpleNamespace(device=torch.device("cpu")))
    assert calls == [torch.device("cuda", 1)]
