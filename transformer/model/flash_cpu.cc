// Fused flash attention for XLA:CPU, forward and backward, called through XLA's FFI.
//
// Layout (attention.py's GQA interface): q [B, T, K, G, H], k [B, S, K, H], v [B, S, K, Hv], out
// [B, T, K, G, Hv], log-sum-exp [B, K, G, T]; query head n = k*G + g; float32 throughout. Masks: causal or bidirectional, with an
// optional window (window <= 0: none), as flash.Mask. Each query's allowed keys are one interval.
//
// The products are register-blocked: a tile of MR rows x NV vectors of the result stays in
// registers while the contraction runs, the left operand broadcast one scalar at a time (so it may
// be read with any strides: a block of probabilities serves as A and as A^T without a transpose)
// and the right operand read a vector at a time along contiguous rows.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#else
constexpr int W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(vf));
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(vf)); }
inline vf splat(float x) { return x - vf{}; }  // x - 0 is x exactly: a bare broadcast (x + 0 is not, for -0)

// exp(x) to about 1 ulp (Cephes' expf polynomial); exactly 0 below -87.3, as float32's exp.
inline vf vexp(vf x) {
  const vf lo = splat(-87.3365447505531f);
  vf under = x < lo ? splat(1.0f) : splat(0.0f);
  x = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * splat(1.44269504088896341f) + magic;
  vf n = t - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(vf));
  vf y = p * scale;
  return under > splat(0.0f) ? splat(0.0f) : y;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
}
inline float hsum(vf v) {
  float s = 0;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// C[r, :NV*W] (+)= sum_p A[r*ars + p*acs] * B[p*ldb + :NV*W], r < MR.
template <int MR, int NV>
inline void tile(int64_t P, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
  vf acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load(C + r * ldc + v * W) : splat(0.0f);
  for (int64_t p = 0; p < P; ++p) {
    vf b[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) b[v] = load(B + p * ldb + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      vf a = splat(A[r * ars + p * acs]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] += a * b[v];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) store(C + r * ldc + v * W, acc[r][v]);
}

// Tiles sized to the registers, about 30 vectors of AVX-512's 32 (4 vectors across, 6 rows) and 15
// of AVX2's 16 (or NEON's 32 halves): 2 across, 6 rows. A tile's accumulators, one vector of each
// operand and nothing else: spilled accumulators would halve the speed.
constexpr int NVMAX = W == 16 ? 4 : 2;
constexpr int mr_for(int nv) { return W == 16 ? (nv >= 3 ? 6 : (nv == 2 ? 12 : 14)) : (nv == 2 ? 6 : 12); }

template <int NV>
inline void rows(int64_t M, int64_t P, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
                 float* C, int64_t ldc, bool accumulate) {
  constexpr int MR = mr_for(NV);
  int64_t r = 0;
  for (; r + MR <= M; r += MR) tile<MR, NV>(P, A + r * ars, ars, acs, B, ldb, C + r * ldc, ldc, accumulate);
  const int64_t left = M - r;
  const float* a = A + r * ars;
  float* c = C + r * ldc;
  switch (left) {
#define CASE(m) \
  case m:       \
    if constexpr (m < MR) tile<m, NV>(P, a, ars, acs, B, ldb, c, ldc, accumulate); \
    break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
#undef CASE
    default:
      break;
  }
}

// C [M, N] (+)= A [M, P] B [P, N]; A read as A[m*ars + p*acs]; B's and C's rows contiguous; N % W == 0.
void gemm(int64_t M, int64_t N, int64_t P, const float* A, int64_t ars, int64_t acs, const float* B, int64_t ldb,
          float* C, int64_t ldc, bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (P <= 0) {
    if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, N * sizeof(float));
    return;
  }
  int64_t n = 0;
  for (; n + NVMAX * W <= N; n += NVMAX * W) rows<NVMAX>(M, P, A, ars, acs, B + n, ldb, C + n, ldc, accumulate);
  switch ((N - n) / W) {
    case 3: rows<3>(M, P, A, ars, acs, B + n, ldb, C + n, ldc, accumulate); break;
    case 2: rows<2>(M, P, A, ars, acs, B + n, ldb, C + n, ldc, accumulate); break;
    case 1: rows<1>(M, P, A, ars, acs, B + n, ldb, C + n, ldc, accumulate); break;
    default: break;
  }
}

// Runs f(i) for i < n on the caller and XLA's intra-op threads. The caller takes items too, and
// waits only for items taken, so it never waits on a thread the pool has not started.
template <class F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, const F& f) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto run = [state, n, &f]() {
    int64_t i;
    while ((i = state->next.fetch_add(1)) < n) {
      f(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(run)(run));
  run();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

struct Shape {
  int64_t B, T, S, K, G, H, Hv;  // Hv: the values' width (MLA's may differ from H)
  float scale;
  bool causal;
  int64_t window;
  // keys [lo, hi) query t may see
  inline void keys(int64_t t, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = S;
    if (window > 0) {
      lo = std::max<int64_t>(0, t - window + 1);
      if (!causal) hi = std::min<int64_t>(S, t + window);
    }
    if (causal) hi = std::min<int64_t>(S, t + 1);
  }
};

constexpr int64_t BQ = 64;   // query rows of a block
constexpr int64_t BK = 128;  // keys of a block

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The most floats a thread keeps between calls (64 MiB; long sequences' buffers are freed after use).
constexpr size_t RETAINED = size_t(16) << 20;

// A row length of at least n, a multiple of the vector width, and not a multiple of 1 KiB: rows a
// power of two apart share the L1 cache's few sets, and the products read down such rows.
inline int64_t padded(int64_t n) {
  int64_t ld = round_up(n, W);
  return ld % 256 == 0 ? ld + W : ld;
}

// n rows of width h, `row_stride` apart, into one contiguous piece.
void pack_rows(const float* x, int64_t row_stride, int64_t n, int64_t h, float* out) {
  for (int64_t j = 0; j < n; ++j) std::memcpy(out + j * h, x + j * row_stride, h * sizeof(float));
}

// Keys k0..k0+nk-1 of one kv head transposed into kt [H, ld] (zeros past nk).
void pack_transposed(const float* k, int64_t row_stride, int64_t nk, int64_t H, float* kt, int64_t ld) {
  for (int64_t h = 0; h < H; ++h) std::memset(kt + h * ld + nk, 0, (ld - nk) * sizeof(float));
  for (int64_t j = 0; j < nk; ++j) {
    const float* row = k + j * row_stride;
    for (int64_t h = 0; h < H; ++h) kt[h * ld + j] = row[h];
  }
}

void forward(ffi::ThreadPool& pool, const Shape& s, const float* q, const float* k, const float* v, float* out,
             float* lse) {
  const int64_t B = s.B, T = s.T, S = s.S, K = s.K, G = s.G, H = s.H, Hv = s.Hv;
  const int64_t nqb = (T + BQ - 1) / BQ;
  const int64_t qrow = K * G * H, krow = K * H, orow = K * G * Hv, vrow = K * Hv;
  // every kv head's keys transposed, [B, K, H, Sp], and values, [B, K, S, Hv], each in one piece:
  // once rather than once per query block, and read along rows not a power of two apart
  const int64_t Sp = padded(S);
  // the calling thread's, kept for its next call (a fresh allocation each call faults its pages in);
  // the items reach it through these pointers, never by name (each thread has its own `packed`)
  thread_local std::vector<float> packed;
  packed.resize(B * K * (H * Sp + S * Hv));
  float* keys_t = packed.data();
  float* values = keys_t + B * K * H * Sp;
  parallel_for(pool, B * K, [&](int64_t item) {
    const int64_t off = (item / K * S * K + item % K);
    pack_transposed(k + off * H, krow, S, H, keys_t + item * H * Sp, Sp);
    pack_rows(v + off * Hv, vrow, S, Hv, values + item * S * Hv);
  });
  // items: (b, kh, g, query block), the later (costlier under a causal mask) blocks first
  parallel_for(pool, B * K * G * nqb, [&](int64_t item) {
    const int64_t qb = nqb - 1 - item % nqb;
    const int64_t g = item / nqb % G, kh = item / nqb / G % K, b = item / nqb / G / K;
    const int64_t q0 = qb * BQ, q1 = std::min(T, q0 + BQ), nq = q1 - q0;
    thread_local std::vector<float> buf;
    buf.resize(BQ * H + BQ * BK + BQ * Hv + 2 * BQ);
    float* qs = buf.data();     // [nq, H], scaled
    float* sp = qs + BQ * H;    // [nq, BK]: logits, then probabilities
    float* acc = sp + BQ * BK;  // [nq, Hv]
    float* m = acc + BQ * Hv;   // running max
    float* l = m + BQ;          // running sum
    const float* qb_ptr = q + ((b * T + q0) * K + kh) * G * H + g * H;
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t h = 0; h < H; ++h) qs[i * H + h] = qb_ptr[i * qrow + h] * s.scale;
    std::fill(acc, acc + nq * Hv, 0.0f);
    std::fill(m, m + nq, -INFINITY);
    std::fill(l, l + nq, 0.0f);
    int64_t lo, hi, lo1, hi1;
    s.keys(q0, lo, hi1);
    s.keys(q1 - 1, lo1, hi);
    lo = lo / W * W;  // blocks start on a vector, so that a block's padded columns stay within Sp
    const float* kt = keys_t + (b * K + kh) * H * Sp;
    const float* vs = values + (b * K + kh) * S * Hv;
    for (int64_t k0 = lo; k0 < hi; k0 += BK) {
      const int64_t nk = std::min(BK, hi - k0), ld = round_up(nk, W);
      gemm(nq, ld, H, qs, H, 1, kt + k0, Sp, sp, ld, false);
      for (int64_t i = 0; i < nq; ++i) {
        int64_t a, e;
        s.keys(q0 + i, a, e);
        a = std::clamp<int64_t>(a - k0, 0, nk);
        e = std::clamp<int64_t>(e - k0, 0, nk);
        float* row = sp + i * ld;
        if (a >= e) {
          std::fill(row, row + ld, 0.0f);
          continue;
        }
        for (int64_t j = 0; j < a; ++j) row[j] = -INFINITY;
        for (int64_t j = e; j < ld; ++j) row[j] = -INFINITY;
        vf mx = splat(-INFINITY);
        for (int64_t j = 0; j < ld; j += W) {
          vf x = load(row + j);
          mx = x > mx ? x : mx;
        }
        const float mnew = std::max(m[i], hmax(mx));
        const float corr = std::exp(m[i] - mnew);
        vf sum = splat(0.0f);
        const vf mv = splat(mnew);
        for (int64_t j = 0; j < ld; j += W) {
          vf p = vexp(load(row + j) - mv);
          store(row + j, p);
          sum += p;
        }
        l[i] = l[i] * corr + hsum(sum);
        m[i] = mnew;
        if (corr != 1.0f)
          for (int64_t h = 0; h < Hv; ++h) acc[i * Hv + h] *= corr;
      }
      gemm(nq, Hv, nk, sp, ld, 1, vs + k0 * Hv, Hv, acc, Hv, true);
    }
    float* ob = out + ((b * T + q0) * K + kh) * G * Hv + g * Hv;
    float* lb = lse + ((b * K + kh) * G + g) * T + q0;
    for (int64_t i = 0; i < nq; ++i) {
      const float inv = 1.0f / l[i];
      for (int64_t h = 0; h < Hv; ++h) ob[i * orow + h] = acc[i * Hv + h] * inv;
      lb[i] = m[i] + std::log(l[i]);
    }
  });
  if (packed.capacity() > RETAINED) std::vector<float>().swap(packed);
}

void backward(ffi::ThreadPool& pool, const Shape& s, const float* q, const float* k, const float* v,
              const float* out, const float* lse, const float* dout, float* dq, float* dk, float* dv) {
  const int64_t B = s.B, T = s.T, S = s.S, K = s.K, G = s.G, H = s.H, Hv = s.Hv;
  const int64_t qrow = K * G * H, krow = K * H, orow = K * G * Hv, vrow = K * Hv;
  const int64_t Sp = padded(S);
  // items: (b, kh), or (b, kh, g) where too few (b, kh) would leave threads idle (B1 with MQA: one
  // item). Each query head's key and value gradients are computed from zero and summed over g in
  // order, ((g0 + g1) + g2) ..., by the item itself or, split, afterwards from `partial`: the same
  // sums whichever the items and threads.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const bool split = G > 1 && (B * K) % threads != 0 && B * K < 4 * threads;
  const int64_t per_item = split ? 1 : G;
  thread_local std::vector<float> partial;  // the calling thread's: the items reach it through `parts`
  partial.resize(split ? B * K * G * S * (H + Hv) : 0);
  float* parts = partial.data();
  parallel_for(pool, B * K * G / per_item, [&](int64_t item) {
    const int64_t g0 = item * per_item % G, kh = item * per_item / G % K, b = item * per_item / G / K;
    // every operand in one piece, its rows adjacent (in the inputs they are K*G*H apart, a power of
    // two that maps the rows a product reads onto the same few cache sets)
    thread_local std::vector<float> buf;
    buf.resize((H + Hv) * Sp + (3 * H + 2 * Hv) * S + (2 * H + Hv + 1) * T + 2 * BQ * BK);
    float* kt = buf.data();       // [H, Sp] keys transposed
    float* vt = kt + H * Sp;      // [Hv, Sp] values transposed
    float* kr = vt + Hv * Sp;     // [S, H] keys
    float* dkr = kr + S * H;      // [S, H]
    float* dvr = dkr + S * H;     // [S, Hv]
    float* sum = dvr + S * Hv;    // [S, H + Hv]: dkr and dvr summed over this item's query heads
    float* qr = sum + S * (H + Hv);  // [T, H] one query head's queries, scaled as in the forward pass
    float* dqr = qr + T * H;      // [T, H], unscaled
    float* dor = dqr + T * H;     // [T, Hv]
    float* delta = dor + T * Hv;  // [T]
    float* p = delta + T;         // [nq, BK] probabilities
    float* ds = p + BQ * BK;      // [nq, BK] dP, then the logits' gradient (unscaled)
    const float* kbase = k + (b * S * K + kh) * H;
    const float* vbase = v + (b * S * K + kh) * Hv;
    pack_transposed(kbase, krow, S, H, kt, Sp);
    pack_transposed(vbase, vrow, S, Hv, vt, Sp);
    pack_rows(kbase, krow, S, H, kr);
    for (int64_t g = g0; g < g0 + per_item; ++g) {
      std::fill(dkr, dkr + S * (H + Hv), 0.0f);
      const int64_t hoff = (b * T * K + kh) * G * H + g * H, voff = (b * T * K + kh) * G * Hv + g * Hv;
      const float* lg = lse + ((b * K + kh) * G + g) * T;
      pack_rows(dout + voff, orow, T, Hv, dor);
      for (int64_t t = 0; t < T; ++t) {
        const float* qt = q + hoff + t * qrow;
        for (int64_t h = 0; h < H; ++h) qr[t * H + h] = qt[h] * s.scale;
        const float* ot = out + voff + t * orow;
        float d = 0;
        for (int64_t h = 0; h < Hv; ++h) d += dor[t * Hv + h] * ot[h];
        delta[t] = d;
      }
      std::fill(dqr, dqr + T * H, 0.0f);
      for (int64_t k0 = 0; k0 < S; k0 += BK) {
        const int64_t nk = std::min(BK, S - k0), ld = round_up(nk, W);
        // the queries that may see keys k0..k0+nk-1
        int64_t t0 = 0, t1 = T;
        if (s.causal) t0 = std::min(T, k0);
        if (s.window > 0) {
          t1 = std::min(T, k0 + nk + s.window - 1);
          if (!s.causal) t0 = std::max<int64_t>(0, k0 - s.window + 1);
        }
        for (int64_t a0 = t0; a0 < t1; a0 += BQ) {
          const int64_t nq = std::min(BQ, t1 - a0);
          gemm(nq, ld, H, qr + a0 * H, H, 1, kt + k0, Sp, p, ld, false);     // logits
          gemm(nq, ld, Hv, dor + a0 * Hv, Hv, 1, vt + k0, Sp, ds, ld, false);  // dP
          for (int64_t i = 0; i < nq; ++i) {
            int64_t a, e;
            s.keys(a0 + i, a, e);
            a = std::clamp<int64_t>(a - k0, 0, nk);
            e = std::clamp<int64_t>(e - k0, 0, nk);
            float* pr = p + i * ld;
            float* dr = ds + i * ld;
            const vf lv = splat(lg[a0 + i]);
            const vf dl = splat(delta[a0 + i]);
            for (int64_t j = 0; j < ld; j += W) {
              vf pp = vexp(load(pr + j) - lv);
              store(pr + j, pp);
              store(dr + j, pp * (load(dr + j) - dl));
            }
            for (int64_t j = 0; j < a; ++j) pr[j] = dr[j] = 0.0f;
            for (int64_t j = e; j < ld; ++j) pr[j] = dr[j] = 0.0f;
          }
          gemm(nk, Hv, nq, p, 1, ld, dor + a0 * Hv, Hv, dvr + k0 * Hv, Hv, true);  // dV += P^T dO
          gemm(nk, H, nq, ds, 1, ld, qr + a0 * H, H, dkr + k0 * H, H, true);      // dK += dS^T (scale Q)
          gemm(nq, H, nk, ds, ld, 1, kr + k0 * H, H, dqr + a0 * H, H, true);      // dQ += dS K (x scale below)
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        float* dqt = dq + hoff + t * qrow;
        for (int64_t h = 0; h < H; ++h) dqt[h] = dqr[t * H + h] * s.scale;
      }
      if (split) {
        std::memcpy(parts + item * S * (H + Hv), dkr, S * (H + Hv) * sizeof(float));
      } else if (g == 0) {
        std::memcpy(sum, dkr, S * (H + Hv) * sizeof(float));
      } else {
        for (int64_t i = 0; i < S * (H + Hv); ++i) sum[i] += dkr[i];
      }
    }
    if (!split) {
      for (int64_t j = 0; j < S; ++j) {
        std::memcpy(dk + (b * S * K + kh) * H + j * krow, sum + j * H, H * sizeof(float));
        std::memcpy(dv + (b * S * K + kh) * Hv + j * vrow, sum + S * H + j * Hv, Hv * sizeof(float));
      }
    }
    if (buf.capacity() > RETAINED) std::vector<float>().swap(buf);
  });
  if (split) {
    parallel_for(pool, B * K, [&](int64_t bk) {
      const float* mine = parts + bk * G * S * (H + Hv);  // G of [S, H] then [S, Hv]
      float* dkb = dk + (bk / K * S * K + bk % K) * H;
      float* dvb = dv + (bk / K * S * K + bk % K) * Hv;
      for (int64_t j = 0; j < S; ++j) {
        float* dkj = dkb + j * krow;
        float* dvj = dvb + j * vrow;
        std::memcpy(dkj, mine + j * H, H * sizeof(float));
        std::memcpy(dvj, mine + S * H + j * Hv, Hv * sizeof(float));
        for (int64_t g = 1; g < G; ++g) {
          const float* pg = mine + g * S * (H + Hv);
          for (int64_t h = 0; h < H; ++h) dkj[h] += pg[j * H + h];
          for (int64_t h = 0; h < Hv; ++h) dvj[h] += pg[S * H + j * Hv + h];
        }
      }
    });
  }
  if (partial.capacity() > RETAINED) std::vector<float>().swap(partial);
}

Shape shape_of(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v, float scale, bool causal,
               int64_t window) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  return Shape{qd[0], qd[1], kd[1], qd[2], qd[3], qd[4], v.dimensions()[3], scale, causal, window};
}

ffi::Error check(const Shape& s) {
  if (s.H % W != 0 || s.Hv % W != 0)
    return ffi::Error::InvalidArgument("flash_cpu: head widths must be multiples of the vector width");
  return ffi::Error::Success();
}

ffi::Error FwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, float scale, bool causal,
                   int64_t window) {
  Shape s = shape_of(q, k, v, scale, causal, window);
  if (auto e = check(s); e.failure()) return e;
  forward(pool, s, q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(), lse->typed_data());
  return ffi::Error::Success();
}

ffi::Error BwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                   ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                   float scale, bool causal, int64_t window) {
  Shape s = shape_of(q, k, v, scale, causal, window);
  if (auto e = check(s); e.failure()) return e;
  backward(pool, s, q.typed_data(), k.typed_data(), v.typed_data(), out.typed_data(), lse.typed_data(),
           dout.typed_data(), dq->typed_data(), dk->typed_data(), dv->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashForward, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashBackward, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window"));

// The vector width the kernel was built with: head widths must be multiples of it.
extern "C" int FlashVectorWidth() { return W; }
