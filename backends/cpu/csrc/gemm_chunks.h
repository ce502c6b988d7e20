// How the GEMM kernels of our own (tiled_linear.cpp, amx_linear.cpp) split a batch's rows into
// chunks. at::parallel_for hands each thread a contiguous run of (chunk, column block) items,
// chunk-major, so chunks of a fixed size and a remainder give the threads unequal work: 136
// rows as 128 + 8 gave one thread 16 times the other's. The chunks are of about equal size
// instead (docs/backends/cpu.md, "Equal row chunks"). A row's bits never depend on the split.
#pragma once

#include <cstdint>

namespace cadence_cpu {

struct RowChunks {
  int64_t rows;   // per chunk (the last one may have fewer)
  int64_t count;  // none empty
};

// As many chunks as chunks of at most `most` rows would need, of about equal size rounded up
// to a multiple of `align` (whole register tiles); the rounding can leave one chunk fewer.
inline RowChunks even_row_chunks(int64_t m, int64_t most, int64_t align) {
  const int64_t want = (m + most - 1) / most;
  const int64_t rows = ((m + want - 1) / want + align - 1) / align * align;
  return {rows, (m + rows - 1) / rows};
}

}  // namespace cadence_cpu
