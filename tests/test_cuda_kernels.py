"""The CUDA backend's Triton kernels against the torch reference, on the CPU.

Without a GPU, ``TRITON_INTERPRET=1`` is set before triton is first imported: then kernels
run on CPU tensors (about 0.2 s per launch, so shapes stay small). With a GPU the variable is
left alone (it would also turn the GPU tests of the same pytest run into interpreted ones) and
the kernels run natively. bf16 arithmetic is broken in the
interpreter, so these test fp32 and fp16 storage; the kernels upcast to fp32 after loading.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch  # does not import triton

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0)")

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from cadence.backend import ModelInput, SamplingMetadata
from cadence.backends.cuda import triton_kernels as tk
from cadence.layers import paged_attention as ref

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _decode_input(seq_lens: list[int], block_size: int, num_blocks: int,
                  rng: random.Random) -> ModelInput:
    """Decode-only step: each sequence gets distinct random blocks (a shuffled pool)."""
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append([pool.pop() for _ in range(need)])
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size
             for t, n in zip(tables, seq_lens)]
    b = len(seq_lens)
    sampling = SamplingMetadata([0.0] * b, [0] * b, [1.0] * b, [0.0] * b, [None] * b,
                                [0] * b, True)
    return ModelInput([0] * b, [n - 1 for n in seq_lens], slots, [1] * b, list(seq_lens),
                      tables, b, list(range(b)), sampling)


CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype)
    (4, 4, 16, 16, [1, 17, 40], torch.float32),  # MHA, partly filled last blocks
    (8, 2, 32, 8, [8, 3, 25, 9], torch.float32),  # GQA group 4, exactly full block
    (6, 2, 24, 4, [13, 2], torch.float16),  # group 3 and head_dim 24: padded lanes
    (4, 1, 16, 32, [33, 70], torch.float16),  # MQA, big blocks
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_paged_decode_matches_reference(case) -> None:
    num_heads, num_kv_heads, head_dim, block_size, seq_lens, dtype = case
    rng = random.Random(hash(case[:4]) & 0xFFFF)
    torch.manual_seed(rng.randrange(1 << 30))
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    mi = _decode_input(seq_lens, block_size, num_blocks, rng)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    q = torch.randn(len(seq_lens), num_heads, head_dim, dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    width = max(len(t) for t in mi.block_tables) + 2  # wider than needed: never read past
    tables = torch.full((len(seq_lens), width), 10_000, dtype=torch.int32)
    for i, t in enumerate(mi.block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = tk.paged_decode(q, k_cache, v_cache, tables.to(DEVICE), lens.to(DEVICE), block_size,
                          scale)
    md = ref.build_metadata(mi, block_size, DEVICE)
    expected = ref.decode_attention(q.float(), k_cache.float(), v_cache.float(),
                                    md.decode_tables, md.decode_mask, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype) -> None:
    torch.manual_seed(1)
    num_slots, num_kv_heads, head_dim, num_tokens = 40, 3, 20, 9
    # k/v as strided views of one fused projection, as the model produces them.
    fused = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 7, dtype=dtype)
    k = fused[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = fused[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[[2, 5]] = -1  # padding rows of a graph bucket
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    ref.write_kv(k_exp, v_exp, k[keep], v[keep], slots[keep])
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    tk.write_kv(k_dev, v_dev, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), k_exp) and torch.equal(v_dev.cpu(), v_exp)


@pytest.mark.parametrize("seed", [0, 1])
def test_paged_decode_random_shapes(seed: int) -> None:
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 3])
    num_heads = num_kv_heads * rng.choice([1, 2, 4])
    head_dim = rng.choice([8, 16, 24])
    block_size = rng.choice([2, 4, 8, 16])
    seq_lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
    case = (num_heads, num_kv_heads, head_dim, block_size, seq_lens, torch.float32)
    test_paged_decode_matches_reference(case)


# Compiles the kernels for sm_90 (H100/H200) ahead of time: triton's compiler and ptxas need
# no GPU. The interpreter runs code that the compiler rejects (shapes that are not constexpr,
# mixed dtypes, ...), so the interpreted tests above cannot catch that.
_SM90_SCRIPT = """
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from cadence.backends.cuda import triton_kernels as tk

def compile_sm90(kernel, types, constexprs):
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: types.get(n, "i32") for n in names} | {n: "constexpr" for n in constexprs}
    try:
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(names.index(n),): v for n, v in constexprs.items()})
    except TypeError as e:
        print("ASTSource API differs:", e)
        sys.exit(3)
    triton.compile(src, target=GPUTarget("cuda", 90, 32))

p2 = triton.next_power_of_2
for dt in ("bf16", "fp16", "fp32"):
    cache = {n: f"*{dt}" for n in ("k_ptr", "v_ptr", "q_ptr", "out_ptr", "k_cache_ptr",
                                   "v_cache_ptr")}
    for kvh, hd in ((8, 128), (3, 24)):
        compile_sm90(tk._write_kv_kernel, cache | {"slot_ptr": "*i64"},
                     dict(NUM_KV_HEADS=kvh, HEAD_DIM=hd, BLOCK_H=p2(kvh), BLOCK_D=p2(hd)))
    # MHA (group 1), GQA, and a group / head_dim that need padded lanes.
    for group, hd, bs in ((1, 64, 16), (8, 128, 16), (3, 24, 4)):
        compile_sm90(tk._paged_decode_kernel,
                     cache | {"block_tables_ptr": "*i64", "seq_lens_ptr": "*i64",
                              "scale": "fp32"},
                     dict(GROUP=group, BLOCK_G=p2(group), HEAD_DIM=hd, BLOCK_D=p2(hd),
                          BLOCK_SIZE=bs))
compile_sm90(tk._scatter_sampled_kernel, {"input_ids_ptr": "*i64", "idx_ptr": "*i64",
                                          "src_ptr": "*i64", "sampled_ptr": "*i64"},
             dict(BLOCK=128))
# Integers that change from step to step must not be specialized on (1, multiple of 16):
# each new variant would be compiled while requests are being served.
from cadence.backends.cuda import moe_kernels as mk
for kernel, per_step in ((tk._paged_decode_kernel, {"stride_bt"}),
                         (tk._scatter_sampled_kernel, {"n"}),
                         (mk._gate_up_kernel, {"num_pairs"}), (mk._down_kernel, {"num_pairs"})):
    flagged = {p.name for p in kernel.params if p.do_not_specialize}
    assert per_step <= flagged, (kernel.fn.__name__, flagged)
print("compiled")
"""


def test_kernels_compile_for_sm90(tmp_path) -> None:
    pytest.importorskip("triton.backends.nvidia", reason="triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], capture_output=True,
                          text=True, timeout=600, env=env, check=False)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def _mixed_step(block_size: int) -> ModelInput:
    """Two decodes, a prefill chunk with cached context, and a fresh prefill."""
    tables = [[3, 7], [1], [0, 5], [2]]
    seq_lens, query_lens = [11, 5, 13, 6], [1, 1, 4, 6]
    ids, pos, slots = [], [], []
    for t, s, q in zip(tables, seq_lens, query_lens):
        for p in range(s - q, s):
            ids.append(p % 7)
            pos.append(p)
            slots.append(t[p // block_size] * block_size + p % block_size)
    sampling = SamplingMetadata([0.0] * 4, [0] * 4, [1.0] * 4, [0.0] * 4, [None] * 4, [0] * 4,
                                True)
    return ModelInput(ids, pos, slots, query_lens, seq_lens, tables, 2, [0, 1, 2, 3], sampling)


def test_triton_attention_matches_torch_attention_on_a_mixed_step() -> None:
    """attention.py + the staged buffers against TorchPagedAttention, cache included."""
    from cadence.backends.cuda.attention import (
        TritonPagedAttention,
        build_metadata,
        sample_token_indices,
    )
    from cadence.backends.cuda.buffers import InputLayout, InputStager, pack_inputs

    torch.manual_seed(3)
    block_size, kvh, heads, dim, layers = 8, 2, 4, 16, 2
    mi = _mixed_step(block_size)
    caches = [torch.randn(8 * block_size, kvh, dim) for _ in range(2 * layers)]
    ref_attn = ref.TorchPagedAttention([c.clone() for c in caches[:layers]],
                                       [c.clone() for c in caches[layers:]], dim ** -0.5)
    dev = [c.clone().to(DEVICE) for c in caches]
    attn = TritonPagedAttention(dev[:layers], dev[layers:], dim ** -0.5, block_size)
    sample_idx = sample_token_indices(mi.query_lens, mi.sample_seq_indices)
    assert sample_idx == [0, 1, 5, 11]
    layout = InputLayout(mi.num_tokens, 4, 4, 2)
    stager = InputStager(8, DEVICE)  # too small on purpose: it must grow
    flat = stager.stage(layout.size, lambda a: pack_inputs(
        a, layout, mi.input_ids, mi.positions, mi.slot_mapping, sample_idx, mi.seq_lens,
        mi.block_tables))
    views = layout.split(flat)
    assert views.input_ids.tolist() == mi.input_ids and views.seq_lens.tolist() == mi.seq_lens
    md = build_metadata(mi, views, block_size)
    ref_md = ref.build_metadata(mi, block_size)
    for layer in range(layers):
        q = torch.randn(mi.num_tokens, heads, dim)
        k, v = torch.randn(mi.num_tokens, kvh, dim), torch.randn(mi.num_tokens, kvh, dim)
        expected = ref_attn.forward(layer, q, k, v, ref_md)
        out = attn.forward(layer, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), md)
        torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dev[layer].cpu(), ref_attn.k_caches[layer])
        torch.testing.assert_close(dev[layers + layer].cpu(), ref_attn.v_caches[layer])


@pytest.mark.skipif(DEVICE != "cpu", reason="the GPU tests cover this on a GPU")
def test_cuda_backend_code_on_cpu_matches_cpu_backend(tiny_model_dir, monkeypatch) -> None:
    """The whole CudaBackend (pinned staging, metadata, interpreted Triton kernels, graph
    padding through the static buffers, side-stream copier) run on the CPU through the
    engine; greedy tokens must equal the CPU backend's, with graphs simulated and eager."""
    from cadence import LLM, SamplingParams
    from cadence.backend import ProbeResult
    from cadence.backends.cuda.backend import CudaBackend

    monkeypatch.setattr(CudaBackend, "probe", classmethod(lambda cls: ProbeResult(True, "")))
    batched = []  # fresh prompts of similar length share one prefill call per layer
    one_call = ref.run_fresh_batch
    monkeypatch.setattr(ref, "run_fresh_batch",
                        lambda batch, *a: batched.append(batch.count) or one_call(batch, *a))
    model = tiny_model_dir("llama")
    prompts = ["Hello", "The quick brown fox", "1 2 3"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 5, 4)]

    def run(backend: str, **opts: object) -> list[list[int]]:
        # async_scheduling=False: the overlap order below is the one-step-at-a-time path's
        # (CUDA's default, async scheduling, is tests/test_cuda_async_scheduling.py's).
        llm = LLM(model=model, backend=backend, dtype="float32", max_model_len=64,
                  num_kv_blocks=32, backend_options=opts, async_scheduling=False)
        replays: list[int] = []
        graphs = getattr(llm.engine.backend, "graphs", None)
        if graphs is not None:
            original = graphs.replay
            graphs.replay = lambda bucket: (replays.append(bucket), original(bucket))[1]
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            if graphs is not None:
                assert replays[0] == 4 and 1 in replays  # 3 decodes padded to bucket 4
            if backend == "cuda":
                be = llm.engine.backend
                assert be.event_log and be.event_log[:5] == ["launch", "post_sample",
                                                             "sample", "copy", "sync"]
                assert (be.graphs is None) == bool(opts.get("enforce_eager"))
                assert batched and max(batched) >= 2
                batched.clear()
            return [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()

    expected = run("cpu")
    # cuda_graph_max_bs=4: 3 decodes replay bucket 4 with one padding row (dummy block).
    assert run("cuda", device="cpu", record_events=True, cuda_graph_max_bs=4) == expected
    assert run("cuda", device="cpu", record_events=True, enforce_eager=True) == expected


@pytest.mark.parametrize("n", [0, 1, 3, 130])
def test_scatter_sampled_matches_index_copy(n: int) -> None:
    """Async scheduling's placeholder fill: input_ids[idx[i]] = sampled[src[i]], against
    torch's index_copy_; more placeholders than one program's block included."""
    g = torch.Generator().manual_seed(n)
    input_ids = torch.randint(0, 1000, (max(2 * n, 4),), generator=g).to(DEVICE)
    idx = torch.randperm(input_ids.numel(), generator=g)[:n].to(DEVICE)
    sampled = torch.randint(0, 1000, (n + 5,), generator=g).to(DEVICE)
    src = torch.randint(0, n + 5, (n,), generator=g).to(DEVICE)
    want = input_ids.clone().index_copy_(0, idx, sampled.index_select(0, src))
    tk.scatter_sampled(input_ids, idx, src, sampled)
    assert torch.equal(input_ids, want)
