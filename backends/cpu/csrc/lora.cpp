// LoRA's expand, added in place: y[m] += t[m, s:s+w] @ bt[s:s+w] for each row m, where
// [s, s + w) are the columns of the shrink's output that belong to the row's own adapter
// (cadence/lora/runtime.py). One pass over y: at a prefill chunk the separate expand GEMM
// and add it replaces wrote and read the [tokens, out] update twice more, and cost more
// than the layer's own GEMM.
//
// NOTE exactness: a row reads only its own adapter's columns, in order, into one chain of
// explicit FMAs per output (fp32; vec.h fma, std::fma in the tail: never left to the
// compiler's contraction), so its update has the same bits whatever else is in the batch,
// whichever adapters share the step, and whether its rows are served four at a time or
// one. The update is rounded to y's dtype before the add, and the sum again, as torch's
// y.add_(d) rounds a bf16 d (a NaN is kept a NaN only up to its payload).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace {

using namespace cadence_cpu;

constexpr int64_t kBlocks = 4;  // vectors of outputs per pass over a row's columns
constexpr int64_t kRows = 4;    // rows of one adapter served by each load of bt

// Rows rows[0..R) share their columns (first, w). Each row's outputs are the same FMA
// chain over its columns as if it were alone: grouping only shares the loads of bt.
template <typename T, int64_t R>
void expand_add_group(T* y, const T* t, const float* bt, const int64_t* rows, int64_t first,
                      int64_t w, int64_t n, int64_t c) {
  const float* b0 = bt + first * n;
  int64_t j = 0;
  for (; j + kBlocks * kVec <= n; j += kBlocks * kVec) {
    vfloat acc[R][kBlocks] = {};
    for (int64_t k = 0; k < w; ++k) {
      const float* bk = b0 + k * n + j;
      vfloat b[kBlocks];
      for (int64_t q = 0; q < kBlocks; ++q) b[q] = load(bk + q * kVec);
      for (int64_t i = 0; i < R; ++i) {
        const vfloat tk = splat(static_cast<float>(t[rows[i] * c + first + k]));
        for (int64_t q = 0; q < kBlocks; ++q) acc[i][q] = fma(tk, b[q], acc[i][q]);
      }
    }
    for (int64_t i = 0; i < R; ++i) {
      for (int64_t q = 0; q < kBlocks; ++q) {
        T* out = y + rows[i] * n + j + q * kVec;
        store(out, round_to(load(out) + round_to(acc[i][q], out), out));
      }
    }
  }
  for (int64_t i = 0; i < R; ++i) {
    const T* tr = t + rows[i] * c + first;
    T* yr = y + rows[i] * n;
    for (int64_t jj = j; jj < n; ++jj) {
      float acc = 0.0f;
      for (int64_t k = 0; k < w; ++k)
        acc = std::fma(static_cast<float>(tr[k]), b0[k * n + jj], acc);
      const float d = static_cast<float>(static_cast<T>(acc));
      yr[jj] = static_cast<T>(static_cast<float>(yr[jj]) + d);
    }
  }
}

template <typename T>
void expand_add_rows(T* y, const T* t, const float* bt, const int64_t* starts,
                     const int64_t* widths, const int64_t* order, int64_t m, int64_t n,
                     int64_t c) {
  // Blocks of kRows positions of ``order`` (the rows sorted by adapter): rows of one adapter
  // group, wherever they sit in the batch.
  const int64_t blocks = (m + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t lo = blk * kRows, hi = std::min(m, lo + kRows);
      for (int64_t p = lo; p < hi;) {
        const int64_t r = order[p];
        const int64_t w = widths[r];
        int64_t same = 1;
        while (p + same < hi && widths[order[p + same]] == w &&
               starts[order[p + same]] == starts[r])
          ++same;
        if (w > 0) {
          if (same == kRows) {
            expand_add_group<T, kRows>(y, t, bt, order + p, starts[r], w, n, c);
          } else {
            for (int64_t i = 0; i < same; ++i)
              expand_add_group<T, 1>(y, t, bt, order + p + i, starts[r], w, n, c);
          }
        }
        p += same;
      }
    }
  });
}

}  // namespace

// y [M, N] (contiguous, in place) and t [M, C] of one dtype, float32 or bfloat16; bt
// [C, N] float32 (bf16 weights widened once, exactly); starts and widths [M] int64 (a width
// of 0 leaves the row alone).
void lora_expand_add(torch::Tensor y, torch::Tensor t, torch::Tensor bt, torch::Tensor starts,
                     torch::Tensor widths, torch::Tensor order) {
  TORCH_CHECK(y.dim() == 2 && t.dim() == 2 && bt.dim() == 2, "lora_expand_add: 2-D tensors");
  TORCH_CHECK(y.is_contiguous() && bt.is_contiguous(), "lora_expand_add: y, bt contiguous");
  TORCH_CHECK(t.size(0) == y.size(0) && bt.size(0) == t.size(1) && bt.size(1) == y.size(1),
              "lora_expand_add: shapes [M, N], [M, C], [C, N]");
  TORCH_CHECK(t.scalar_type() == y.scalar_type() && bt.scalar_type() == at::kFloat,
              "lora_expand_add: y and t share a dtype, bt is float32");
  TORCH_CHECK(starts.scalar_type() == at::kLong && widths.scalar_type() == at::kLong &&
                  order.scalar_type() == at::kLong && starts.numel() == y.size(0) &&
                  widths.numel() == y.size(0) && order.numel() == y.size(0),
              "lora_expand_add: starts, widths and order are [M] int64");
  const auto tc = t.contiguous();
  const auto sc = starts.contiguous();
  const auto wc = widths.contiguous();
  const auto oc = order.contiguous();
  const int64_t m = y.size(0), n = y.size(1), c = t.size(1);
  const int64_t* s = sc.data_ptr<int64_t>();
  const int64_t* w = wc.data_ptr<int64_t>();
  const int64_t* o = oc.data_ptr<int64_t>();
  std::vector<char> seen(m, 0);
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(w[r] <= 0 || (s[r] >= 0 && s[r] + w[r] <= c),
                "lora_expand_add: a row's columns lie outside t");
    TORCH_CHECK(o[r] >= 0 && o[r] < m && !seen[o[r]],
                "lora_expand_add: order must be a permutation of the rows");
    seen[o[r]] = 1;
  }
  if (y.scalar_type() == at::kFloat) {
    expand_add_rows<float>(y.data_ptr<float>(), tc.data_ptr<float>(), bt.data_ptr<float>(), s,
                           w, o, m, n, c);
  } else {
    TORCH_CHECK(y.scalar_type() == at::kBFloat16,
                "lora_expand_add: only float32 and bfloat16 are supported");
    expand_add_rows<c10::BFloat16>(y.data_ptr<c10::BFloat16>(), tc.data_ptr<c10::BFloat16>(),
                                   bt.data_ptr<float>(), s, w, o, m, n, c);
  }
}
