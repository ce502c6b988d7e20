// bf16 GEMMs on AMX tiles with our own tile loop, on weights packed once at load.
//
// Why not only the batch-reduce micro-kernel (brgemm_linear.cpp): at a decode step's 64 rows
// the weights stream from memory, and each of its calls loads its 32-column block with no
// look-ahead, so a core waits on memory, then computes, then waits again. Measured on an AMX
// Xeon, the default model's decode GEMMs took about the sum of their tile arithmetic and their
// weight stream. This loop prefetches the next block while it multiplies the current one:
// 1.15-1.2x on those GEMMs (docs/backends/cpu.md).
//
// NOTE batch invariance: every output element is the fp32 tile accumulation of
// tdpbf16ps over K in steps of 32, in order, whatever M is or which thread runs the block;
// a row is computed by the same instructions whether it sits in a tile with 15 other rows or
// alone with zero padding (a tile row's dot products never read another row). So a row's bits
// do not depend on its batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm_chunks.h"
#include "vec.h"

namespace {

using namespace cadence_cpu;

constexpr int64_t kBlockN = 32;   // output columns per block: two 16-column tiles
constexpr int64_t kHalf = 16;     // the gated layout's gate (or up) columns per block
constexpr int64_t kStepK = 32;    // K per tile step (16 VNNI pairs)
constexpr int64_t kBlockM = 256;  // most rows per work item; bounds the fp32 scratch

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_amx() {
  // Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

__attribute__((target("amx-tile,amx-bf16,avx512f"))) void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // Some compilers' _tile_loadconfig tells the optimizer it reads 8 bytes of the config, which
  // lets it drop the stores above; the barrier keeps all 64 bytes written.
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// C[mtiles * 16, 32] (fp32, ldc 32) = A[mtiles * 16, kpad] . B[kpad, 32], B in VNNI pairs
// ([kpad / 2][32][2]); A rows padded to whole tiles. Rows go two tiles at a time (four
// accumulators, two A and two B tiles: all eight tile registers). `pf` is the next block, or
// nullptr: the first pass prefetches it into L2, one K step's worth of it per K step (it is as
// long as this block), so it has every later pass, and then the next block's first, to
// arrive. Spread over every pass instead, the last lines went out too late to arrive in time:
// at 64 rows (two passes) measured 1.06-1.10x slower on an AMX Xeon, at 256 rows 1.02-1.06x.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void block_kernel(
    const at::BFloat16* a, int64_t lda, int64_t mtiles, const at::BFloat16* b, int64_t kpad,
    float* c, const char* pf, const char* pf_end) {
  const int64_t ksteps = kpad / kStepK;
  const int64_t a_stride = lda * 2;
  constexpr int64_t b_stride = kBlockN * 2 * 2;  // bytes per VNNI pair row: 32 cols x 2 x bf16
  constexpr int64_t step_bytes = (kStepK / 2) * b_stride;  // 2 KiB of weights per K step
  int64_t mt = 0;
  for (; mt + 2 <= mtiles; mt += 2) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const at::BFloat16* a0 = a + mt * 16 * lda;
    const at::BFloat16* a1 = a0 + 16 * lda;
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      if (pf != nullptr && mt == 0) {
        const char* p = pf + ks * step_bytes;
        for (int64_t off = 0; off < step_bytes && p + off < pf_end; off += 64)
          _mm_prefetch(p + off, _MM_HINT_T1);
      }
      const char* bk = reinterpret_cast<const char*>(b) + ks * step_bytes;
      _tile_loadd(4, a0 + ks * kStepK, a_stride);
      _tile_loadd(5, a1 + ks * kStepK, a_stride);
      _tile_loadd(6, bk, b_stride);
      _tile_loadd(7, bk + 64, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* c0 = c + mt * 16 * kBlockN;
    _tile_stored(0, c0, kBlockN * 4);
    _tile_stored(1, c0 + 16, kBlockN * 4);
    _tile_stored(2, c0 + 16 * kBlockN, kBlockN * 4);
    _tile_stored(3, c0 + 16 * kBlockN + 16, kBlockN * 4);
  }
  if (mt < mtiles) {
    _tile_zero(0);
    _tile_zero(1);
    // A last single row tile: never the first pass (run_amx prefetches only for two or
    // more row tiles), so nothing to prefetch here.
    const at::BFloat16* a0 = a + mt * 16 * lda;
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      const char* bk = reinterpret_cast<const char*>(b) + ks * step_bytes;
      _tile_loadd(4, a0 + ks * kStepK, a_stride);
      _tile_loadd(6, bk, b_stride);
      _tile_loadd(7, bk + 64, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    float* c0 = c + mt * 16 * kBlockN;
    _tile_stored(0, c0, kBlockN * 4);
    _tile_stored(1, c0 + 16, kBlockN * 4);
  }
}

}  // namespace

bool amx_available() {
  static const bool ok = __builtin_cpu_supports("amx-tile") &&
                         __builtin_cpu_supports("amx-bf16") && request_amx();
  return ok;
}

// w [N, K] bf16 -> [ceil(N / 32), kpad / 2, 32, 2] (K pairs interleaved), kpad = K rounded up
// to 32; padding columns and K rows are zeros.
torch::Tensor amx_pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) > 0 &&
                  w.size(1) > 0,
              "w must be a non-empty [N, K] bfloat16");
  const int64_t n = w.size(0), k = w.size(1);
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  const int64_t kpad = (k + kStepK - 1) / kStepK * kStepK;
  auto wp = torch::zeros({blocks * kBlockN, kpad}, w.options());
  wp.narrow(0, 0, n).narrow(1, 0, k).copy_(w);
  // [blocks, 32, kpad/2, 2] -> [blocks, kpad/2, 32, 2]
  return wp.view({blocks, kBlockN, kpad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

namespace {

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be [M, K] bfloat16 on the CPU");
}

torch::Tensor bias_of(const c10::optional<torch::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return {};
  auto bc = bias->to(at::kBFloat16).contiguous();
  TORCH_CHECK(bc.numel() == n, "bias must have ", n, " elements, got ", bc.numel());
  return bc;
}

// x [M, K] times every column block of `packed`; `epilogue(c, m0, rows, nb)` writes the
// outputs of block nb for rows m0 .. m0 + rows from its fp32 sums c ([rows, 32]).
template <typename Epilogue>
void run_amx(const torch::Tensor& x, const torch::Tensor& packed, const Epilogue& epilogue) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kBlockN && packed.size(3) == 2 &&
                  packed.is_contiguous() && packed.size(1) * 2 % kStepK == 0,
              "packed must be amx_pack's output");
  TORCH_CHECK(amx_available(), "this CPU has no AMX bf16 tiles");
  const int64_t m = x.size(0), k = x.size(1), kpad = packed.size(1) * 2;
  TORCH_CHECK(k > 0 && kpad >= k && kpad - k < kStepK, "packed does not match K = ", k);
  if (m == 0) return;
  // Tiles read whole 16-row, 32-column steps: rows and K are zero-padded unless x already
  // is a whole number of them with rows at a stride the tile can load.
  const int64_t mpad = (m + 15) / 16 * 16;
  torch::Tensor xa;
  if (m == mpad && k == kpad && x.stride(1) == 1) {
    xa = x;
  } else {
    xa = torch::zeros({mpad, kpad}, x.options());
    xa.narrow(0, 0, m).narrow(1, 0, k).copy_(x);
  }
  const int64_t lda = xa.stride(0);
  const auto* a = xa.data_ptr<at::BFloat16>();
  const auto* w = packed.data_ptr<at::BFloat16>();
  const char* w_end = reinterpret_cast<const char*>(w + packed.numel());
  const int64_t blocks = packed.size(0);
  const int64_t block_elems = kpad * kBlockN;
  // Equal chunks of whole tile pairs (gemm_chunks.h).
  const RowChunks split = even_row_chunks(mpad, kBlockM, 32);
  const int64_t chunk_rows = split.rows, mchunks = split.count;
  // Work items are (row chunk, column block), each over the whole K. A thread's items are
  // consecutive blocks, which lie one after the other in memory, so prefetching the block
  // after the current one runs ahead along the thread's own stream.
  at::parallel_for(0, mchunks * blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    struct ReleaseOnExit {
      ~ReleaseOnExit() { release_tiles(); }
    } release;
    std::vector<float> c(static_cast<size_t>(std::min(mpad, chunk_rows) * kBlockN));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mc = item / blocks, nb = item % blocks;
      const int64_t m0 = mc * chunk_rows;
      const int64_t mtiles = (std::min(chunk_rows, mpad - m0)) / 16;
      const at::BFloat16* wb = w + nb * block_elems;
      // The next block, where there are tiles to multiply while it arrives: with one row
      // tile the loop is the weight stream alone, and its own loads keep the hardware
      // prefetchers busy (measured: prefetching then ran 1.1x slower at 4 rows).
      const char* pf = reinterpret_cast<const char*>(wb + block_elems);
      block_kernel(a + m0 * lda, lda, mtiles, wb, kpad, c.data(),
                   pf < w_end && mtiles >= 2 ? pf : nullptr, w_end);
      epilogue(c.data(), m0, std::min(chunk_rows, m - m0), nb);
    }
  });
}

}  // namespace

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias) {
  check_x(x);
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(n > (blocks - 1) * kBlockN && n <= blocks * kBlockN, "n does not match packed");
  const auto bc = bias_of(bias, n);
  const at::BFloat16* b_ptr = bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr;
  auto out = torch::empty({x.size(0), n},
                          x.options().memory_format(at::MemoryFormat::Contiguous));
  auto* o = out.data_ptr<at::BFloat16>();
  run_amx(x, packed, [&](const float* c, int64_t m0, int64_t rows, int64_t nb) {
    const int64_t n0 = nb * kBlockN, cols = std::min(kBlockN, n - n0);
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* orow = o + (m0 + r) * n + n0;
      const float* crow = c + r * kBlockN;
      // The bias is added to the fp32 sum, as brgemm_linear and oneDNN add it.
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
  });
  return out;
}

// w [2 * h, K] bf16, a gated MLP's gate rows then its up rows, h a multiple of 16 -> amx_pack
// of its rows reordered so that every 32-column block holds 16 gate columns and the 16 up
// columns of the same outputs (amx_linear_gated's layout).
torch::Tensor amx_pack_gated(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % 2 == 0,
              "w must be [2 * h, K] bfloat16 (gate rows, then up rows)");
  const int64_t h = w.size(0) / 2, k = w.size(1);
  TORCH_CHECK(h % kHalf == 0, "the gated layout needs h (", h, ") to be a multiple of ", kHalf);
  return amx_pack(
      w.contiguous().view({2, h / kHalf, kHalf, k}).transpose(0, 1).reshape({2 * h, k}));
}

// silu(x @ gate.T + bias_gate) * (x @ up.T + bias_up) -> [M, h] on amx_pack_gated's weight:
// the bits of amx_linear, then silu_and_mul (csrc/ops.cpp), on the same weight. Each sum is
// rounded to bf16 first, as amx_linear's output is, and the activation is silu_and_mul's own
// (vec.h silu, rounded to bf16 before the product). The packed tensor does not say which
// packing made it, so the caller (gated.py) keeps the two apart.
torch::Tensor amx_linear_gated(torch::Tensor x, torch::Tensor packed, int64_t h,
                               c10::optional<torch::Tensor> bias) {
  check_x(x);
  TORCH_CHECK(h % kHalf == 0 && packed.size(0) * kHalf == h,
              "h does not match the gated packed weight");
  const auto bc = bias_of(bias, 2 * h);
  const at::BFloat16* b_ptr = bc.defined() ? bc.data_ptr<at::BFloat16>() : nullptr;
  auto out = torch::empty({x.size(0), h},
                          x.options().memory_format(at::MemoryFormat::Contiguous));
  auto* o = out.data_ptr<at::BFloat16>();
  const at::BFloat16* bf16_tag = nullptr;
  run_amx(x, packed, [&](const float* c, int64_t m0, int64_t rows, int64_t nb) {
    const int64_t j0 = nb * kHalf;  // this block's first output
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* orow = o + (m0 + r) * h + j0;
      const float* crow = c + r * kBlockN;
      for (int64_t j = 0; j < kHalf; j += kVec) {
        vfloat g = load(crow + j), u = load(crow + kHalf + j);
        if (b_ptr != nullptr) {
          g += load(b_ptr + j0 + j);
          u += load(b_ptr + h + j0 + j);
        }
        g = round_to(g, bf16_tag);
        u = round_to(u, bf16_tag);
        store(orow + j, round_to(silu(g), bf16_tag) * u);
      }
    }
  });
  return out;
}
