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
// NOTE sliding windows: a window keeps keys [seq_len - W, seq_len). Partitions stay at
// absolute multiples of 256 tokens and tiles at absolute multiples of kVec (the first tile
// starts at the kVec-aligned token below the window, its older lanes masked), so a key lands
// in the same partition and lane whichever kernel or chunk computes it, and the prefill
// kernel (which masks the same way) gives the same bits. Partitions wholly before the window
// are not visited; their blocks may already be freed.
//
// Vectors are vec.h's native-width type (kVec floats), so one source runs on AVX-512, AVX2
// and SSE.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_common.h"
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


// Whether the K pass of a bf16 item prefetches its V rows too (fp32 always does): measured
// per CPU family, and AMX is what tells the Xeons that gain from it from the EPYCs that lose.
#if defined(__AMX_TILE__)
constexpr bool kPrefetchVBf16 = true;
#else
constexpr bool kPrefetchVBf16 = false;
#endif

// Software prefetch of one token row (KV heads [kh0, kh1)) into L2 (prefetcht1). Into L1
// (prefetcht0) measured ~20 % slower on a cold cache: the lookahead below keeps more lines in
// flight than L1's miss buffers hold.
template <typename cache_t>
inline void prefetch_row(const cache_t* row, int64_t head_stride, int64_t kh0, int64_t kh1,
                         int64_t d) {
  const char* first = reinterpret_cast<const char*>(row + kh0 * head_stride);
  const int64_t span = ((kh1 - kh0 - 1) * head_stride + d) * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t off = 0; off < span; off += 64) __builtin_prefetch(first + off, 0, 2);
}

struct Geometry {
  int64_t num_seqs, num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t v_block_stride, v_token_stride, v_head_stride;
  int64_t max_partitions;
  int64_t window;  // sliding window in tokens; 0: the whole sequence
  // bf16 q and cache on a CPU with vdpbf16ps: the scores come from the unscaled bf16 q
  // (q_bf16, [num_seqs, H, D]) and are scaled after; else null, and q is fp32, prescaled.
  const c10::BFloat16* q_bf16;
  float scale;
  float soft_cap;  // cap * tanh(score / cap) when > 0 (attention_common.h)
};

// The rows of tokens [tt, end) of one sequence, in order: all KV heads of a token are one
// contiguous run in the core's token-major layout. The cursor steps through the block table
// one block at a time: a division and a modulo per row (and per prefetched row) had cost
// 3-8 % of the fp32 kernel (docs/backends/cpu.md).
template <typename cache_t>
struct RowCursor {
  const cache_t* cache;
  const int32_t* table;
  int64_t block_stride, token_stride, block_size, end_block;
  int64_t block, offset;
  const cache_t* base = nullptr;

  RowCursor(const Geometry& g, const cache_t* cache_, int64_t block_stride_,
            int64_t token_stride_, const int32_t* table_, int64_t tt, int64_t end)
      : cache(cache_), table(table_), block_stride(block_stride_),
        token_stride(token_stride_), block_size(g.block_size),
        end_block((end + g.block_size - 1) / g.block_size), block(tt / g.block_size),
        offset(tt % g.block_size) {
    locate();
  }
  // Table entries past the sequence's last block may hold anything: never read.
  void locate() {
    if (block < end_block) base = cache + table[block] * block_stride;
  }
  const cache_t* row() const { return base + offset * token_stride; }
  void next() {
    if (++offset == block_size) {
      offset = 0;
      ++block;
      locate();
    }
  }
};

// The next `count` rows of `cur` (tokens t .. t + count), prefetching through `ahead` (kVec
// tokens further on) the rows below t_end (t_end = t, ahead null: none): the lookahead is
// one tile, spread evenly, so the next tile's loads are in flight while this one is
// computed. The hardware prefetcher alone does not follow a jump to the next block of the
// table, which can sit anywhere in the cache (measured: a burst of a whole block's
// prefetches at once mostly went unused).
template <typename cache_t>
inline void tile_rows(RowCursor<cache_t>& cur, RowCursor<cache_t>* ahead, int64_t head_stride,
                      int64_t kh0, int64_t kh1, int64_t d, int64_t t, int64_t count,
                      int64_t t_end, const cache_t** rows) {
  for (int64_t i = 0; i < count; ++i) {
    if (t + i + kVec < t_end) {
      prefetch_row(ahead->row(), head_stride, kh0, kh1, d);
      ahead->next();
    }
    rows[i] = cur.row();
    cur.next();
  }
  // A short last tile repeats its last row: the scores of the copies are masked out, and a
  // full tile keeps the score loop at a fixed trip count (its kVec partials stay in registers).
  for (int64_t i = count; i < kVec; ++i) rows[i] = rows[count - 1];
}

// acc[h] += sum_i p[h][i] * v_i over the `count` rows of one tile, for HB query heads that
// share a KV head: each V row is loaded (and widened to fp32) once for all HB heads. The HB
// accumulators of CC vectors of columns stay in registers: where HB * NC would not fit
// (AVX2's 16 registers) the columns go in chunks of CC, each sum still in row order.
template <typename cache_t, int NC, int HB>
inline void accumulate_v(const cache_t* const* rows, int64_t count, int64_t head_off,
                         const float* p, int64_t p_stride, float* acc) {
  constexpr int64_t d = NC * kVec;
  constexpr int CC = chunk_cols(NC, HB);
  for (int c0 = 0; c0 < NC; c0 += CC) {
    vfloat a[HB][CC];
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < CC; ++c) a[h][c] = load(acc + h * d + (c0 + c) * kVec);
    for (int64_t i = 0; i < count; ++i) {
      const cache_t* row = rows[i] + head_off + c0 * kVec;
      vfloat v[CC];
      for (int c = 0; c < CC; ++c) v[c] = load(row + c * kVec);
      for (int h = 0; h < HB; ++h) {
        const vfloat pi = splat(p[h * p_stride + i]);
        for (int c = 0; c < CC; ++c) a[h][c] += pi * v[c];
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < CC; ++c) store(acc + h * d + (c0 + c) * kVec, a[h][c]);
  }
}

// One work item: the query heads of KV heads [kh0, kh1) over tokens [t0, t1) of one
// sequence, K rows then V rows read straight from the cache in tiles of kVec tokens. The
// scores of a head over a tile come out of one transpose-and-add reduction; softmax per
// head over the partition; then the weighted V sum, HB heads of a group per row load.
// NC = head_dim / kVec vectors per row. Keys before `lo` (a sliding window's first token) are
// masked. Writes the unnormalized accumulators, maxima and sums of heads kh0 * group ...
template <typename cache_t, int NC, int HB>
void attend_partition(const Geometry& g, const float* q, const c10::BFloat16* qb,
                      const cache_t* k_cache, const cache_t* v_cache, const int32_t* table,
                      int64_t kh0, int64_t kh1, int64_t t_part, int64_t t1, int64_t lo,
                      float* scores, vfloat* maxes, float* acc_out, float* max_out,
                      float* sum_out) {
  constexpr int64_t d = NC * kVec;
  // First tile: kVec-aligned in absolute positions (see the window NOTE at the top).
  const int64_t t0 = std::max(t_part, lo / kVec * kVec);
  const int64_t n = t1 - t0;
  const int64_t G = g.group;
  const int64_t nh = (kh1 - kh0) * G;
  const int64_t stride = kPartition + kVec;  // scores of one head; room for a full last tile
  const int64_t padded = ((n + kVec - 1) / kVec) * kVec;
  const cache_t* rows[kVec];
  const vfloat neg_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < nh; ++h) maxes[h] = neg_inf;
  // The K pass's prefetches (the next tile's K rows; in fp32 also this tile's V rows, so the
  // V pass streams from L2 while K's and V's DRAM reads overlap) go out a few between each
  // head's scores instead of in one burst before them: 1.22-1.26x on an AVX2 EPYC in fp32,
  // batch 64 at 192 tokens to batch 1 at 2048, items of 9 query heads (docs/backends/cpu.md).
  // In bf16 the V prefetch depends on the CPU: ~6 % slower on an AVX-512 EPYC (Zen 4), where
  // the item is closer to compute-bound, and ~9 % faster on an AMX Xeon, where it waits on
  // memory more; the build for a CPU with AMX tiles issues it (kPrefetchVBf16).
  const cache_t* k_ahead[kVec];
  const cache_t* v_ahead[kVec];
  RowCursor<cache_t> k_rows(g, k_cache, g.k_block_stride, g.k_token_stride, table, t0, t1);
  RowCursor<cache_t> k_next(g, k_cache, g.k_block_stride, g.k_token_stride, table, t0 + kVec,
                            t1);
  RowCursor<cache_t> v_next(g, v_cache, g.v_block_stride, g.v_token_stride, table, t0, t1);
  for (int64_t t = t0; t < t1; t += kVec) {
    const int64_t count = std::min<int64_t>(kVec, t1 - t);
    tile_rows<cache_t>(k_rows, nullptr, g.k_head_stride, kh0, kh1, d, t, count, t, rows);
    int64_t n_k = 0, n_v = 0;
    for (int64_t tt = t + kVec; tt < std::min<int64_t>(t1, t + 2 * kVec); ++tt) {
      k_ahead[n_k++] = k_next.row();
      k_next.next();
    }
    if constexpr (sizeof(cache_t) == 4 || kPrefetchVBf16)
      for (int64_t tt = t; tt < t + count; ++tt) {
        v_ahead[n_v++] = v_next.row();
        v_next.next();
      }
    for (int64_t h = 0; h < nh; ++h) {
      // Each head issues its share of both lists (measured faster than K's rows first).
      for (int64_t j = h * n_v / nh; j < (h + 1) * n_v / nh; ++j)
        prefetch_row(v_ahead[j], g.v_head_stride, kh0, kh1, d);
      for (int64_t j = h * n_k / nh; j < (h + 1) * n_k / nh; ++j)
        prefetch_row(k_ahead[j], g.k_head_stride, kh0, kh1, d);
      const int64_t off = (kh0 + h / G) * g.k_head_stride;
      vfloat sc = soft_cap_scores(
          tile_scores<cache_t, NC>(q + h * d, qb == nullptr ? nullptr : qb + h * d, rows, off,
                                   g.scale),
          g.soft_cap);
      // Lanes past the sequence's end or before the window weigh nothing: -inf, so exp
      // gives 0 below.
      for (int64_t lane = count; lane < kVec; ++lane) sc[lane] = neg_inf[0];
      for (int64_t lane = 0; lane < lo - t; ++lane) sc[lane] = neg_inf[0];
      store(scores + h * stride + (t - t0), sc);
      maxes[h] = maxes[h] > sc ? maxes[h] : sc;
    }
  }
  // The first V tile is on its way while the softmax runs.
  {
    RowCursor<cache_t> first(g, v_cache, g.v_block_stride, g.v_token_stride, table,
                             std::max(t0, lo), t1);
    for (int64_t tt = std::max(t0, lo); tt < std::min<int64_t>(t1, t0 + kVec); ++tt) {
      prefetch_row(first.row(), g.v_head_stride, kh0, kh1, d);
      first.next();
    }
  }
  for (int64_t h = 0; h < nh; ++h)
    exp_partition(scores + h * stride, maxes[h], padded, max_out + h, sum_out + h);
  std::fill(acc_out, acc_out + nh * d, 0.f);
  RowCursor<cache_t> v_rows(g, v_cache, g.v_block_stride, g.v_token_stride, table, t0, t1);
  RowCursor<cache_t> v_ahead_rows(g, v_cache, g.v_block_stride, g.v_token_stride, table,
                                  t0 + kVec, t1);
  for (int64_t t = t0; t < t1; t += kVec) {
    const int64_t count = std::min<int64_t>(kVec, t1 - t);
    tile_rows(v_rows, &v_ahead_rows, g.v_head_stride, kh0, kh1, d, t, count, t1, rows);
    // Rows before the window weigh exactly 0: skipped, which leaves the sum's bits as they
    // are (the prefill kernel skips them too).
    const int64_t skip = std::max<int64_t>(0, lo - t);
    for (int64_t h = 0; h < nh; h += HB)
      accumulate_v<cache_t, NC, HB>(rows + skip, count - skip, (kh0 + h / G) * g.v_head_stride,
                                    scores + h * stride + (t - t0) + skip, stride,
                                    acc_out + h * d);
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
  // Partitions [first_part[b], first_part[b] + seq_parts[b]) hold the keys a row sees.
  std::vector<int64_t> seq_parts(g.num_seqs), first_part(g.num_seqs), first_key(g.num_seqs);
  int64_t num_chunks = 0;
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    first_key[b] = window_start(seq_lens[b], g.window);
    first_part[b] = first_key[b] / kPartition;
    seq_parts[b] = std::max<int64_t>(1, (seq_lens[b] + kPartition - 1) / kPartition -
                                            first_part[b]);
    num_chunks += seq_parts[b];
  }
  const int64_t heads_per_item = num_chunks >= 4 * nthreads ? g.num_kv_heads : 1;
  const int64_t splits = g.num_kv_heads / heads_per_item;
  std::vector<int64_t> item_start(g.num_seqs + 1, 0);
  for (int64_t b = 0; b < g.num_seqs; ++b)
    item_start[b + 1] = item_start[b] + seq_parts[b] * splits;
  const int64_t num_items = item_start[g.num_seqs];
  // Partials per (seq, head, partition): accumulator [D], max, sum.
  std::vector<float> part_acc(static_cast<size_t>(g.num_seqs * H * P * d));
  std::vector<float> part_max(static_cast<size_t>(g.num_seqs * H * P));
  std::vector<float> part_sum(static_cast<size_t>(g.num_seqs * H * P));
  // Query heads per V row load (attend_partition's HB): the largest of 4, 3, 2 that divides
  // the group and keeps HB accumulators of all NC columns in registers (AVX-512), or of a
  // chunk of at least two (narrower vectors, accumulate_v's chunks).
  const int64_t min_cols = kVec >= 16 ? NC : std::min(NC, 2);
  int64_t hb = 1;
  for (int64_t c : {4, 3, 2})
    if (g.group % c == 0 && c * min_cols <= kAccVecs) { hb = c; break; }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    const int64_t max_nh = heads_per_item * g.group;
    std::vector<float> scores(static_cast<size_t>(max_nh * (kPartition + kVec)));
    std::vector<vfloat> maxes(static_cast<size_t>(max_nh));
    std::vector<float> acc(static_cast<size_t>(max_nh * d));
    std::vector<float> m(static_cast<size_t>(max_nh)), l(static_cast<size_t>(max_nh));
    for (int64_t item = next++; item < num_items; item = next++) {
      const int64_t b =
          std::upper_bound(item_start.begin(), item_start.end(), item) - item_start.begin() - 1;
      const int64_t local = item - item_start[b];
      const int64_t kh0 = (local % splits) * heads_per_item;
      const int64_t kh1 = kh0 + heads_per_item;
      const int64_t part = local / splits;  // counted from the window's first partition
      const int64_t t0 = (first_part[b] + part) * kPartition;
      const int64_t t1 = std::min<int64_t>(seq_lens[b], t0 + kPartition);
      const int64_t h0 = kh0 * g.group;
      const int64_t nh = heads_per_item * g.group;
      if (t1 > t0) {
        auto item_fn = attend_partition<cache_t, NC, 1>;
        if (hb == 4) item_fn = attend_partition<cache_t, NC, 4>;
        else if (hb == 3) item_fn = attend_partition<cache_t, NC, 3>;
        else if (hb == 2) item_fn = attend_partition<cache_t, NC, 2>;
        const c10::BFloat16* qb = g.q_bf16 == nullptr ? nullptr : g.q_bf16 + (b * H + h0) * d;
        item_fn(g, q + (b * H + h0) * d, qb, k_cache, v_cache, tables + b * g.max_blocks, kh0,
                kh1, t0, t1, first_key[b], scores.data(), maxes.data(), acc.data(), m.data(),
                l.data());
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
      merge_partitions(parts, pm, ps, pa, d, out + bh * d, o.data());
    }
  });
}

template <typename cache_t, typename out_t>
void dispatch_dim(const Geometry& g, const float* q, const cache_t* k, const cache_t* v,
                  const int32_t* tables, const int32_t* lens, out_t* out) {
  switch (g.head_dim) {
    case 16: return run<cache_t, out_t, 16 / kVec>(g, q, k, v, tables, lens, out);
    case 32: return run<cache_t, out_t, 32 / kVec>(g, q, k, v, tables, lens, out);
    case 64: return run<cache_t, out_t, 64 / kVec>(g, q, k, v, tables, lens, out);
    case 128: return run<cache_t, out_t, 128 / kVec>(g, q, k, v, tables, lens, out);
    case 256: return run<cache_t, out_t, 256 / kVec>(g, q, k, v, tables, lens, out);
    default: TORCH_CHECK(false, "head_dim must be one of 16, 32, 64, 128, 256");
  }
}

}  // namespace

// q [B, H, D] (any float dtype); k_cache, v_cache [num_blocks, block_size, KVH, D] or any
// strided view with that index order and contiguous D; block_tables [B, max_blocks] int32;
// seq_lens [B] int32 (tokens in the cache, this step's included); sliding_window W > 0: only
// the last W of them are read (their table entries only need to be valid), 0: all. Returns
// [B, H, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale,
                                     int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim] views");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
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
  g.window = sliding_window;
  g.soft_cap = static_cast<float>(soft_cap);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == g.num_seqs && lens.dim() == 1 &&
                  lens.size(0) == g.num_seqs,
              "block_tables must be [num_seqs, max_blocks] and seq_lens [num_seqs], with "
              "num_seqs = q.size(0)");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "K and V caches differ in shape");
  // A bad block id would read outside the cache: checked once over the used table entries.
  const int64_t num_blocks = k_cache.size(0);
  int64_t max_parts = 1;
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp_check = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < g.num_seqs; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= g.max_blocks * g.block_size,
                "a sequence is longer than its block table");
    const int64_t first = window_start(lp[b], g.window);
    max_parts = std::max<int64_t>(
        max_parts, (lp[b] + kPartition - 1) / kPartition - first / kPartition);
    const int64_t used = (lp[b] + g.block_size - 1) / g.block_size;
    // From the first row the kernel reads: the window's kVec-aligned first tile.
    for (int64_t i = first / kVec * kVec / g.block_size; i < used; ++i) {
      const int32_t blk = tp_check[b * g.max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " is outside the cache (",
                  num_blocks, " blocks)");
    }
  }
  g.max_partitions = max_parts;
  // Scaled fp32 queries: the scale is folded in once instead of per score. With bf16 q and
  // cache and vdpbf16ps, the scores come from q's own bf16 values (scaled after): measured
  // 1.4x faster at batch 64 than widening every K row to fp32 (docs/backends/cpu.md).
  const auto qf = (q.to(torch::kFloat32) * scale).contiguous();
  torch::Tensor qb;
  g.q_bf16 = nullptr;
  g.scale = static_cast<float>(scale);
  if (kHasDotBf16 && q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
      g.head_dim % 32 == 0) {
    qb = q.contiguous();
    g.q_bf16 = qb.data_ptr<c10::BFloat16>();
  }
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

