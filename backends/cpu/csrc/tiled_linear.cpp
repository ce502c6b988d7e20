// fp32 GEMMs on a register-tiled micro-kernel over weights packed once at load in column
// panels: what made the default model's decode GEMMs faster than oneDNN's packed inner product
// on an AVX2-only AMD EPYC (docs/backends/cpu.md, "The fp32 tiled GEMM"). linear.py measures it
// against oneDNN and F.linear on the model's own shapes and keeps the fastest.
//
// Why it wins at decode sizes: at 16-64 rows oneDNN's inner product runs at 45-61 GFLOP/s
// there against ~72 at 2048 rows. Here a weight panel (kNR columns, the whole K) is read
// from memory once per chunk of rows, the next panel is prefetched while the current one is
// used by every row tile, and a tile of kMR rows x kNR columns lives in registers (12 of the
// 16 AVX2 registers; 24 of AVX-512's 32), so the FMA units are fed from cache whatever the
// number of rows.
//
// A gated MLP's gate/up weight can be packed with each panel holding the gate and the up
// columns of the same outputs (tiled_pack_gated); tiled_linear_gated then writes
// silu(gate) * up from the finished panel, without the [M, 2 * h] intermediate
// (backends/cpu/gated.py).
//
// NOTE batch invariance: every output element is one FMA chain over k = 0..K-1 in order,
// whatever M is, which row tile or chunk holds the row, or which thread computes it (a K
// block ends with the partial sums stored as fp32 and reloaded: no rounding). Rows of any
// batch therefore get the bits they get alone; tests/test_cpu_kernels.py checks it.

#include <torch/extension.h>

#include <cstdint>

#include "tiled_core.h"

using namespace cadence_cpu;
using namespace cadence_cpu::tiled;

int64_t tiled_panel_width() { return kNR; }

// w [N, K] fp32 -> [ceil(N / kNR), K, kNR]: panel p holds columns p*kNR.. as K rows of kNR
// floats; the last panel is zero-padded.
torch::Tensor tiled_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w must be [N, K] float32");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t panels = (n + kNR - 1) / kNR;
  auto padded = torch::zeros({panels * kNR, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  return padded.view({panels, kNR, k}).transpose(1, 2).contiguous();
}

namespace {

// x as run_tiled reads it: fp32 [M, K], rows contiguous (a strided row view is kept).
torch::Tensor rows_of(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be on the CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat &&
                  packed.size(2) == kNR && packed.size(1) == x.size(1) && packed.is_contiguous(),
              "packed must be tiled_pack's output for K = x.size(1)");
  TORCH_CHECK(x.size(1) > 0, "K must be positive");
  return x.stride(1) == 1 && x.stride(0) >= x.size(1) ? x : x.contiguous();
}

}  // namespace

// x [M, K] fp32 (rows contiguous) times the packed weight of an [N, K] linear, plus bias
// (fp32 [N], optional, added to the finished sum) -> [M, N] fp32.
torch::Tensor tiled_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                           c10::optional<torch::Tensor> bias) {
  const auto xc = rows_of(x, packed);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(n > (panels - 1) * kNR && n <= panels * kNR, "n does not match packed");
  const auto bc = bias_of(bias, n, "n");
  auto out = torch::empty({xc.size(0), n},
                         x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0),
            FloatPanels{packed.data_ptr<float>(), xc.size(1)}, panels,
            PlainOut{out.data_ptr<float>(), n, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}

// w [2 * h, K] fp32, the gate rows then the up rows of a gated MLP, h a multiple of the
// vector width -> tiled_pack of its rows reordered so that every panel holds kVec gate
// columns and the kVec up columns of the same outputs (tiled_linear_gated's layout).
torch::Tensor tiled_pack_gated(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) % 2 == 0,
              "w must be [2 * h, K] float32 (gate rows, then up rows)");
  const int64_t h = w.size(0) / 2;
  TORCH_CHECK(h % kVec == 0, "the gated layout needs h (", h, ") to be a multiple of ", kVec);
  const int64_t k = w.size(1);
  return tiled_pack(
      w.contiguous().view({2, h / kVec, kVec, k}).transpose(0, 1).reshape({2 * h, k}));
}

// silu(x @ gate.T + bias_gate) * (x @ up.T + bias_up) -> [M, h] on tiled_pack_gated's
// weight: the bits of tiled_linear then silu_and_mul on the same weight. The packed tensor
// does not say which packing made it: a tiled_pack weight of the same shape runs, wrongly,
// so the caller (gated.py) keeps the two apart.
torch::Tensor tiled_linear_gated(torch::Tensor x, torch::Tensor packed, int64_t h,
                                 c10::optional<torch::Tensor> bias) {
  const auto xc = rows_of(x, packed);
  const int64_t panels = packed.size(0);
  TORCH_CHECK(h % kVec == 0 && panels * kVec == h, "h does not match the gated packed weight");
  const auto bc = bias_of(bias, 2 * h, "2 * h");
  auto out = torch::empty({xc.size(0), h},
                         x.options().memory_format(at::MemoryFormat::Contiguous));
  if (xc.size(0) == 0) return out;
  run_tiled(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.stride(0),
            FloatPanels{packed.data_ptr<float>(), xc.size(1)}, panels,
            GatedOut{out.data_ptr<float>(), h, bc.defined() ? bc.data_ptr<float>() : nullptr});
  return out;
}
