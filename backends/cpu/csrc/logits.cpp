// Two steps from the LM head to a sampled token: the bf16 logits to fp32 with their maxima made
// exact (refine_top_logits), and one draw per row from the softmax of fp32 logits
// (draw_from_logits).
//
// refine_top_logits: the LM head's bf16 logits to fp32 with the entries tied at each row's
// maximum recomputed in fp32 (why: core/layers/logits.py). torch's version needs a top-k over
// the vocabulary, which costs ~4 ms at 64 rows of a 49k vocabulary; here the conversion to
// fp32 that the sampler needs anyway finds the maximum, and a second pass over the row (still
// in L2) finds the ties, so the refinement costs about one more read of the row. Any number
// of ties is handled. Rows are independent, so a row's output never depends on the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

using namespace cadence_cpu;

constexpr int64_t kChunk = 256;  // tokens per chunk of the two-level CDF (sampler.inverse_cdf)

inline float dot_row(const c10::BFloat16* a, const c10::BFloat16* b, int64_t n) {
  vfloat acc = vfloat{};
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) acc += load(a + i) * load(b + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return s;
}

void refine_row(const c10::BFloat16* in, float* out, int64_t v, const c10::BFloat16* h,
                const c10::BFloat16* w, const c10::BFloat16* bias, int64_t hd) {
  const float lowest = -std::numeric_limits<float>::infinity();
  vfloat vmax = splat(lowest);
  int64_t j = 0;
  for (; j + kVec <= v; j += kVec) {
    const vfloat x = load(in + j);
    store(out + j, x);
    vmax = x > vmax ? x : vmax;
  }
  float m = lowest;
  for (int64_t l = 0; l < kVec; ++l) m = vmax[l] > m ? vmax[l] : m;
  for (; j < v; ++j) {
    out[j] = static_cast<float>(in[j]);
    m = out[j] > m ? out[j] : m;
  }
  if (m == lowest) return;  // an all -inf (or NaN) row has nothing to refine
  auto exact = [&](int64_t t) {
    return dot_row(h, w + t * hd, hd) + (bias ? static_cast<float>(bias[t]) : 0.0f);
  };
  const vfloat vm = splat(m);
  j = 0;
  for (; j + kVec <= v; j += kVec) {
    const vint hit = load(out + j) == vm;
    bool any = false;
    for (int64_t l = 0; l < kVec; ++l) any |= hit[l] != 0;
    if (!any) continue;
    for (int64_t l = 0; l < kVec; ++l)
      if (hit[l]) out[j + l] = exact(j + l);
  }
  for (; j < v; ++j)
    if (out[j] == m) out[j] = exact(j);
}

// exp(d) for d = x - max <= 0: vec.h's polynomial, but with AVX-512 the scaling by 2^n is one
// vscalefps, which also takes n below the exponent's range to 0, so vec.h's upper clamp and
// its two-step scaling are not needed: these exps are nearly all of draw_from_logits' work.
// The lower clamp stays (at -104, where exp is already 0 in fp32): the rounding of n needs a
// bounded argument (a repetition penalty near 0 makes logits ~1e15 below the maximum), and
// an x - max that overflows to -inf would give NaN. A NaN d stays NaN (the compare is false).
inline vfloat exp_nonpositive(vfloat d) {
#if defined(__AVX512F__)
  if constexpr (kVec == 16) {
    const vfloat x = d < -104.0f ? splat(-104.0f) : d;
    vfloat n;
    const vfloat p = cadence_cpu::detail::exp_reduced(x, n);
    return reinterpret_cast<vfloat>(
        _mm512_scalef_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(n)));
  }
#endif
  return exp(d);
}

// exp(x - m) of a row's entries [j, j + kVec), masked (-inf) entries exactly 0 (vec.h's exp
// clamps its argument, so it alone would give them ~1e-38).
inline vfloat weights(const float* x, int64_t j, vfloat vm) {
  const vfloat xv = load(x + j);
  const vfloat e = exp_nonpositive(xv - vm);
  return xv == splat(-std::numeric_limits<float>::infinity()) ? vfloat{} : e;
}

// One row: the token where the cumulative softmax weight first reaches `frac` (in (0, 1]) of
// the total. A pass for the row's maximum, one for the 256-token chunks' weight sums, then the
// chosen chunk's weights once more (the same instructions, so the same values): nothing per
// token is stored. (One pass with per-chunk maxima, rescaled after, measured slower.)
int64_t draw_row(const float* x, int64_t v, float frac) {
  const float lowest = -std::numeric_limits<float>::infinity();
  vfloat vmax = splat(lowest);
  int64_t j = 0;
  for (; j + kVec <= v; j += kVec) {
    const vfloat xv = load(x + j);
    vmax = xv > vmax ? xv : vmax;
  }
  float m = lowest;
  for (int64_t l = 0; l < kVec; ++l) m = vmax[l] > m ? vmax[l] : m;
  for (; j < v; ++j) m = x[j] > m ? x[j] : m;
  if (!(m > lowest)) return 0;  // nothing to draw: every logit -inf (or NaN)
  // A row the softmax is undefined on (+inf, or a NaN among the logits, which the comparisons
  // above skip) draws its largest logit's first token: never a masked one.
  const auto first_max = [&]() {
    int64_t i = 0;
    while (i < v && !(x[i] == m)) ++i;
    return i;
  };
  if (std::isinf(m)) return first_max();
  const vfloat vm = splat(m);
  const auto scalar_weight = [&](int64_t i) {
    return x[i] == lowest ? 0.f : std::exp(x[i] - m);
  };
  const int64_t chunks = (v + kChunk - 1) / kChunk;
  std::vector<float> cdf(static_cast<size_t>(chunks));
  float run = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t c1 = std::min(v, (c + 1) * kChunk);
    vfloat acc = vfloat{};
    int64_t i = c * kChunk;
    for (; i + kVec <= c1; i += kVec) acc += weights(x, i, vm);
    float sum = hsum(acc);
    for (; i < c1; ++i) sum += scalar_weight(i);
    cdf[c] = run += sum;
  }
  const float target = frac * run;
  if (std::isnan(run)) return first_max();
  if (!(target > 0.f)) return 0;
  int64_t c = 0;
  while (c < chunks - 1 && !(cdf[c] >= target)) ++c;
  const float rest = target - (c == 0 ? 0.f : cdf[c - 1]);
  // In token order. The chunk's running sum may round below its total, so the search stops
  // at its last token with weight.
  const int64_t c0 = c * kChunk, c1 = std::min(v, c0 + kChunk);
  float w[kChunk];
  int64_t i = c0;
  for (; i + kVec <= c1; i += kVec) store(w + (i - c0), weights(x, i, vm));
  for (; i < c1; ++i) w[i - c0] = scalar_weight(i);
  float acc = 0.f;
  int64_t last = -1;
  for (int64_t t = 0; t < c1 - c0; ++t) {
    if (!(w[t] > 0.f)) continue;
    last = t;
    acc += w[t];
    if (acc >= rest) return c0 + t;
  }
  return last >= 0 ? c0 + last : 0;
}

}  // namespace

// logits [B, V] fp32 (temperature already applied; masked entries -inf), frac [B] fp32 in
// (0, 1] -> int64 [B]: per row, the first token whose cumulative softmax weight reaches frac of
// the row's total, the same rule as the sampler's torch path (softmax, then inverse_cdf) in one
// pass over the logits and one over a 256-token chunk, with no probabilities written. A row
// whose logits are all -inf draws token 0; one with a NaN or +inf logit, its largest logit's
// first token. Rows are independent of each other.
torch::Tensor draw_from_logits(torch::Tensor logits, torch::Tensor frac) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "draw_from_logits: logits must be [B, V] float32");
  const int64_t b = logits.size(0), v = logits.size(1);
  TORCH_CHECK(v > 0, "draw_from_logits: an empty vocabulary");
  TORCH_CHECK(frac.scalar_type() == at::kFloat && frac.numel() == b,
              "draw_from_logits: frac must be float32 with one value per row");
  const auto lc = logits.contiguous();
  const auto fc = frac.contiguous();
  auto out = torch::empty({b}, logits.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  const float* fp = fc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = draw_row(lp + r * v, v, fp[r]);
  });
  return out;
}

// logits [B, V] bf16 (the head's output), hidden [B, H] bf16, weight [V, H] bf16, bias [V]
// bf16 or None -> fp32 logits [B, V].
torch::Tensor refine_top_logits(torch::Tensor logits, torch::Tensor hidden, torch::Tensor weight,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(logits.dim() == 2 && hidden.dim() == 2 && weight.dim() == 2,
              "refine_top_logits: logits [B, V], hidden [B, H] and weight [V, H] expected");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 && hidden.scalar_type() == at::kBFloat16 &&
                  weight.scalar_type() == at::kBFloat16,
              "refine_top_logits: logits, hidden and weight must be bfloat16");
  const int64_t b = logits.size(0), v = logits.size(1), hd = hidden.size(1);
  TORCH_CHECK(hidden.size(0) == b && weight.size(0) == v && weight.size(1) == hd,
              "refine_top_logits: shapes disagree: logits ", logits.sizes(), ", hidden ",
              hidden.sizes(), ", weight ", weight.sizes());
  const auto lc = logits.contiguous();
  const auto hc = hidden.contiguous();
  const auto wc = weight.contiguous();
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == v,
                "refine_top_logits: bias must be bfloat16 [V]");
    bc = bias->contiguous();
  }
  auto out = torch::empty({b, v}, logits.options().dtype(at::kFloat));
  const auto* lp = lc.data_ptr<c10::BFloat16>();
  const auto* hp = hc.data_ptr<c10::BFloat16>();
  const auto* wp = wc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = bc.defined() ? bc.data_ptr<c10::BFloat16>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      refine_row(lp + r * v, op + r * v, v, hp + r * hd, wp, bp, hd);
  });
  return out;
}
