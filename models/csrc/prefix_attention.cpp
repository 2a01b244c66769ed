// Attention of a few query rows over a cached prefix, with the softmax's log-sum-exp, for decode
// steps and verifications on the CPU (models/cpu_attention.py says how it is used).
//
//   q       [KV, R, hd] float32: the query rows grouped by the KV head they read
//   keys    [KV, L, hd] float32, each row contiguous (a view of a cache buffer with spare room is fine)
//   values  [KV, L, hd] float32, the same
//   -> out  [KV, R, hd] float32: softmax(q · keysᵀ · scaling) · values
//      lse  [KV, R] float32: the log-sum-exp of the scaled scores (-inf when L is 0)
//
// Why a kernel: as two matrix products (scores, then probabilities × values) a one-token step's
// attention ran at about a quarter of the rate the cache's bytes stream at from the core's caches,
// and the products of a dozen rows at half the core's arithmetic rate, plus a softmax pass between.
// Here each split of the prefix (SPLIT keys) streams through once per 4 query rows (from the core's
// L2 after the first): 16 keys at a time are scored for those rows (their dot products reduced to
// one vector of 16 scores by a shuffle tree), folded into running maxima and sums (online softmax)
// and their values added in with the weights; the splits run side by side on torch's threads and
// are merged by their maxima and sums. Split boundaries do not depend on the thread count, so the
// result is the same, bit for bit, at any count. More than MAX_STREAMED_ROWS rows go to MKL's
// products instead (whose sums may change with the thread count).
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

// ATen's vectorised exp (Sleef's, 1 ulp) for the instruction set this build targets, as inductor's
// generated kernels take it (its AVX-512 code needs the F, BW, DQ and VL subsets, as inductor asks)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/cpu/vec/vec.h>

#include "vector.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int BLOCK = 16;          // keys scored at a time: one vector of scores a row
constexpr int ROWS = 4;            // query rows a pass over a split keeps sums for
constexpr int64_t SPLIT = 256;     // keys a task takes: fixed, so results do not depend on the thread count
// Above this many rows the core's arithmetic bounds the attention and MKL's blocked products do it
// about as fast as the streaming pass here (whose dot products cost a shuffle tree a row and 16
// keys): in an AMD EPYC core's compiled toy step, 22 rows took 0-6 % less by this kernel, 32 rows
// 7 % more, 62 rows 4-15 % more
constexpr int64_t MAX_STREAMED_ROWS = 24;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vec16 exp16(vec16 x) {
  alignas(64) float lanes[16];
  *(vec16*)lanes = x;
  for (int i = 0; i < 16; i += Vec::size()) Vec::loadu(lanes + i).exp().store(lanes + i);
  return *(vec16*)lanes;
}

inline float max16(vec16 v) {
  vec16 s = SHUFFLE(index16, v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v > s ? v : s;
  s = SHUFFLE(index16, v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v > s ? v : s;
  s = SHUFFLE(index16, v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v > s ? v : s;
  return std::max(v[0], v[1]);
}

inline float sum16(vec16 v) {
  v += SHUFFLE(index16, v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += SHUFFLE(index16, v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += SHUFFLE(index16, v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return v[0] + v[1];
}

// 16 vectors of partial dot products (a[i]: 16 lanes summing to key i's score) -> one vector whose
// lane i is key i's score: four levels, each halving the vectors by adding two shuffles of a pair
inline vec16 reduce16(const vec16* a) {
  vec16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)            // lanes 0-7: key 2i's 8 partial sums, 8-15: key 2i+1's
    b[i] = SHUFFLE(index16, a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(index16, a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)            // four lanes a key, keys 4i..4i+3
    c[i] = SHUFFLE(index16, b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUFFLE(index16, b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)            // two lanes a key, keys 8i..8i+7
    d[i] = SHUFFLE(index16, c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUFFLE(index16, c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUFFLE(index16, d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(index16, d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// 16 lanes whose sum is q · k, for C × 16 dimensions (q held in registers)
template <int C>
inline vec16 dot(const vec16* q, const float* k) {
  vec16 s = q[0] * *(const vec16*)k;
#pragma GCC unroll 8
  for (int c = 1; c < C; ++c) s += q[c] * *(const vec16*)(k + 16 * c);
  return s;
}

// One split of one KV head for R query rows of C × 16 dimensions: keys [n, C·16] (row stride
// `ld`), the rows' running maximum `top`, sum `total` and unnormalised output `acc` [R, C·16]
// (from -inf, 0, 0), updated in place.
template <int C, int R>
void split_rows(const float* __restrict q, int64_t ldq, const float* __restrict keys, const float* __restrict values,
                int64_t ld, int64_t n, float scaling, float* top, float* total, float* __restrict acc) {
  vec16 out[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = vec16{};
  alignas(64) float weights[R][BLOCK];
  for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {
    const int nk = static_cast<int>(std::min<int64_t>(BLOCK, n - j0));
    const float* block = keys + j0 * ld;
    for (int r = 0; r < R; ++r) {
      vec16 qr[C];
      for (int c = 0; c < C; ++c) qr[c] = *(const vec16*)(q + r * ldq + 16 * c);
      vec16 part[BLOCK];
      if (nk == BLOCK) {
#pragma GCC unroll 16
        for (int i = 0; i < BLOCK; ++i) part[i] = dot<C>(qr, block + i * ld);
      } else {
        for (int i = 0; i < BLOCK; ++i) part[i] = i < nk ? dot<C>(qr, block + i * ld) : vec16{};
      }
      vec16 scores = reduce16(part) * scaling;
      for (int i = nk; i < BLOCK; ++i) scores[i] = NEG_INF;
      const float new_top = std::max(top[r], max16(scores));
      const float keep = std::exp(top[r] - new_top);          // 0 on the first block (top -inf)
      const vec16 p = exp16(scores - new_top);                  // 0 for the -inf lanes
      total[r] = total[r] * keep + sum16(p);
      top[r] = new_top;
      for (int c = 0; c < C; ++c) out[r][c] *= keep;
      *(vec16*)weights[r] = p;
    }
    for (int i = 0; i < nk; ++i) {
      const float* v = values + (j0 + i) * ld;
      vec16 vc[C];
      for (int c = 0; c < C; ++c) vc[c] = *(const vec16*)(v + 16 * c);
      for (int r = 0; r < R; ++r) {
        const float w = weights[r][i];
        for (int c = 0; c < C; ++c) out[r][c] += w * vc[c];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) *(vec16*)(acc + r * C * 16 + 16 * c) = out[r][c];
}

template <int C>
void split_all_rows(const float* q, int64_t rows, const float* keys, const float* values, int64_t ld, int64_t n,
                    float scaling, float* top, float* total, float* acc) {
  const int64_t hd = C * 16;
  for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
    const float* qr = q + r0 * hd;
    float* a = acc + r0 * hd;
    switch (std::min<int64_t>(ROWS, rows - r0)) {
      case 4: split_rows<C, 4>(qr, hd, keys, values, ld, n, scaling, top + r0, total + r0, a); break;
      case 3: split_rows<C, 3>(qr, hd, keys, values, ld, n, scaling, top + r0, total + r0, a); break;
      case 2: split_rows<C, 2>(qr, hd, keys, values, ld, n, scaling, top + r0, total + r0, a); break;
      default: split_rows<C, 1>(qr, hd, keys, values, ld, n, scaling, top + r0, total + r0, a); break;
    }
  }
}

void split(int64_t chunks, const float* q, int64_t rows, const float* keys, const float* values, int64_t ld,
           int64_t n, float scaling, float* top, float* total, float* acc) {
  switch (chunks) {
    case 1: split_all_rows<1>(q, rows, keys, values, ld, n, scaling, top, total, acc); break;
    case 2: split_all_rows<2>(q, rows, keys, values, ld, n, scaling, top, total, acc); break;
    case 4: split_all_rows<4>(q, rows, keys, values, ld, n, scaling, top, total, acc); break;
    case 8: split_all_rows<8>(q, rows, keys, values, ld, n, scaling, top, total, acc); break;
    default: TORCH_CHECK(false, "prefix_attention: head size ", chunks * 16, " (16, 32, 64 or 128)");
  }
}

// Each row of scores [rows, L] (contiguous) replaced by its exponentials less its maximum; the row's
// log-sum-exp in lse [rows] and its sum of exponentials in total [rows]
void exponentials(float* scores, int64_t rows, int64_t L, float* lse, float* total) {
  at::parallel_for(0, rows, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      float* s = scores + r * L;
      const int64_t full = L - L % 16;
      float top = NEG_INF;
      vec16 tops;
      for (int i = 0; i < 16; ++i) tops[i] = NEG_INF;
      for (int64_t j = 0; j < full; j += 16) {
        const vec16 v = *(const vec16*)(s + j);
        tops = v > tops ? v : tops;
      }
      top = max16(tops);
      for (int64_t j = full; j < L; ++j) top = std::max(top, s[j]);
      vec16 sums{};
      for (int64_t j = 0; j < full; j += 16) {
        const vec16 p = exp16(*(const vec16*)(s + j) - top);
        *(vec16*)(s + j) = p;
        sums += p;
      }
      float sum = sum16(sums);
      for (int64_t j = full; j < L; ++j) sum += (s[j] = std::exp(s[j] - top));
      total[r] = sum;
      lse[r] = top + std::log(sum);
    }
  });
}

// Many rows: ATen's matrix products (MKL), which reach the core's arithmetic rate there, with one
// vectorised pass between them; the scores [KV, R, L] are stored (the rows are few beside the prefix)
std::tuple<at::Tensor, at::Tensor> by_products(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                               double scaling) {
  const int64_t heads = q.size(0), rows = q.size(1), length = keys.size(1);
  at::Tensor p = at::matmul(q, keys.transpose(1, 2)).mul_(scaling).contiguous();       // [KV, R, L]
  at::Tensor lse = at::empty({heads, rows}, q.options()), total = at::empty({heads, rows, 1}, q.options());
  exponentials(p.data_ptr<float>(), heads * rows, length, lse.data_ptr<float>(), total.data_ptr<float>());
  return {at::matmul(p, values).div_(total), lse};
}

std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q_in, const at::Tensor& keys_in,
                                                    const at::Tensor& values_in, double scaling) {
  TORCH_CHECK(q_in.dim() == 3 && keys_in.dim() == 3 && values_in.dim() == 3,
              "prefix_attention: q [KV, R, hd], keys and values [KV, L, hd]; got ", q_in.sizes(), ", ",
              keys_in.sizes(), ", ", values_in.sizes());
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && keys_in.scalar_type() == at::kFloat &&
                  values_in.scalar_type() == at::kFloat,
              "prefix_attention: float32 only");
  TORCH_CHECK(keys_in.sizes() == values_in.sizes() && q_in.size(0) == keys_in.size(0) &&
                  q_in.size(2) == keys_in.size(2),
              "prefix_attention: shapes disagree: ", q_in.sizes(), ", ", keys_in.sizes(), ", ", values_in.sizes());
  const int64_t heads = q_in.size(0), rows = q_in.size(1), hd = q_in.size(2), length = keys_in.size(1);
  TORCH_CHECK(hd == 16 || hd == 32 || hd == 64 || hd == 128, "prefix_attention: head size ", hd,
              " (16, 32, 64 or 128)");
  const at::Tensor q = q_in.contiguous();
  // rows of a cache buffer's view are contiguous with the buffer's capacity between heads: kept as they are
  auto rows_contiguous = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const at::Tensor keys = rows_contiguous(keys_in), values = rows_contiguous(values_in);
  if (length > 0 && rows > MAX_STREAMED_ROWS) return by_products(q, keys, values, scaling);
  at::Tensor out = at::zeros({heads, rows, hd}, q.options());
  at::Tensor lse = at::full({heads, rows}, NEG_INF, q.options());
  if (length == 0 || rows == 0) return {out, lse};

  const int64_t splits = (length + SPLIT - 1) / SPLIT;
  // each task's running maxima and sums [heads, splits, rows] and unnormalised outputs [.., hd]
  at::Tensor tops = at::full({heads, splits, rows}, NEG_INF, q.options());
  at::Tensor totals = at::zeros({heads, splits, rows}, q.options());
  at::Tensor accs = at::empty({heads, splits, rows, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  float *tp = tops.data_ptr<float>(), *sp = totals.data_ptr<float>(), *ap = accs.data_ptr<float>();
  const int64_t khs = keys.stride(0), vhs = values.stride(0);
  at::parallel_for(0, heads * splits, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t h = task / splits, s = task % splits, first = s * SPLIT;
      const int64_t n = std::min(SPLIT, length - first);
      // keys and values share the row stride hd (rows_contiguous); heads may sit apart by capacity
      split(hd / 16, qp + h * rows * hd, rows, kp + h * khs + first * hd, vp + h * vhs + first * hd, hd, n,
            static_cast<float>(scaling), tp + task * rows, sp + task * rows, ap + task * rows * hd);
    }
  });
  // merge the splits: weights exp(top_s - top), outputs and sums added, then normalised
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      float top = NEG_INF;
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, tp[(h * splits + s) * rows + r]);
      float total = 0.0f;
      float* o = op + (h * rows + r) * hd;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t at = (h * splits + s) * rows + r;
        const float w = std::exp(tp[at] - top);
        total += w * sp[at];
        const float* a = ap + at * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] += w * a[d];
      }
      for (int64_t d = 0; d < hd; ++d) o[d] /= total;
      lp[h * rows + r] = top + std::log(total);
    }
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(reelflow_cpu, m) {
  m.def("prefix_attention(Tensor q, Tensor keys, Tensor values, float scaling) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(reelflow_cpu, CPU, m) {
  m.impl("prefix_attention", &prefix_attention);
}
