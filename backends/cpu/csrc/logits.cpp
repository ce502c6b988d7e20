// The LM head's bf16 logits to fp32 with the entries tied at each row's maximum recomputed in
// fp32 (why: core/layers/logits.py). torch's version needs a top-k over the vocabulary, which
// costs ~4 ms at 64 rows of a 49k vocabulary; here the conversion to fp32 that the sampler
// needs anyway finds the maximum, and a second pass over the row (still in L2) finds the
// ties, so the refinement costs about one more read of the row. Any number of ties is
// handled. Rows are independent, so a row's output never depends on the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

#include "vec.h"

namespace {

using namespace cadence_cpu;

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

}  // namespace

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
