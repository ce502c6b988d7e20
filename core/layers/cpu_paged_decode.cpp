// Fused CPU paged-attention decode: one query token per sequence, K/V read in place from the
// flat-slot caches [num_blocks * block_size, KVH, D] through the block table (no gather).
//
// Work is split over (batch row, kv head) pairs with at::parallel_for. Every pair is computed
// by the same code in the same order whatever the batch size, the other rows' lengths or the
// thread split, so a row's output is bitwise independent of the rest of the batch. Compiled
// with -O3 -march=native -ffp-contract=off and WITHOUT -ffast-math: the compiler may vectorize
// the fixed 8-lane loops below but cannot reorder the floating-point operations.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;

// Dot product over d elements in 8 independent lanes, then a fixed-order reduction.
inline float dot_lanes(const float* __restrict a, const float* __restrict b, int64_t d) {
  float acc[kLanes] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int64_t j = 0; i < d; ++i, ++j) acc[j] += a[i] * b[i];
  float s01 = acc[0] + acc[1], s23 = acc[2] + acc[3];
  float s45 = acc[4] + acc[5], s67 = acc[6] + acc[7];
  return (s01 + s23) + (s45 + s67);
}

// out[i] += w * v[i]; element-wise, so vectorizing does not change any result.
inline void axpy(float* __restrict out, const float* __restrict v, float w, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] += w * v[i];
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor seq_lens, int64_t block_size,
                           double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "paged_decode: q, k_cache and v_cache must be float32");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: tables and seq_lens must be int64");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && tables.dim() == 2 &&
                  seq_lens.dim() == 1,
              "paged_decode: expected q [B,H,D], caches [S,KVH,D], tables [B,NB], seq_lens [B]");
  TORCH_CHECK(block_size > 0, "paged_decode: block_size must be positive");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  tables = tables.contiguous();
  seq_lens = seq_lens.contiguous();

  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t S = k_cache.size(0), KVH = k_cache.size(1);
  const int64_t NB = tables.size(1);
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_decode: k/v cache shapes differ");
  TORCH_CHECK(k_cache.size(2) == D, "paged_decode: head_dim mismatch");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "paged_decode: H must be a multiple of KVH");
  TORCH_CHECK(tables.size(0) == B && seq_lens.size(0) == B, "paged_decode: batch mismatch");
  TORCH_CHECK(S % block_size == 0, "paged_decode: cache slots not a multiple of block_size");
  const int64_t G = H / KVH;
  const int64_t num_blocks = S / block_size;

  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = seq_lens.data_ptr<int64_t>();

  // Validate lengths and the block ids that will be read, before any parallel work.
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lp[b];
    TORCH_CHECK(len >= 0 && len <= NB * block_size, "paged_decode: seq_len ", len, " of row ",
                b, " out of range for ", NB, " blocks of ", block_size);
    const int64_t nblk = (len + block_size - 1) / block_size;
    for (int64_t j = 0; j < nblk; ++j) {
      const int64_t blk = tp[b * NB + j];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_decode: block id ", blk, " of row ", b,
                  " out of range [0, ", num_blocks, ")");
    }
    if (len > max_len) max_len = len;
  }

  auto out = torch::empty({B, H, D}, q.options());
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t slot_stride = KVH * D;  // floats per slot

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(G * (max_len > 0 ? max_len : 1)));
    std::vector<float> acc(static_cast<size_t>(G * D));
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / KVH, h = pair % KVH;
      const int64_t len = lp[b];
      const int64_t* table = tp + b * NB;
      const float* qh = qp + (b * H + h * G) * D;  // G query heads, contiguous
      float* oh = op + (b * H + h * G) * D;
      if (len == 0) {
        for (int64_t i = 0; i < G * D; ++i) oh[i] = 0.f;
        continue;
      }
      // Scores: K row read once per token, dotted with the G query heads.
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* kr = kp + slot * slot_stride + h * D;
        for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot_lanes(qh + g * D, kr, D) * fscale;
      }
      // Softmax per head: max-subtract, exp, sum (sequential, fixed order).
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // Weighted V: V row read once per token, accumulated into the G heads.
      for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const float* vr = vp + slot * slot_stride + h * D;
        for (int64_t g = 0; g < G; ++g) axpy(acc.data() + g * D, vr, scores[g * len + t], D);
      }
      for (int64_t i = 0; i < G * D; ++i) oh[i] = acc[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "Fused paged-attention decode over flat-slot K/V caches (CPU, float32)");
}
