"""The HPU emulation's attention gives a token the same bits on every path (decode at any
batch size, prefill with context, a fresh prefill), which async scheduling's exactness
needs when it changes when a request is preempted and recomputed
(backends/hpu/exact_attention.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cadence.backends.hpu.attention import HpuAttentionMetadata, HpuPagedAttention
from cadence.backends.hpu.exact_attention import exact_attention

BS, KVH, H, D = 4, 2, 6, 16
NUM_BLOCKS = 12  # the last one is the dummy block padding writes to
DUMMY = NUM_BLOCKS - 1
SCALE = D ** -0.5


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, D] over keys k/v [L, KVH, D], in float64."""
    kk = k.double().repeat_interleave(H // KVH, dim=1)  # [L, H, D]
    vv = v.double().repeat_interleave(H // KVH, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), kk) * SCALE, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, vv)


def test_a_row_does_not_depend_on_batch_rows_key_padding_or_chunks(monkeypatch) -> None:
    import cadence.backends.hpu.exact_attention as ea

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 5, H, D, generator=g)
    k = torch.randn(3, 40, KVH, D, generator=g)
    v = torch.randn(3, 40, KVH, D, generator=g)
    mask = torch.zeros(3, 5, 40, dtype=torch.bool)
    mask[:, :, :13] = True
    full = exact_attention(q, k[:, :24], v[:, :24], mask[:, :, :24], SCALE, key_len=32)
    one = exact_attention(q[1:2, 3:4], k[1:2, :16], v[1:2, :16], mask[1:2, 3:4, :16], SCALE,
                          key_len=32)
    assert torch.equal(one[0, 0], full[1, 3])
    # More keys than the fixed length (a bucket past max_model_len): cut, same bits.
    longer = exact_attention(q, k, v, mask, SCALE, key_len=32)
    assert torch.equal(longer, full)
    # Sequences and rows in chunks of one: same bits.
    monkeypatch.setattr(ea, "_CHUNK_ELEMENTS", 1)
    assert torch.equal(exact_attention(q, k[:, :24], v[:, :24], mask[:, :, :24], SCALE,
                                       key_len=32), full)
    want = _reference(q[1, 3], k[1, :13], v[1, :13])
    torch.testing.assert_close(full[1, 3].double(), want, rtol=1e-5, atol=1e-5)


class _Seq:
    """One sequence of ``n`` tokens in blocks ``blocks`` of a shared cache."""

    def __init__(self, n: int, blocks: list[int], g: torch.Generator) -> None:
        self.n, self.blocks = n, blocks
        self.q = torch.randn(n, H, D, generator=g)
        self.k = torch.randn(n, KVH, D, generator=g)
        self.v = torch.randn(n, KVH, D, generator=g)

    def slot(self, pos: int) -> int:
        return self.blocks[pos // BS] * BS + pos % BS


def _attn() -> HpuPagedAttention:
    caches = [torch.zeros(NUM_BLOCKS * BS, KVH, D) for _ in range(2)]
    return HpuPagedAttention([caches[0]], [caches[1]], BS, SCALE, exact_len=8 * BS)


def _step(attn: HpuPagedAttention, rows: list[tuple[_Seq, int, int]], kind: str,
          query_len: int, num_blocks: int) -> torch.Tensor:
    """Run positions [start, end) of each row's sequence as one bucket-shaped step of
    ``kind`` (padded to ``query_len`` tokens and ``num_blocks`` blocks); -> [B, Q, H, D]."""
    b = len(rows)
    q, k, v, slots, pos, tables, seq_lens = [], [], [], [], [], [], []
    for seq, start, end in rows:
        for i in range(query_len):
            p = start + i
            real = p < end
            q.append(seq.q[p] if real else torch.zeros(H, D))
            k.append(seq.k[p] if real else torch.zeros(KVH, D))
            v.append(seq.v[p] if real else torch.zeros(KVH, D))
            slots.append(seq.slot(p) if real else DUMMY * BS)
            pos.append(p if real else 0)
        tables.append((seq.blocks + [DUMMY] * num_blocks)[:num_blocks])
        seq_lens.append(end)
    positions = torch.tensor(pos).view(b, query_len)
    block_tables = torch.tensor(tables, dtype=torch.int64).view(b, num_blocks)
    lens = torch.tensor(seq_lens)
    mask = None
    if kind != "prefill":
        keys = torch.arange(num_blocks * BS)
        within = keys.view(1, 1, -1) < lens.view(b, 1, 1)
        if kind == "decode":
            mask = within.view(b, 1, 1, -1)
        else:
            mask = ((keys.view(1, 1, -1) <= positions.view(b, query_len, 1)) & within
                    ).view(b, 1, query_len, -1)
    md = HpuAttentionMetadata(kind == "decode", b, query_len, torch.tensor(slots),
                              block_tables, mask, positions, lens)
    out = attn.forward(0, torch.stack(q), torch.stack(k), torch.stack(v), md)
    return out.view(b, query_len, H, D)


def test_a_token_gets_the_same_bits_on_every_path() -> None:
    g = torch.Generator().manual_seed(1)
    seq = _Seq(10, [2, 5, 1], g)
    other = _Seq(7, [3, 7], g)
    last = seq.n - 1

    fresh = _attn()  # the whole sequence as one fresh chunk (padded to 12 tokens)
    by_prefill = _step(fresh, [(seq, 0, 10)], "prefill", 12, 0)[0, last]

    ctx = _attn()  # 8 tokens, then the last 2 as a prefill after cached context
    _step(ctx, [(seq, 0, 8)], "prefill", 8, 0)
    by_ctx = _step(ctx, [(seq, 8, 10)], "prefill_ctx", 4, 4)[0, 1]

    alone = _attn()  # 9 tokens, then the last as a decode of one row
    _step(alone, [(seq, 0, 9)], "prefill", 12, 0)
    by_decode = _step(alone, [(seq, 9, 10)], "decode", 1, 3)[0, 0]

    batched = _attn()  # the same decode beside another sequence, more blocks gathered
    _step(batched, [(seq, 0, 9), (other, 0, 6)], "prefill", 12, 0)
    by_batch = _step(batched, [(other, 6, 7), (seq, 9, 10)], "decode", 1, 5)[1, 0]

    assert torch.equal(by_ctx, by_prefill)
    assert torch.equal(by_decode, by_prefill)
    assert torch.equal(by_batch, by_prefill)
    want = _reference(seq.q[last], seq.k, seq.v)
    torch.testing.assert_close(by_prefill.double(), want, rtol=1e-5, atol=1e-5)
