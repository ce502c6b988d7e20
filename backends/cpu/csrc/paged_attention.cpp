// Paged decode attention for the CPU backend: one query token per sequence, reading K/V
// blocks in place from the paged cache (no gather copy).
//
// Work is split into items (sequence, KV head, KV partition). An item serves all the query
// heads that share its KV head from one read of its K and V rows (GQA grouping), keeps the
// scores of its partition in a scratch buffer, and accumulates in fp32. Threads take items
// from an atomic counter, so a long sequence next to short ones, or batch 1 with a long
// context, still keeps every core busy.
//
// NOTE batch invariance: the partition size is a constant, and partials are merged in
// partition order after the parallel loop, so a sequence's output bits depend only on its
// own query and cache, never on the batch it runs in or on which thread ran it. The engine's
// async == sync exactness relies on this.
//
// Vectors are vec.h's 16-float type, so the same source runs on AVX-512 and AVX2.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace cadence_cpu;


constexpr int64_t kPartition = 256;  // tokens per work item; fixed (see NOTE above)
// Software prefetch of the rows of KV heads [kh0, kh1) in one block. The hardware
// prefetcher follows a stream within a page but not a jump to the next block of the table,
// which on a long-running server sits anywhere in the cache.
template <typename cache_t>
inline void prefetch_block(const cache_t* block, int64_t block_size, int64_t token_stride,
                           int64_t head_stride, int64_t kh0, int64_t kh1, int64_t d) {
  const char* first = reinterpret_cast<const char*>(block + kh0 * head_stride);
  const int64_t span = ((kh1 - kh0 - 1) * head_stride + d) * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t t = 0; t < block_size; ++t) {
    const char* row = first + t * token_stride * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t off = 0; off < span; off += 64) __builtin_prefetch(row + off, 0, 3);
  }
}

struct Geometry {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t max_partitions;
};

// One work item: the query heads of KV heads [kh0, kh1) over tokens [t0, t1) of one
// sequence. For each query head: scores (q in registers, one K row at a time), softmax
// with a running max, and the weighted V sum (accumulator in registers). The first head of
// a group reads the partition's K/V rows from memory (prefetching the next block); the
// group's other heads find them in L2. NC = head_dim / 16 vectors per row.
// Writes the unnormalized accumulators, maxima and sums of heads kh0 * group ...
template <typename cache_t, int NC>
void attend_partition(const Geometry& g, const float* q, const cache_t* k_cache,
                      const cache_t* v_cache, const int32_t* table, int64_t kh0, int64_t kh1,
                      int64_t t0, int64_t t1, float* scores, float* acc_out, float* max_out,
                      float* sum_out) {
  constexpr int64_t d = NC * kVec;
  const int64_t n = t1 - t0;
  const int64_t bs = g.block_size;
  for (int64_t kvh = kh0; kvh < kh1; ++kvh) {
    for (int64_t j = 0; j < g.group; ++j) {
      const int64_t h = (kvh - kh0) * g.group + j;
      const bool lead = j == 0;
      vfloat qv[NC];
      for (int c = 0; c < NC; ++c) qv[c] = load(q + h * d + c * kVec);
      float* sh = scores;  // one head at a time: n scores
      float m = -std::numeric_limits<float>::infinity();
      // Block by block: one table lookup and no division per token.
      for (int64_t bt0 = t0; bt0 < t1; bt0 += bs) {
        const int64_t bi = bt0 / bs;
        const int64_t bt1 = std::min(t1, bt0 + bs);
        if (lead && bt1 < t1)
          prefetch_block(k_cache + table[bi + 1] * g.k_block_stride, bs, g.k_token_stride,
                         g.k_head_stride, kvh, kvh + 1, d);
        const cache_t* k = k_cache + table[bi] * g.k_block_stride + kvh * g.k_head_stride;
        for (int64_t t = bt0; t < bt1; ++t, k += g.k_token_stride) {
          vfloat s = qv[0] * load(k);
          for (int c = 1; c < NC; ++c) s += qv[c] * load(k + c * kVec);
          const float x = hsum(s);
          sh[t - t0] = x;
          m = std::max(m, x);
        }
      }
      int64_t i = 0;
      vfloat lv = vfloat{};
      for (; i + kVec <= n; i += kVec) {
        const vfloat e = exp(load(sh + i) - m);
        store(sh + i, e);
        lv += e;
      }
      float l = hsum(lv);
      for (; i < n; ++i) {  // the tail, through the same vector code
        vfloat x = splat(-std::numeric_limits<float>::infinity());
        x[0] = sh[i] - m;
        const float e = exp(x)[0];
        sh[i] = e;
        l += e;
      }
      max_out[h] = m;
      sum_out[h] = l;
      vfloat acc[NC];
      for (int c = 0; c < NC; ++c) acc[c] = vfloat{};
      if (lead && t0 < t1)
        prefetch_block(v_cache + table[t0 / bs] * g.v_block_stride, bs, g.v_token_stride,
                       g.v_head_stride, kvh, kvh + 1, d);
      for (int64_t bt0 = t0; bt0 < t1; bt0 += bs) {
        const int64_t bi = bt0 / bs;
        const int64_t bt1 = std::min(t1, bt0 + bs);
        if (lead && bt1 < t1)
          prefetch_block(v_cache + table[bi + 1] * g.v_block_stride, bs, g.v_token_stride,
                         g.v_head_stride, kvh, kvh + 1, d);
        const cache_t* v = v_cache + table[bi] * g.v_block_stride + kvh * g.v_head_stride;
        for (int64_t t = bt0; t < bt1; ++t, v += g.v_token_stride) {
          const vfloat p = splat(sh[t - t0]);
          for (int c = 0; c < NC; ++c) acc[c] += p * load(v + c * kVec);
        }
      }
      for (int c = 0; c < NC; ++c) store(acc_out + h * d + c * kVec, acc[c]);
    }
  }
}

template <typename cache_t, typename out_t, int NC>
void run(const Geometry& g, const float* q, const cache_t* k_cache, const cache_t* v_cache,
         const int32_t* tables, const int32_t* seq_lens, out_t* out) {
  const int64_t d = g.head_dim;
  const int64_t H = g.num_heads;
  const int64_t P = g.max_partitions;
  const int64_t nthreads = at::get_num_threads();
  // Items: (sequence, partition, KV-head range). All KV heads of a token are read together
  // when there are enough items to keep the threads busy; otherwise (small batches) each KV
  // head is its own item. The split changes which thread computes a head, never its
  // arithmetic, so outputs stay batch-invariant.
  std::vector<int64_t> seq_parts(g.num_seqs);
  int64_t num_chunks = 0;
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    seq_parts[b] = std::max<int64_t>(1, (seq_lens[b] + kPartition - 1) / kPartition);
    num_chunks += seq_parts[b];
  }
  const int64_t heads_per_item = num_chunks >= 4 * nthreads ? g.num_kv_heads : 1;
  const int64_t splits = g.num_kv_heads / heads_per_item;
  std::vector<int64_t> item_start(g.num_seqs + 1, 0);
  for (int64_t b = 0; b < g.num_seqs; ++b) item_start[b + 1] = item_start[b] + seq_parts[b] * splits;
  const int64_t num_items = item_start[g.num_seqs];
  // Partials per (seq, head, partition): accumulator [D], max, sum.
  std::vector<float> part_acc(static_cast<size_t>(g.num_seqs * H * P * d));
  std::vector<float> part_max(static_cast<size_t>(g.num_seqs * H * P));
  std::vector<float> part_sum(static_cast<size_t>(g.num_seqs * H * P));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    const int64_t max_nh = heads_per_item * g.group;
    std::vector<float> scores(static_cast<size_t>(kPartition));
    std::vector<float> acc(static_cast<size_t>(max_nh * d));
    std::vector<float> m(static_cast<size_t>(max_nh)), l(static_cast<size_t>(max_nh));
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t b =
          std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t local = item - item_start[b];
      const int64_t kh0 = (local % splits) * heads_per_item;
      const int64_t kh1 = kh0 + heads_per_item;
      const int64_t part = local / splits;
      const int64_t t0 = part * kPartition;
      const int64_t t1 = std::min<int64_t>(seq_lens[b], t0 + kPartition);
      const int64_t h0 = kh0 * g.group;
      const int64_t nh = heads_per_item * g.group;
      if (t1 > t0) {
        attend_partition<cache_t, NC>(g, q + (b * H + h0) * d, k_cache, v_cache,
                                     tables + b * g.max_blocks, kh0, kh1, t0, t1,
                                     scores.data(), acc.data(), m.data(), l.data());
      } else {  // an empty sequence: its output is zero
        std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
        std::fill(l.begin(), l.end(), 0.f);
        std::fill(acc.begin(), acc.end(), 0.f);
      }
      for (int64_t j = 0; j < nh; ++j) {
        const int64_t slot = (b * H + h0 + j) * P + part;
        part_max[slot] = m[j];
        part_sum[slot] = l[j];
        std::memcpy(part_acc.data() + slot * d, acc.data() + j * d, sizeof(float) * d);
      }
    }
  });
  // Merge partitions in order (deterministic), normalise, write out.
  at::parallel_for(0, g.num_seqs * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(static_cast<size_t>(d));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t parts = seq_parts[bh / H];
      const float* pm = part_max.data() + bh * P;
      const float* ps = part_sum.data() + bh * P;
      const float* pa = part_acc.data() + bh * P * d;
      out_t* ob = out + bh * d;
      if (parts == 1) {
        const float inv = ps[0] > 0.f ? 1.f / ps[0] : 0.f;
        for (int64_t i = 0; i < d; ++i) ob[i] = static_cast<out_t>(pa[i] * inv);
        continue;
      }
      float gm = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < parts; ++p) gm = std::max(gm, pm[p]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < parts; ++p) {
        if (ps[p] == 0.f) continue;
        const float w = std::exp(pm[p] - gm);
        total += ps[p] * w;
        for (int64_t i = 0; i < d; ++i) o[i] += pa[p * d + i] * w;
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t i = 0; i < d; ++i) ob[i] = static_cast<out_t>(o[i] * inv);
    }
  });
}

template <typename cache_t, typename out_t>
void dispatch_dim(const Geometry& g, const float* q, const cache_t* k, const cache_t* v,
                  const int32_t* tables, const int32_t* lens, out_t* out) {
  switch (g.head_dim) {
    case 16: return run<cache_t, out_t, 1>(g, q, k, v, tables, lens, out);
    case 32: return run<cache_t, out_t, 2>(g, q, k, v, tables, lens, out);
    case 64: return run<cache_t, out_t, 4>(g, q, k, v, tables, lens, out);
    case 128: return run<cache_t, out_t, 8>(g, q, k, v, tables, lens, out);
    case 256: return run<cache_t, out_t, 16>(g, q, k, v, tables, lens, out);
    default: TORCH_CHECK(false, "head_dim must be one of 16, 32, 64, 128, 256");
  }
}

}  // namespace

// q [B, H, D] (any float dtype); k_cache, v_cache [num_blocks, block_size, KVH, D] or any
// strided view with that index order and contiguous D; block_tables [B, max_blocks] int32;
// seq_lens [B] int32 (tokens in the cache, this step's included). Returns [B, H, D] in q's
// dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim] views");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  Geometry g{};
  g.num_seqs = q.size(0);
  g.num_heads = q.size(1);
  g.head_dim = q.size(2);
  g.num_kv_heads = k_cache.size(2);
  TORCH_CHECK(g.num_heads % g.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  g.group = g.num_heads / g.num_kv_heads;
  TORCH_CHECK(k_cache.size(3) == g.head_dim, "head_dim of q and the cache differ");
  g.block_size = k_cache.size(1);
  g.max_blocks = tables.size(1);
  g.k_block_stride = k_cache.stride(0);
  g.k_token_stride = k_cache.stride(1);
  g.k_head_stride = k_cache.stride(2);
  g.v_block_stride = v_cache.stride(0);
  g.v_token_stride = v_cache.stride(1);
  g.v_head_stride = v_cache.stride(2);
  int64_t max_len = 0;
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= g.max_blocks * g.block_size,
                "a sequence is longer than its block table");
    max_len = std::max<int64_t>(max_len, lp[b]);
  }
  g.max_partitions = std::max<int64_t>(1, (max_len + kPartition - 1) / kPartition);
  // Scaled fp32 queries: the scale is folded in once instead of per score.
  const auto qf = (q.to(torch::kFloat32) * scale).contiguous();
  auto out = torch::empty_like(q, q.options().memory_format(at::MemoryFormat::Contiguous));
  const float* qp = qf.data_ptr<float>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  auto run_out = [&](auto* kp, auto* vp) {
    if (out.scalar_type() == at::kFloat)
      dispatch_dim(g, qp, kp, vp, tp, lp, out.data_ptr<float>());
    else if (out.scalar_type() == at::kBFloat16)
      dispatch_dim(g, qp, kp, vp, tp, lp, out.data_ptr<c10::BFloat16>());
    else
      TORCH_CHECK(false, "q must be float32 or bfloat16");
  };
  if (k_cache.scalar_type() == at::kFloat)
    run_out(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (k_cache.scalar_type() == at::kBFloat16)
    run_out(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  else
    TORCH_CHECK(false, "the KV cache must be float32 or bfloat16");
  return out;
}

