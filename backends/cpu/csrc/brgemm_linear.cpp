// bf16 GEMMs through ATen's batch-reduce GEMM micro-kernel (at::native::cpublas::brgemm, the
// oneDNN ukernel that torch's own CPU flash attention calls), on weights packed once at load.
//
// Why not only oneDNN's inner product (torch.ops.mkldnn._linear_pointwise): every call there
// builds a primitive descriptor before it finds the cached primitive, ~25 us a call on an AMX
// Xeon whatever the GEMM's size, and a decode step of the default model makes 121 GEMM calls.
// The micro-kernel is looked up by shape in a small cache and runs on AMX tiles where the CPU
// has them. linear.py measures both on the model's shapes and keeps the faster.
//
// NOTE batch invariance: the output is computed in column blocks of kBlockN; each block's rows
// are one micro-kernel call over the whole K, so an element's sum runs over K in the same order
// whatever M is or which thread computes it. Rows are split into chunks of kBlockM only to
// bound the scratch; a chunk boundary changes no element's arithmetic.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace {

using namespace cadence_cpu;

constexpr int64_t kBlockN = 32;   // output columns per micro-kernel call (two AMX tiles)
constexpr int64_t kBlockM = 256;  // rows per call; bounds the fp32 scratch

}  // namespace

bool brgemm_available() { return at::native::cpublas::could_pack(at::kBFloat16); }

// w [N, K] bf16 -> [ceil(N / kBlockN), K, kBlockN] in the micro-kernel's VNNI layout (K pairs
// interleaved); the last block is zero-padded to kBlockN columns.
torch::Tensor brgemm_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bfloat16");
  TORCH_CHECK(brgemm_available(), "this CPU has no bf16 micro-kernel to pack for");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % 2 == 0, "K must be even for the VNNI layout, got ", k);
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  auto wt = torch::zeros({k, blocks * kBlockN}, w.options());
  wt.narrow(1, 0, n).copy_(w.t());  // [K, N padded]
  auto out = torch::empty({blocks, k, kBlockN}, w.options());
  const auto* src = wt.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  for (int64_t b = 0; b < blocks; ++b)
    at::native::cpublas::pack(k, kBlockN, blocks * kBlockN, kBlockN, at::kBFloat16,
                              at::kBFloat16, src + b * kBlockN, dst + b * k * kBlockN);
  return out;
}

// x [M, K] bf16 (rows contiguous) times the packed weight of an [N, K] linear, plus bias
// (bf16 [N], optional) -> [M, N] bf16; fp32 accumulation, rounded to bf16 once per element.
torch::Tensor brgemm_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockN && packed.size(1) == x.size(1),
              "packed must be brgemm_pack's output for K = x.size(1)");
  // Rows must be runs of K elements at a stride of at least K (an expanded view is not).
  const auto xc = x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), lda = xc.stride(0);
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(n > (blocks - 1) * kBlockN && n <= blocks * kBlockN, "n does not match packed");
  const at::BFloat16* b_ptr = nullptr;
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(at::kBFloat16).contiguous();
    TORCH_CHECK(bc.numel() == n, "bias must have n elements");
    b_ptr = bc.data_ptr<at::BFloat16>();
  }
  auto out = torch::empty({m, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (m == 0) return out;
  const auto* a = xc.data_ptr<at::BFloat16>();
  const auto* w = packed.data_ptr<at::BFloat16>();
  auto* o = out.data_ptr<at::BFloat16>();
  const int64_t mchunks = (m + kBlockM - 1) / kBlockM;
  // Work items are (row chunk, column block), each over the whole K: which thread runs an
  // item, or how many rows share its chunk, never changes an element's sum.
  at::parallel_for(0, mchunks * blocks, 1, [&](int64_t begin, int64_t end) {
    // The tile configuration brgemm sets up is this thread's until released; released on
    // every way out, a failed allocation or a throwing brgemm included.
    struct ReleaseOnExit {
      ~ReleaseOnExit() { at::native::cpublas::brgemm_release(); }
    } release;
    std::vector<float> c(static_cast<size_t>(std::min(m, kBlockM) * kBlockN));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mc = item / blocks, nb = item % blocks;
      const int64_t m0 = mc * kBlockM, rows = std::min(kBlockM, m - m0);
      const int64_t n0 = nb * kBlockN, cols = std::min(kBlockN, n - n0);
      at::native::cpublas::brgemm(rows, kBlockN, k, lda, kBlockN, kBlockN, false,
                                  a + m0 * lda, w + nb * k * kBlockN, c.data());
      for (int64_t r = 0; r < rows; ++r) {
        at::BFloat16* orow = o + (m0 + r) * n + n0;
        const float* crow = c.data() + r * kBlockN;
        // The bias is added to the fp32 sum, as oneDNN's inner product adds it; vec.h's
        // store rounds to nearest even, as the scalar conversion of the tail does.
        int64_t j = 0;
        for (; j + kVec <= cols; j += kVec) {
          vfloat v = load(crow + j);
          if (b_ptr != nullptr) v += load(b_ptr + n0 + j);
          store(orow + j, v);
        }
        for (; j < cols; ++j) {
          const float v = b_ptr == nullptr ? crow[j] : crow[j] + static_cast<float>(b_ptr[n0 + j]);
          orow[j] = static_cast<at::BFloat16>(v);
        }
      }
    }
  });
  return out;
}
