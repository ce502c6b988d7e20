// Causal attention of fresh prompts (no cached context) for the CPU backend, every prompt of
// a step in one call.
//
// SDPA's CPU flash kernel takes one padded [B, H, L, D] batch, so prompts of different
// lengths went in one call each: 64 prompts of 32 tokens cost 64 calls per layer, most of it
// dispatch. Here work items are (prompt, KV head, tile of 32 query tokens), taken by the
// threads costliest first; an item serves every query head of its KV head, reading K and V
// straight from this step's qkv output.
//
// NOTE exactness: each query row gets the bits the decode kernel (paged_attention.cpp) would
// give the same token: the same partitions of 256 keys, the same score, softmax and merge
// code (attention_common.h), V summed in key order from zero. A request recomputed after a
// preemption turns its decoded tokens into prompt rows; async on == off stays exact only
// because those rows do not change. What the prefill adds is reuse: a V row is loaded once
// for R query rows (register-blocked), and K and V come from L1/L2, not from the cache.
// Under a sliding window a row skips the partitions before its window and masks the older
// lanes of the kVec-aligned tile the window starts in, as the decode kernel does.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attention_common.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace cadence_cpu;

constexpr int64_t kQueryTile = 32;  // query tokens per work item

struct Inputs {
  int64_t q_t, q_h, k_t, k_h, v_t, v_h;  // token and head strides (elements)
  int64_t heads, kv_heads, group;
  float scale;
  int64_t window;  // sliding window in tokens; 0: none
  bool dot_bf16;
  float soft_cap;  // cap * tanh(score / cap) when > 0 (attention_common.h)  // scores from the raw bf16 q through vdpbf16ps (the decode kernel's rule)
};

struct Scratch {
  std::vector<float> q, scores, acc, maxes, sums, merge;
};

// Query tokens [q0, q1) of the prompt starting at token s, for the query heads of KV head
// kh, against keys [window_start(token + 1), token + 1) of the same prompt.
template <typename T, int NC>
void attend_item(const Inputs& in, const T* q, const T* k, const T* v, T* out, int64_t s,
                 int64_t kh, int64_t q0, int64_t q1, Scratch& w) {
  constexpr int64_t D = NC * kVec;
  // Query rows per V-row load: R * NC accumulators within kAccVecs vector registers.
  constexpr int R = NC >= kAccVecs ? 1 : (kAccVecs / NC > 4 ? 4 : kAccVecs / NC);
  constexpr int64_t stride = kPartition + kVec;
  const int64_t G = in.group, H = in.heads;
  const int64_t rows = (q1 - q0) * G;
  const int64_t max_parts = (q1 + kPartition - 1) / kPartition;
  w.scores.resize(static_cast<size_t>(R * stride));
  w.acc.resize(static_cast<size_t>(R * max_parts * D));
  w.maxes.resize(static_cast<size_t>(R * max_parts));
  w.sums.resize(static_cast<size_t>(R * max_parts));
  w.merge.resize(static_cast<size_t>(D));
  // The decode kernel's fp32 queries, q * scale (one rounding, as torch's multiply), for
  // row r = (token q0 + r / G, head kh * G + r % G).
  w.q.resize(static_cast<size_t>(rows * D));
  for (int64_t r = 0; r < rows; ++r) {
    const T* qr = q + (s + q0 + r / G) * in.q_t + (kh * G + r % G) * in.q_h;
    for (int64_t c = 0; c < NC; ++c)
      store(w.q.data() + r * D + c * kVec, load(qr + c * kVec) * splat(in.scale));
  }
  const T* kp = k + s * in.k_t + kh * in.k_h;  // this KV head's row of token 0
  const T* vp = v + s * in.v_t + kh * in.v_h;
  const vfloat neg_inf = splat(-std::numeric_limits<float>::infinity());
  const T* krows[kVec];

  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int nr = static_cast<int>(std::min<int64_t>(R, rows - r0));
    int64_t lim[R], lo[R], qrow[R];  // keys [lo, lim) per row; its row in out ([T * H])
    const float* qf[R];
    const c10::BFloat16* qb[R];
    for (int i = 0; i < R; ++i) {
      const int64_t r = r0 + std::min(i, nr - 1);
      lim[i] = q0 + r / G + 1;
      lo[i] = window_start(lim[i], in.window);
      qrow[i] = (s + q0 + r / G) * H + kh * G + r % G;
      qf[i] = w.q.data() + r * D;
      qb[i] = nullptr;
      if constexpr (std::is_same_v<T, c10::BFloat16>)
        if (in.dot_bf16) qb[i] = q + (s + q0 + r / G) * in.q_t + (kh * G + r % G) * in.q_h;
    }
    const int64_t maxlim = lim[nr - 1];
    const int64_t parts = (maxlim + kPartition - 1) / kPartition;
    // lo[0] is the group's smallest: rows are in token order.
    for (int64_t p = lo[0] / kPartition; p < parts; ++p) {
      const int64_t t0 = p * kPartition, t1 = std::min(maxlim, t0 + kPartition);
      const int64_t ts = std::max(t0, lo[0] / kVec * kVec);  // first tile, kVec-aligned
      const int64_t padded = (t1 - ts + kVec - 1) / kVec * kVec;
      vfloat maxv[R];
      bool active[R];  // the row has keys in this partition
      for (int i = 0; i < R; ++i) {
        maxv[i] = neg_inf;
        active[i] = i < nr && lim[i] > t0 && lo[i] < t1;
      }
      for (int64_t t = ts; t < t1; t += kVec) {
        const int64_t count = std::min<int64_t>(kVec, t1 - t);
        for (int64_t j = 0; j < kVec; ++j) krows[j] = kp + (t + std::min(j, count - 1)) * in.k_t;
        for (int i = 0; i < nr; ++i) {
          if (!active[i]) continue;
          if (t + kVec <= lo[i]) {  // the whole tile is before this row's window
            store(w.scores.data() + i * stride + (t - ts), neg_inf);
            continue;
          }
          vfloat sc = soft_cap_scores(tile_scores<T, NC>(qf[i], qb[i], krows, 0, in.scale),
                                      in.soft_cap);
          for (int64_t lane = std::max<int64_t>(0, lim[i] - t); lane < kVec; ++lane)
            sc[lane] = neg_inf[0];
          for (int64_t lane = 0; lane < lo[i] - t; ++lane) sc[lane] = neg_inf[0];
          store(w.scores.data() + i * stride + (t - ts), sc);
          maxv[i] = maxv[i] > sc ? maxv[i] : sc;
        }
      }
      for (int i = 0; i < nr; ++i)
        if (active[i])
          exp_partition(w.scores.data() + i * stride, maxv[i], padded,
                        w.maxes.data() + i * max_parts + p, w.sums.data() + i * max_parts + p);
      // Weighted V sum in key order; a row's keys outside [lo, lim) weigh exactly 0 and are
      // skipped.
      vfloat a[R][NC];
      for (int i = 0; i < R; ++i)
        for (int c = 0; c < NC; ++c) a[i][c] = vfloat{};
      for (int64_t t = std::max(t0, lo[0]); t < t1; ++t) {
        const T* vr = vp + t * in.v_t;
        vfloat vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = load(vr + c * kVec);
        for (int i = 0; i < nr; ++i) {
          if (lim[i] <= t || t < lo[i]) continue;
          const vfloat pi = splat(w.scores[i * stride + (t - ts)]);
          for (int c = 0; c < NC; ++c) a[i][c] += pi * vv[c];
        }
      }
      for (int i = 0; i < nr; ++i)
        if (active[i])
          for (int c = 0; c < NC; ++c)
            store(w.acc.data() + (i * max_parts + p) * D + c * kVec, a[i][c]);
    }
    for (int i = 0; i < nr; ++i) {
      // The row's partitions, from the one its window starts in (the decode kernel's).
      const int64_t first = lo[i] / kPartition;
      merge_partitions((lim[i] + kPartition - 1) / kPartition - first,
                       w.maxes.data() + i * max_parts + first, w.sums.data() + i * max_parts + first,
                       w.acc.data() + (i * max_parts + first) * D, D, out + qrow[i] * D,
                       w.merge.data());
    }
  }
}

template <typename T, int NC>
void run(const Inputs& in, const T* q, const T* k, const T* v, T* out, const int64_t* starts,
         const int64_t* lens, int64_t num_prompts) {
  struct Item {
    int64_t prompt, kh, q0, q1;
  };
  std::vector<Item> items;
  for (int64_t p = 0; p < num_prompts; ++p)
    for (int64_t q0 = 0; q0 < lens[p]; q0 += kQueryTile)
      for (int64_t kh = 0; kh < in.kv_heads; ++kh)
        items.push_back({p, kh, q0, std::min(lens[p], q0 + kQueryTile)});
  // Costliest first (the last query tiles of the longest prompts), so the threads' shares
  // even out at the end.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.q1 > b.q1; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w;
    for (int64_t i = next++; i < n; i = next++) {
      const Item& it = items[i];
      attend_item<T, NC>(in, q, k, v, out, starts[it.prompt], it.kh, it.q0, it.q1, w);
    }
  });
}

template <typename T>
void dispatch_dim(int64_t d, const Inputs& in, const T* q, const T* k, const T* v, T* out,
                  const int64_t* starts, const int64_t* lens, int64_t num_prompts) {
  switch (d) {
    case 16: return run<T, 16 / kVec>(in, q, k, v, out, starts, lens, num_prompts);
    case 32: return run<T, 32 / kVec>(in, q, k, v, out, starts, lens, num_prompts);
    case 64: return run<T, 64 / kVec>(in, q, k, v, out, starts, lens, num_prompts);
    case 128: return run<T, 128 / kVec>(in, q, k, v, out, starts, lens, num_prompts);
    case 256: return run<T, 256 / kVec>(in, q, k, v, out, starts, lens, num_prompts);
    default: TORCH_CHECK(false, "prefill_attention: head_dim must be one of 16, 32, 64, 128, 256");
  }
}

}  // namespace

// q [T, H, D], k and v [T, KVH, D] (any token/head strides, contiguous D, one dtype), out
// [T, H, D] contiguous in that dtype; prompt i is tokens [starts[i], starts[i] + lens[i])
// (int64), all of it new (causal from its first token). sliding_window W > 0: the token at
// position i sees keys i - W < j <= i only; 0: none. Writes those rows of out.
void prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                       torch::Tensor starts, torch::Tensor lens, double scale,
                       int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(sliding_window >= 0, "prefill_attention: sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0),
              "prefill_attention: q must be [T, H, D] and k, v [T, KVH, D]");
  TORCH_CHECK(k.size(2) == q.size(2), "prefill_attention: head_dim of q and k differ");
  TORCH_CHECK(q.size(1) % k.size(1) == 0,
              "prefill_attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_attention: head_dim must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "prefill_attention: q, k, v and out must share a dtype");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(),
              "prefill_attention: out must be a contiguous [T, H, D]");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  starts.dim() == 1 && lens.sizes() == starts.sizes(),
              "prefill_attention: starts and lens must be int64 [num_prompts]");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128 || d == 256,
              "prefill_attention: head_dim must be one of 16, 32, 64, 128, 256");
  const auto st = starts.contiguous();
  const auto ln = lens.contiguous();
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  for (int64_t i = 0; i < st.size(0); ++i)
    TORCH_CHECK(sp[i] >= 0 && lp[i] >= 0 && sp[i] + lp[i] <= q.size(0),
                "prefill_attention: prompt ", i, " runs past the token batch");
  const Inputs in{q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  q.size(1), k.size(1), q.size(1) / k.size(1), static_cast<float>(scale),
                  sliding_window, kHasDotBf16 && q.scalar_type() == at::kBFloat16 && d % 32 == 0,
                  static_cast<float>(soft_cap)};
  if (q.scalar_type() == at::kFloat)
    dispatch_dim<float>(d, in, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                        out.data_ptr<float>(), sp, lp, st.size(0));
  else if (q.scalar_type() == at::kBFloat16)
    dispatch_dim<c10::BFloat16>(d, in, q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(),
                                v.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), sp,
                                lp, st.size(0));
  else
    TORCH_CHECK(false, "prefill_attention: only float32 and bfloat16 are supported");
}
