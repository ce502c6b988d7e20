"""The bf16 GEMM on the compiled AMX tile loop (backends/cpu/csrc/amx_linear.cpp): its
arithmetic, its rows' independence from the batch, how it is chosen and refused, and an
engine run on it. Where the CPU has no AMX the kernel tests skip, and the refusals are still
checked on any CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import greedy_with_logprobs
from test_cpu_kernels import _linear as kernels_linear
from test_engine_parity import NUM_TOKENS, _prompts

from cadence.backends.cpu import gated
from cadence.backends.cpu import linear as cpu_linear
from cadence.backends.cpu import linear_choice as cpu_choice
from cadence.backends.cpu.fused import KernelSiluAndMul
from cadence.layers.linear import Linear

_NO_AMX = "this CPU has no AMX bf16 tiles (amx_tile, amx_bf16), or the CPU kernels did not build"
needs_amx = pytest.mark.skipif(cpu_linear.amx_ops() is None, reason=_NO_AMX)


def _linear(k: int, n: int, bias: bool, seed: int, dtype=torch.bfloat16) -> Linear:
    return kernels_linear(k, n, bias, dtype, seed)  # bf16 unless told


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
# (1536, 576): whole tiles; (64, 100): a last column block of 4; (40, 24): K not a whole
# number of 32-wide steps (x and the weight are zero-padded) and one partial block.
@pytest.mark.parametrize("k,n", [(1536, 576), (64, 100), (40, 24)])
def test_amx_linear_matches_reference_and_is_batch_invariant(k, n, bias) -> None:
    lin = _linear(k, n, bias, seed=3 + int(bias))
    gemm = cpu_linear.AmxLinear(lin)
    assert (gemm.in_features, gemm.out_features) == (k, n)
    x = torch.randn(333, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.no_grad():
        full = gemm(x)
        assert full.shape == (333, n) and full.dtype == torch.bfloat16
        reference = F.linear(x.float(), lin.weight.float(),
                             None if lin.bias is None else lin.bias.float())
        # One bf16 rounding of an fp32 sum: within bf16's half ulp of the exact result.
        torch.testing.assert_close(full.float(), reference, atol=1e-2, rtol=8e-3)
        # Row counts on and off the 16-row tiles and the row chunks (one chunk up to 256
        # rows; 257-512 split in two equal ones).
        for m in (*range(1, 70), 255, 256, 257, 300):
            assert torch.equal(gemm(x[:m]), full[:m]), f"first {m} rows"
            assert torch.equal(gemm(x[-m:]), full[-m:]), f"last {m} rows"
        # Rows at a stride (a view of a wider tensor) give the same bits as contiguous ones:
        # with 333 rows through the padded copy, with 320 (whole tiles) and K a whole number
        # of steps read in place at that stride.
        wide = torch.cat([x, x], dim=1)[:, :k]
        assert torch.equal(gemm(wide), full)
        assert torch.equal(gemm(wide[:320]), full[:320])


@needs_amx
def test_amx_linear_takes_any_row_count_without_the_aligned_copy(monkeypatch) -> None:
    """The tile loop pads to whole tiles itself, so the module skips ``row_aligned``; the other
    kernels' modules still go through it."""
    lin = _linear(64, 48, True, seed=5)
    gemm = cpu_linear.AmxLinear(lin)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        full = gemm(torch.cat([x, torch.zeros(1, 64, dtype=torch.bfloat16)]))[:7]

        def refuse(gemm_fn, rows):
            raise AssertionError("the AMX module padded its rows")

        monkeypatch.setattr(cpu_linear, "row_aligned", refuse)
        assert torch.equal(gemm(x), full)
        with pytest.raises(AssertionError, match="padded"):
            cpu_linear.PackedLinear(_linear(64, 48, True, seed=5, dtype=torch.float32))(x.float())


@needs_amx
def test_amx_linear_rows_do_not_depend_on_the_thread_count() -> None:
    lin = _linear(1536, 576, True, seed=8)
    gemm, fused = cpu_linear.AmxLinear(lin), gated.AmxGatedLinear(_linear(576, 3072, True, 9))
    g = torch.Generator().manual_seed(3)
    x, h = torch.randn(96, 1536, generator=g), torch.randn(96, 576, generator=g)
    x, h = x.to(torch.bfloat16), h.to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = gemm(x), fused(h)
            torch.set_num_threads(3)
            three = gemm(x), fused(h)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], three[0]) and torch.equal(one[1], three[1])


@needs_amx
def test_amx_linear_refuses_mismatched_inputs() -> None:
    ops = cpu_linear.amx_ops()
    packed = ops.amx_pack(_linear(64, 40, False, seed=0).weight.detach())
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed does not match K"):
        ops.amx_linear(torch.zeros(4, 128, dtype=torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="n does not match packed"):
        ops.amx_linear(x, packed, 80)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.amx_linear(x.float(), packed, 40)
    with pytest.raises(RuntimeError, match="non-empty"):
        ops.amx_pack(torch.zeros(8, 0, dtype=torch.bfloat16))


@needs_amx
def test_amx_linear_gives_the_brgemm_micro_kernels_bits() -> None:
    # Both run tdpbf16ps over K in steps of 32; the loop differs in prefetching only.
    if cpu_linear.brgemm_ops() is None:
        pytest.skip("torch's bf16 micro-kernel does not run on this CPU")
    g = torch.Generator().manual_seed(4)
    for k, n in ((576, 960), (1536, 576), (40, 100)):  # (40, 100): padded K, partial block
        lin = _linear(k, n, True, seed=k)
        amx, brgemm = cpu_linear.AmxLinear(lin), cpu_linear.BrgemmLinear(lin)
        for m in (4, 37, 64, 300):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            with torch.no_grad():
                assert torch.equal(amx(x), brgemm(x)), (k, n, m)


@needs_amx
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k,h", [(576, 1536), (40, 48)])
def test_amx_gated_gives_the_bits_of_the_gemm_then_silu_and_mul(k, h, bias) -> None:
    gate_up = _linear(k, 2 * h, bias, seed=11 + int(bias))
    fused = gated.AmxGatedLinear(gate_up)
    assert fused.out_features == h
    unfused_gemm = cpu_linear.AmxLinear(gate_up)
    act = KernelSiluAndMul(cpu_linear.amx_ops())
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        full = fused(x)
        assert full.shape == (300, h) and full.dtype == torch.bfloat16
        assert torch.equal(full, act(unfused_gemm(x)))
        for m in (1, 2, 15, 16, 17, 37, 64, 257):
            assert torch.equal(fused(x[:m]), full[:m]), f"first {m} rows"


def test_amx_gated_width_rule() -> None:
    # Halves of whole 16-column tiles in bf16 only.
    assert gated.gated_width_ok(_linear(8, 64, False, seed=0), 16, torch.bfloat16)
    assert not gated.gated_width_ok(_linear(8, 2 * 24, False, seed=0), 16, torch.bfloat16)
    assert not gated.gated_width_ok(_linear(8, 64, False, seed=0, dtype=torch.float32), 16,
                                    torch.bfloat16)


def test_measure_streams_alternated_copies_within_its_budget(monkeypatch) -> None:
    built: list[tuple[str, tuple[int, int]]] = []
    order: list[str] = []

    def fake_gemm_of(c):
        def make(w):
            built.append((c, tuple(w.shape)))
            return lambda x: order.append(c)
        return make

    monkeypatch.setattr(cpu_choice, "_gemm_of", fake_gemm_of)
    shapes = [(64, 32), (32, 64)]
    # 2 candidates, 16 KB of fp32 weights a pass: 4 copies within a 128 KB budget.
    monkeypatch.setattr(cpu_choice, "_STREAM_BYTES", 128 * 1024)
    times = cpu_choice._measure(shapes, torch.float32, rows=4, choices=("torch", "packed"))
    assert set(times) == {"torch_s", "packed_s"}
    assert [s for c, s in built if c == "packed"] == [(64, 32), (32, 64)] * 4  # layer order
    # A warm-up call of each shape, then the passes alternate candidate by candidate.
    passes = order[4:]
    assert passes == (["torch"] * 8 + ["packed"] * 8) * cpu_choice._PASSES
    # Over budget: one candidate at a time, one copy.
    built.clear()
    order.clear()
    monkeypatch.setattr(cpu_choice, "_STREAM_BYTES", 1024)
    cpu_choice._measure(shapes, torch.float32, rows=4, choices=("torch", "packed"))
    assert len(built) == 4 and order == ["torch"] * (2 + 2 * cpu_choice._PASSES) + \
        ["packed"] * (2 + 2 * cpu_choice._PASSES)


def test_amx_choice_refused_by_name(monkeypatch) -> None:
    lin = _linear(64, 32, False, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="'amx' runs bfloat16 weights.*--dtype bfloat16"):
        cpu_choice.choose_linear("amx", torch.nn.Sequential(lin), torch.float32)
    monkeypatch.setattr(cpu_linear, "amx_ops", lambda: None)
    bf16 = _linear(64, 32, False, seed=0)
    with pytest.raises(ValueError, match="'amx' needs the compiled CPU kernels.*amx_tile.*auto"):
        cpu_choice.choose_linear("amx", torch.nn.Sequential(bf16), torch.bfloat16)
    with pytest.raises(ValueError, match="AMX"):
        cpu_linear.AmxLinear(bf16)


@needs_amx
def test_auto_measures_amx_and_takes_it_when_fastest(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CADENCE_CACHE_DIR", str(tmp_path))
    model = torch.nn.Sequential(_linear(64, 96, False, seed=0), _linear(96, 64, False, seed=1))
    measured: list[tuple[str, ...]] = []

    def fake_measure(shapes, dtype, rows=64, choices=("torch", "packed")):
        measured.append(tuple(choices))
        return {f"{c}_s": (1.0 if c == "amx" else 2.0) for c in choices}

    monkeypatch.setattr(cpu_choice, "_measure", fake_measure)
    assert cpu_choice.choose_linear("auto", model, torch.bfloat16) == "amx"
    # The brgemm micro-kernel (the same bits, no prefetching) is not timed beside it.
    assert len(measured) == 1 and "amx" in measured[0] and "brgemm" not in measured[0]
    # Forced by name, it is taken without measuring.
    assert cpu_choice.choose_linear("amx", model, torch.bfloat16) == "amx"
    assert len(measured) == 1


def _run(model: str, options: dict, prompts: list[list[int]]):
    def gemms(llm):
        return {type(m).__name__ for m in llm.engine.backend.runner.model.modules()
                if isinstance(m, cpu_linear._PrepackedLinear)}
    return greedy_with_logprobs(model, prompts, NUM_TOKENS, gemms, dtype="bfloat16",
                                backend_options={"kv_cache_gb": 0.02, **options})


@needs_amx
def test_engine_on_amx_fuses_keeps_brgemm_bits_and_async_equals_sync(tiny_model_dir,
                                                                     monkeypatch) -> None:
    model = tiny_model_dir("qwen2")  # biases on q/k/v; the MLP is Llama's
    prompts = _prompts()
    runs = {overlap: _run(model, {"overlap": overlap, "linear": "amx"}, prompts)
            for overlap in ("sync", "thread")}
    for _, _, info, gemms in runs.values():
        assert info["cpu_linear"] == "amx" and gemms == {"AmxLinear", "AmxGatedLinear"}
        assert info["cpu_fused_mlps"] == "2"
    assert runs["sync"][:2] == runs["thread"][:2]  # async == sync, logprobs bit for bit
    # Unfused (the tile loop, then the silu_and_mul kernel), and on the brgemm micro-kernel
    # (never fused): the same bits.
    monkeypatch.setattr(gated, "fuse_gated_mlps", lambda model, kind="tiled": 0)
    tokens, lps, info, gemms = _run(model, {"overlap": "sync", "linear": "amx"}, prompts)
    assert info["cpu_fused_mlps"] == "0" and gemms == {"AmxLinear"}
    assert (tokens, lps) == runs["sync"][:2]
    if cpu_linear.brgemm_ops() is not None:
        assert _run(model, {"overlap": "sync", "linear": "brgemm"}, prompts)[:2] == \
            runs["sync"][:2]
