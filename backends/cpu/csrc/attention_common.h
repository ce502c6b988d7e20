// Arithmetic shared by the decode and prefill attention kernels. A token's attention must
// have the same bits whichever kernel computes it: a request recomputed after preemption
// turns decoded tokens into prompt rows, and async on == off stays exact only if those rows
// match. So both kernels take their scores, softmax and partition merge from here, and
// accumulate V in token order from zero.
#pragma once

#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace cadence_cpu {

constexpr int64_t kPartition = 256;  // tokens per softmax partition; fixed (batch invariance)

// Vector registers the accumulators of a V pass may take: half of AVX-512's 32, half of
// AVX2's (or SSE's) 16; the rest hold the V row and the broadcast weights.
constexpr int kAccVecs = kVec >= 16 ? 16 : 8;

// Column vectors per chunk of accumulate_v: all NC where HB * NC accumulators fit, else the
// largest power of two that does (NC is a power of two).
constexpr int chunk_cols(int nc, int hb) {
  int cc = nc;
  while (cc > 1 && hb * cc > kAccVecs) cc /= 2;
  return cc;
}

// The first key a query at position len - 1 sees under a sliding window of `window` tokens
// (0: no window): keys j with len - 1 - window < j, transformers' rule.
inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}

namespace detail {
// Lane j of the result: lane (j / W) * 2W + j % W (+ W for the high half) of the pair (a, b)
// read as one 2 * kVec-lane vector.
template <int W, bool High, size_t... I>
inline vfloat pick_blocks(vfloat a, vfloat b, std::index_sequence<I...>) {
  return __builtin_shuffle(
      a, b, vint{static_cast<int32_t>((I / W) * 2 * W + I % W + (High ? W : 0))...});
}
// One level of reduce_lanes: n vectors whose lanes hold blocks of 2W partial sums -> n / 2
// vectors with blocks of W, each lane the sum of two.
template <int W>
inline void reduce_level(vfloat* v, int n) {
  constexpr auto idx = std::make_index_sequence<kVec>{};
  for (int k = 0; k < n / 2; ++k)
    v[k] = pick_blocks<W, false>(v[2 * k], v[2 * k + 1], idx) +
           pick_blocks<W, true>(v[2 * k], v[2 * k + 1], idx);
}
}  // namespace detail

// Sums each of kVec vectors across its lanes: out[i] = the sum of v[i]'s lanes (in hsum's
// pairing order). A transpose-and-add tree (kVec - 1 pairs of two-input shuffles) instead of
// kVec separate horizontal sums (~3x fewer ops). Clobbers v.
inline vfloat reduce_lanes(vfloat* v) {
  int n = kVec;
  if constexpr (kVec >= 16) { detail::reduce_level<8>(v, n); n /= 2; }
  if constexpr (kVec >= 8) { detail::reduce_level<4>(v, n); n /= 2; }
  detail::reduce_level<2>(v, n);
  n /= 2;
  detail::reduce_level<1>(v, n);
  return v[0];
}

// Scores of one query head against the kVec rows of a tile (head offset `off` into each row).
// fp32: q prescaled (qh). bf16 q and K on a CPU with vdpbf16ps: the unscaled bf16 q (qbh,
// non-null) through dot_bf16, scaled after.
template <typename cache_t, int NC>
inline vfloat tile_scores(const float* qh, const c10::BFloat16* qbh, const cache_t* const* rows,
                          int64_t off, float scale) {
  vfloat part[kVec];
  if constexpr (std::is_same_v<cache_t, c10::BFloat16> && kHasDotBf16 && NC % 2 == 0) {
    if (qbh != nullptr) {  // 32 dims per instruction
      for (int64_t i = 0; i < kVec; ++i) {
        const cache_t* row = rows[i] + off;
        vfloat s = dot_bf16(vfloat{}, qbh, row);
        for (int c = 2; c < NC; c += 2) s = dot_bf16(s, qbh + c * kVec, row + c * kVec);
        part[i] = s;
      }
      return reduce_lanes(part) * scale;
    }
  }
  vfloat qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = load(qh + c * kVec);
  for (int64_t i = 0; i < kVec; ++i) {
    const cache_t* row = rows[i] + off;
    vfloat s = qv[0] * load(row);
    for (int c = 1; c < NC; ++c) s += qv[c] * load(row + c * kVec);
    part[i] = s;
  }
  return reduce_lanes(part);
}

// Gemma 2's soft cap on the scaled scores: cap * tanh(s / cap), tanh from the kernels' own
// exp (tanh(x) = 1 - 2 / (exp(2x) + 1); exp's clamp saturates it at +-1). cap <= 0: none.
// Decode and prefill both apply it here, so their rows keep one arithmetic.
inline vfloat soft_cap_scores(vfloat s, float cap) {
  if (cap <= 0.f) return s;
  const vfloat e = exp(s * (2.f / cap));
  return (1.f - 2.f / (e + 1.f)) * cap;
}

// One head's scores over a partition (`padded` of them, a multiple of kVec; masked lanes are
// -inf) -> their exponentials in place, relative to the partition's max (from the running
// vector max `maxv`); writes that max and the exponentials' sum.
inline void exp_partition(float* sh, vfloat maxv, int64_t padded, float* max_out,
                          float* sum_out) {
  const vfloat neg_inf = splat(-std::numeric_limits<float>::infinity());
  float m = maxv[0];
  for (int lane = 1; lane < kVec; ++lane) m = std::max(m, maxv[lane]);
  const vfloat ms = splat(m);
  vfloat lv = vfloat{};
  for (int64_t i = 0; i < padded; i += kVec) {
    vfloat x = load(sh + i) - ms;
    vfloat e = exp(x);
    e = x == neg_inf ? vfloat{} : e;  // exp clamps; a masked lane must be exactly 0
    store(sh + i, e);
    lv += e;
  }
  *max_out = m;
  *sum_out = hsum(lv);
}

// One head's partitions (unnormalised accumulators pa [parts][d], maxima pm, sums ps) merged
// in order and normalised into ob; o is [d] scratch.
template <typename out_t>
inline void merge_partitions(int64_t parts, const float* pm, const float* ps, const float* pa,
                             int64_t d, out_t* ob, float* o) {
  if (parts == 1) {
    const float inv = ps[0] > 0.f ? 1.f / ps[0] : 0.f;
    for (int64_t i = 0; i < d; ++i) ob[i] = static_cast<out_t>(pa[i] * inv);
    return;
  }
  float gm = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < parts; ++p) gm = std::max(gm, pm[p]);
  std::fill(o, o + d, 0.f);
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

}  // namespace cadence_cpu
