// A product of a few rows by a weight stored in column tiles: out = x · W (+ bias), for decode
// steps and verifications on the CPU (models/tiled.py says why and how it is used).
//
//   x      [n, K] float32 (any n; steps have 1 to a few dozen rows)
//   tiles  [N / 32, K, 32] float32 or bfloat16: W [K, N] cut into 32-column tiles, each stored
//          whole, so a tile is one contiguous stream of K × 32 values. bfloat16 tiles hold weights
//          that are bfloat16 values exactly (a bfloat16 checkpoint loaded in float32): each is
//          widened to the same float32 in registers, so the sums are those of float32 tiles, bit
//          for bit, for half the bytes
//   bias   [N] float32 or none
//   -> out [n, N]
//
// Each tile's accumulators (up to 8 rows × 32 columns: 16 vector registers of 16 floats) stay in
// registers while the tile streams through once; more rows run in balanced chunks of at most 8,
// the tile then coming from the core's L2. Tiles are shared out among torch's threads.
#include <ATen/Parallel.h>
#include <atomic>
#include <vector>
#include <torch/library.h>
#include <ATen/ATen.h>

#include "vector.h"

namespace {

constexpr int64_t TILE = 32;
constexpr int MAX_ROWS = 8;

// A tile's 32 weights of one k as two float32 vectors (columns 0-15, 16-31): loaded as they are, or
// bfloat16 widened exactly (its bits are the top half of the float32 it stands for) by interleaving
// with zeros within each 128-bit lane (one instruction a vector on AVX-512). models.tiled stores a
// bfloat16 tile's columns in the order that interleave reads them back in (lane_order there).
inline void load32(const float* p, vec16& lo, vec16& hi) {
  lo = *(const vec16*)p;
  hi = *(const vec16*)(p + 16);
}
inline void load32(const uint16_t* p, vec16& lo, vec16& hi) {
  const half32 w = *(const half32*)p, z = {};
  lo = (vec16)SHUFFLE(half32, z, w, 0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43,
                         16, 48, 17, 49, 18, 50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59);
  hi = (vec16)SHUFFLE(half32, z, w, 4, 36, 5, 37, 6, 38, 7, 39, 12, 44, 13, 45, 14, 46, 15, 47,
                         20, 52, 21, 53, 22, 54, 23, 55, 28, 60, 29, 61, 30, 62, 31, 63);
}

template <int R, typename W>
inline void tile_rows(const float* __restrict x, int64_t K, const W* __restrict tile, const float* bias,
                      float* __restrict out, int64_t ldo) {
  vec16 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = bias ? *(const vec16*)bias : vec16{};
    acc[r][1] = bias ? *(const vec16*)(bias + 16) : vec16{};
  }
  for (int64_t k = 0; k < K; ++k) {
    vec16 w0, w1;
    load32(tile + k * TILE, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xr = x[r * K + k];
      acc[r][0] += xr * w0;
      acc[r][1] += xr * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    *(vec16*)(out + r * ldo) = acc[r][0];
    *(vec16*)(out + r * ldo + 16) = acc[r][1];
  }
}

template <typename W>
void chunk(int rows, const float* x, int64_t K, const W* tile, const float* bias, float* out, int64_t ldo) {
  switch (rows) {
    case 8: tile_rows<8>(x, K, tile, bias, out, ldo); break;
    case 7: tile_rows<7>(x, K, tile, bias, out, ldo); break;
    case 6: tile_rows<6>(x, K, tile, bias, out, ldo); break;
    case 5: tile_rows<5>(x, K, tile, bias, out, ldo); break;
    case 4: tile_rows<4>(x, K, tile, bias, out, ldo); break;
    case 3: tile_rows<3>(x, K, tile, bias, out, ldo); break;
    case 2: tile_rows<2>(x, K, tile, bias, out, ldo); break;
    case 1: tile_rows<1>(x, K, tile, bias, out, ldo); break;
    default: break;
  }
}

// The tiles shared out among torch's threads; each tile takes the rows in balanced chunks of ≤ 8.
template <typename W>
void by_tiles(const float* xp, int64_t n, int64_t K, const W* tp, int64_t n_tiles, const float* bp, float* op) {
  const int64_t N = n_tiles * TILE;
  const int64_t chunks = (n + MAX_ROWS - 1) / MAX_ROWS, base = n / chunks, longer = n % chunks;
  at::parallel_for(0, n_tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      int64_t row = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int rows = static_cast<int>(base + (c < longer ? 1 : 0));
        chunk(rows, xp + row * K, K, tp + t * K * TILE, bp ? bp + t * TILE : nullptr, op + row * N + t * TILE, N);
        row += rows;
      }
    }
  });
}

at::Tensor tiled_mm(const at::Tensor& x_in, const at::Tensor& tiles_in, const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && tiles_in.dim() == 3 && tiles_in.size(2) == TILE,
              "tiled_mm: x [n, K] and tiles [N/32, K, 32], got ", x_in.sizes(), " and ", tiles_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "tiled_mm: float32 rows only, got ", x_in.scalar_type());
  TORCH_CHECK(tiles_in.scalar_type() == at::kFloat || tiles_in.scalar_type() == at::kBFloat16,
              "tiled_mm: float32 or bfloat16 tiles, got ", tiles_in.scalar_type());
  TORCH_CHECK(x_in.size(1) == tiles_in.size(1), "tiled_mm: x has ", x_in.size(1), " columns, the tiles ", tiles_in.size(1), " rows");
  const at::Tensor x = x_in.contiguous(), tiles = tiles_in.contiguous();
  const int64_t n = x.size(0), K = x.size(1), n_tiles = tiles.size(0), N = n_tiles * TILE;
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    TORCH_CHECK(bias.numel() == N && bias.scalar_type() == at::kFloat, "tiled_mm: bias of ", N, " float32 values");
  }
  at::Tensor out = at::empty({n, N}, x.options());
  if (n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  if (tiles.scalar_type() == at::kFloat) {
    by_tiles(xp, n, K, tiles.data_ptr<float>(), n_tiles, bp, op);
  } else {
    by_tiles(xp, n, K, reinterpret_cast<const uint16_t*>(tiles.data_ptr<at::BFloat16>()), n_tiles, bp, op);
  }
  return out;
}

// How many of torch's threads at::parallel_for hands `tasks` one-task pieces to: what the build's
// OpenMP gives the kernel above (a build without it runs every piece on the calling thread).
int64_t parallel_threads(int64_t tasks) {
  std::vector<std::atomic<bool>> seen(at::get_num_threads());
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = true; });
  int64_t count = 0;
  for (const auto& s : seen) count += s ? 1 : 0;
  return count;
}

}  // namespace

TORCH_LIBRARY(reelflow_tiled, m) {
  m.def("tiled_mm(Tensor x, Tensor tiles, Tensor? bias) -> Tensor");
  m.def("parallel_threads(int tasks) -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(reelflow_tiled, CPU, m) {
  m.impl("tiled_mm", &tiled_mm);
}
