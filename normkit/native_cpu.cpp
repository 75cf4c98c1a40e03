// CPU LayerNorm and GroupNorm of 16-bit inputs with gradients, one C++ operator each way
// (normkit/cpu.py): the native extension "cpu", built by `normkit native` (normkit/native.py).
//
// Why: torch's own 16-bit CPU LayerNorm saves 16-bit statistics and sums dweight / dbias in 16 bit
// (dx 49 ulps off on rows of 8 around 300; bf16 dweight 12.6% off at 8192 x 1024), so normkit runs
// it on fp32 copies: five ATen operators each way where torch runs one, 1.4-1.7x torch's time per
// call on small inputs (docs/performance.md, T98 / T100). Here a call is one operator each way: fp32
// statistics (mean, then the variance around it: exact for large means), y rounded once; dx from
// the fp32 statistics, dweight / dbias summed in fp32 over fixed blocks of rows, added in block
// order (the same bits for any thread count). With create_graph the backward is the fp32 composite
// (x, weight, bias to fp32, torch's layer_norm), which autograd differentiates again.
//
// GroupNorm alike (torch's 16-bit CPU backward: dx of groups of 2 values 200-650 ulps off; its
// mixed-dtype kernels with fp32 parameters, normkit's route without this extension, cost 1.2-1.6x
// torch's 16-bit op): a "row" is one (sample, group), D channels of S values each, contiguous; its
// statistics over D * S values in fp32 (chunks of 16 fp32 lanes, the chunks added in double);
// dweight / dbias per channel summed in fp32 over fixed blocks of rows, added in block order.
//
// Rows are split over threads (at::parallel_for, OpenMP on Linux); each row function is compiled for
// AVX2 and for the baseline, chosen at run time (GCC / Clang target_clones, x86-64 Linux), with 16
// independent fp32 partial sums a pass so that the compiler vectorizes them without reassociating;
// fp16 rows go through fp32 with the CPU's F16C conversions where it has them (f16c_on).

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Size.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/Parallel.h>

#include <c10/util/accumulate.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))  // (ifunc: ELF only)
#define NK_CLONES __attribute__((target_clones("avx2", "default")))
#define NK_F16C __attribute__((target("avx2,f16c")))
#include <immintrin.h>
#else
#define NK_CLONES
#endif

// A loop over the 16 lanes: GCC 12 unrolls such a small loop before vectorizing it, and then often
// fails to vectorize the unrolled body (the GroupNorm backward's per-channel sums, fp16 sums: scalar,
// 2.3 ns a value); kept a loop, it is one vector operation a lane group (each lane's sum the same).
#define NK_LANES _Pragma("GCC unroll 1")

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;

constexpr int kLanes = 16;

// 16-bit values as raw bits, converted in branch-free code the compiler vectorizes.
struct BF16 {
  using Raw = uint16_t;
  static float load(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t store(float f) {  // round to nearest even; a NaN stays a (quiet) NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) : rounded) >> 16);
  }
};

// c10's branch-free fp16 conversions (c10::detail::fp16_ieee_to_fp32_value / _from_fp32_value, without
// F16C) with masks for their selects, which GCC leaves branches (floating-point operations are not
// speculated under -ftrapping-math): vectorized, 5x faster; bit for bit c10's (every fp16 value and
// every fp32 bit pattern checked).
struct F16 {
  using Raw = uint16_t;
  static float bits_to_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint32_t float_to_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
  }
  static float load(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t small = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // all ones: denormal or zero
    return bits_to_float(sign | (float_to_bits(denormalized) & small) | (float_to_bits(normalized) & ~small));
  }
  static uint16_t store(float f) {  // round to nearest even; a NaN becomes 0x7e00 (with its sign)
    const uint32_t w = float_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
    const float base = bits_to_float((bias >> 1) + 0x07800000u) + (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t bits = float_to_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
    return static_cast<uint16_t>((sign >> 16) | (0x7E00u & nan) | (nonsign & ~nan));
  }
};

// fp32 values as they are: the row functions on fp32 rows, converted from and to fp16 by the CPU's
// F16C instructions where it has them (f16c_on: the fp16 rows, below).
struct F32 {
  using Raw = float;
  static float load(float f) { return f; }
  static float store(float f) { return f; }
};

// fp16 rows through the CPU's F16C instructions: a row converted to fp32 8 values at a time
// (vcvtph2ps), the row functions run on fp32 (F32), the results converted back rounding to nearest
// even (vcvtps2ph): the bits of F16's conversions (both exact, both round to nearest even; a NaN keeps
// its sign, its payload may differ), in one instruction where F16's take ~10-15 vector operations
// (fp16 LayerNorm forward + backward 16x4096: 1.48 -> 1.08x torch's fp16 op; T107). On where the CPU
// has AVX2 and F16C; f16c(False), a test hook, runs F16's conversions (a CPU without them) instead.
#ifdef NK_F16C
NK_F16C void f16c_to_fp32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = F16::load(src[i]);
}

NK_F16C void f16c_from_fp32(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = F16::store(src[i]);
}

bool f16c_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#else
void f16c_to_fp32(const uint16_t*, float*, int64_t) {}
void f16c_from_fp32(const float*, uint16_t*, int64_t) {}
bool f16c_supported() { return false; }
#endif

std::atomic<int> g_f16c{-1};  // -1: not yet asked, then 0 / 1

bool f16c_on() {
  int on = g_f16c.load(std::memory_order_relaxed);
  if (on < 0) {
    on = f16c_supported() ? 1 : 0;
    g_f16c.store(on, std::memory_order_relaxed);
  }
  return on == 1;
}

// Rows [lo, hi) of len fp16 values through fp32 (F16C): row r of a (and of b, where given) converted
// into fp32 buffers, run(r, a, b, out) on them, and out's buffer converted back into out's row (out
// nullptr: no buffer, nothing back). The fp16 row functions' one loop (forward_rows_f16 and below).
template <class Run>
void via_f16c(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t len, int64_t lo, int64_t hi, Run run) {
  std::vector<float> buf(3 * len);
  float *fa = buf.data(), *fb = fa + len, *fo = out != nullptr ? fb + len : nullptr;
  for (int64_t r = lo; r < hi; ++r) {
    f16c_to_fp32(a + r * len, fa, len);
    if (b != nullptr) f16c_to_fp32(b + r * len, fb, len);
    run(r, fa, fb, fo);
    if (out != nullptr) f16c_from_fp32(fo, out + r * len, len);
  }
}

// The sum of x[0, n) and the sum of (x - mean)^2 there: 16 fp32 lanes, the lanes added in order, then
// the tail (the LayerNorm rows' and the GroupNorm chunks' statistics).
template <typename C>
__attribute__((always_inline)) inline float lane_sum(const typename C::Raw* x, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    NK_LANES for (int j = 0; j < kLanes; ++j) acc[j] += C::load(x[i + j]);
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  for (; i < n; ++i) sum += C::load(x[i]);
  return sum;
}

template <typename C>
__attribute__((always_inline)) inline float lane_sq(const typename C::Raw* x, int64_t n, float mean) {
  float sq[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    NK_LANES for (int j = 0; j < kLanes; ++j) {
      const float d = C::load(x[i + j]) - mean;
      sq[j] += d * d;
    }
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += sq[j];
  for (; i < n; ++i) {
    const float d = C::load(x[i]) - mean;
    sum += d * d;
  }
  return sum;
}

// The rows of one block, for the backward's parameter sums and the threads' grain.
int64_t rows_per_block(int64_t N) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)); }

template <typename C>
NK_CLONES void forward_rows(const typename C::Raw* X, const float* W, const float* B, typename C::Raw* Y,
                            float* Mean, float* Rstd, int64_t N, float eps, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const typename C::Raw* x = X + r * N;
    const float mean = lane_sum<C>(x, N) / static_cast<float>(N);
    const float var = lane_sq<C>(x, N, mean);
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(N) + eps);
    Mean[r] = mean;
    Rstd[r] = rstd;
    typename C::Raw* y = Y + r * N;
    for (int64_t k = 0; k < N; ++k) y[k] = C::store((C::load(x[k]) - mean) * rstd * W[k] + B[k]);
  }
}

// One pass over a row for dx and the parameters' terms (the tests are loop-invariant: the compiler
// makes a loop for each case, but leaves fp16's bigger body scalar; kAll: the common case, all three,
// a loop without tests). Inlined into backward_rows' clones. __restrict__: on fp32 rows (F32) every
// pointer is a float*, and without it the vectorizer gives up on the alias checks (scalar: 2x slower).
template <typename C, bool kAll>
__attribute__((always_inline)) inline void backward_pass(const typename C::Raw* __restrict__ dy,
                                                         const typename C::Raw* __restrict__ x,
                                                         const float* __restrict__ W, float mean, float rstd, float c1,
                                                         float c2, typename C::Raw* __restrict__ dx,
                                                         float* __restrict__ DW, float* __restrict__ DB, int64_t N) {
  for (int64_t k = 0; k < N; ++k) {
    const float d = C::load(dy[k]), xhat = (C::load(x[k]) - mean) * rstd;
    if (kAll || dx != nullptr) dx[k] = C::store(rstd * (d * W[k] - xhat * c1 - c2));
    if (kAll || DW != nullptr) DW[k] += d * xhat;
    if (kAll || DB != nullptr) DB[k] += d;
  }
}

// dx of rows [lo, hi) and, where wanted, their dweight / dbias terms added into DW / DB (fp32, N).
template <typename C>
NK_CLONES void backward_rows(const typename C::Raw* DY, const typename C::Raw* X, const float* W, const float* Mean,
                             const float* Rstd, typename C::Raw* DX, float* DW, float* DB, int64_t N, int64_t lo,
                             int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const typename C::Raw* dy = DY + r * N;
    const typename C::Raw* x = X + r * N;
    const float mean = Mean[r], rstd = Rstd[r];
    float c1 = 0.f, c2 = 0.f;  // dx's row terms: the means of g * xhat and of g, g = dy * w
    if (DX != nullptr) {
      float a1[kLanes] = {0.f}, a2[kLanes] = {0.f};
      int64_t i = 0;
      for (; i + kLanes <= N; i += kLanes)
        NK_LANES for (int j = 0; j < kLanes; ++j) {
          const float g = C::load(dy[i + j]) * W[i + j];
          a1[j] += g * ((C::load(x[i + j]) - mean) * rstd);
          a2[j] += g;
        }
      for (int j = 0; j < kLanes; ++j) {
        c1 += a1[j];
        c2 += a2[j];
      }
      for (; i < N; ++i) {
        const float g = C::load(dy[i]) * W[i];
        c1 += g * ((C::load(x[i]) - mean) * rstd);
        c2 += g;
      }
      c1 /= static_cast<float>(N);
      c2 /= static_cast<float>(N);
    }
    typename C::Raw* dx = DX != nullptr ? DX + r * N : nullptr;
    if (dx != nullptr && DW != nullptr && DB != nullptr) {
      backward_pass<C, true>(dy, x, W, mean, rstd, c1, c2, dx, DW, DB, N);
    } else {
      backward_pass<C, false>(dy, x, W, mean, rstd, c1, c2, dx, DW, DB, N);
    }
  }
}

// fp16 LayerNorm rows [lo, hi): through F16C where on (each row to fp32 and back), else F16's
// conversions. The same bits either way (dweight / dbias terms added row by row in the same order).
void forward_rows_f16(const uint16_t* X, const float* W, const float* B, uint16_t* Y, float* Mean, float* Rstd,
                      int64_t N, float eps, int64_t lo, int64_t hi) {
  if (!f16c_on()) return forward_rows<F16>(X, W, B, Y, Mean, Rstd, N, eps, lo, hi);
  via_f16c(X, nullptr, Y, N, lo, hi, [&](int64_t r, const float* x, const float*, float* y) {
    forward_rows<F32>(x, W, B, y, Mean + r, Rstd + r, N, eps, 0, 1);
  });
}

void backward_rows_f16(const uint16_t* DY, const uint16_t* X, const float* W, const float* Mean, const float* Rstd,
                       uint16_t* DX, float* DW, float* DB, int64_t N, int64_t lo, int64_t hi) {
  if (!f16c_on()) return backward_rows<F16>(DY, X, W, Mean, Rstd, DX, DW, DB, N, lo, hi);
  via_f16c(DY, X, DX, N, lo, hi, [&](int64_t r, const float* dy, const float* x, float* dx) {
    backward_rows<F32>(dy, x, W, Mean + r, Rstd + r, dx, DW, DB, N, 0, 1);
  });
}

// A parameter as N fp32 values (``fill`` for an absent one), read in place (no ATen operator).
std::vector<float> as_fp32(const at::Tensor& p, int64_t N, float fill) {
  std::vector<float> out(N, fill);
  if (!p.defined()) return out;
  auto c = p.contiguous();
  if (c.scalar_type() == at::kFloat) {
    std::memcpy(out.data(), c.data_ptr<float>(), N * sizeof(float));
  } else {
    const auto* h = reinterpret_cast<const uint16_t*>(c.data_ptr());
    if (c.scalar_type() == at::kBFloat16) {
      for (int64_t k = 0; k < N; ++k) out[k] = BF16::load(h[k]);
    } else {
      for (int64_t k = 0; k < N; ++k) out[k] = F16::load(h[k]);
    }
  }
  return out;
}

// The (blocks, N) partial sums of a parameter's gradient added up block after block (the same bits for
// any thread count), as a tensor of the parameter's shape and dtype.
at::Tensor in_block_order(const std::vector<float>& parts, int64_t blocks, int64_t N, const at::Tensor& like) {
  std::vector<float> sum(parts.begin(), parts.begin() + N);
  for (int64_t k = 1; k < blocks; ++k)
    for (int64_t j = 0; j < N; ++j) sum[j] += parts[k * N + j];
  auto out = at::empty(like.sizes(), like.options());
  if (out.scalar_type() == at::kFloat) {
    std::memcpy(out.data_ptr<float>(), sum.data(), N * sizeof(float));
  } else {
    auto* h = reinterpret_cast<uint16_t*>(out.data_ptr());
    if (out.scalar_type() == at::kBFloat16) {
      for (int64_t k = 0; k < N; ++k) h[k] = BF16::store(sum[k]);
    } else {
      for (int64_t k = 0; k < N; ++k) h[k] = F16::store(sum[k]);
    }
  }
  return out;
}


const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* bits_out(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

std::vector<at::Tensor> forward_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t N,
                                     double eps) {
  const int64_t M = x.numel() / N;
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto mean = at::empty({M}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({M}, x.options().dtype(at::kFloat));
  const auto wf = as_fp32(w, N, 1.f), bf = as_fp32(b, N, 0.f);
  const uint16_t* X = bits(x);
  uint16_t* Y = bits_out(y);
  float *Mean = mean.data_ptr<float>(), *Rstd = rstd.data_ptr<float>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, M, rows_per_block(N), [&](int64_t lo, int64_t hi) {
    if (bf16) {
      forward_rows<BF16>(X, wf.data(), bf.data(), Y, Mean, Rstd, N, static_cast<float>(eps), lo, hi);
    } else {
      forward_rows_f16(X, wf.data(), bf.data(), Y, Mean, Rstd, N, static_cast<float>(eps), lo, hi);
    }
  });
  return {y, mean, rstd};
}

struct CpuHalfLayerNorm : public torch::autograd::Function<CpuHalfLayerNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Opt& w, const Opt& b,
                            std::vector<int64_t> shape, double eps) {
    const at::Tensor wt = w.has_value() ? *w : at::Tensor(), bt = b.has_value() ? *b : at::Tensor();
    auto out = forward_impl(x, wt, bt, c10::multiply_integers(shape), eps);
    ctx->save_for_backward({x, wt, bt, out[1], out[2]});
    ctx->saved_data["shape"] = c10::IValue(shape);
    ctx->saved_data["eps"] = eps;
    return out[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3], &rstd = saved[4];
    const auto shape = ctx->saved_data["shape"].toIntVector();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool want_x = ctx->needs_input_grad(0), want_w = w.defined() && ctx->needs_input_grad(1),
               want_b = b.defined() && ctx->needs_input_grad(2);
    at::Tensor dy = grads[0], dx, dw, db;
    if (!dy.defined()) return {dx, dw, db, at::Tensor(), at::Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph: the fp32 composite, differentiable again
      auto y = at::layer_norm(x.to(at::kFloat), shape, w.defined() ? w.to(at::kFloat) : at::Tensor(),
                              b.defined() ? b.to(at::kFloat) : at::Tensor(), eps);
      variable_list inputs;
      for (auto [t, want] : {std::pair{&x, want_x}, std::pair{&w, want_w}, std::pair{&b, want_b}})
        if (want) inputs.push_back(*t);
      auto g = torch::autograd::grad({y}, inputs, {dy.to(at::kFloat)}, true, true, true);
      size_t i = 0;
      if (want_x) dx = g[i++];
      if (want_w) dw = g[i++];
      if (want_b) db = g[i++];
      return {dx, dw, db, at::Tensor(), at::Tensor()};
    }
    const int64_t N = c10::multiply_integers(shape), M = x.numel() / N;
    if (dy.scalar_type() != x.scalar_type() || !dy.is_contiguous()) dy = dy.to(x.scalar_type()).contiguous();
    if (want_x) dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    const int64_t per = rows_per_block(N), blocks = (M + per - 1) / per;
    std::vector<float> dwp(want_w ? blocks * N : 0, 0.f), dbp(want_b ? blocks * N : 0, 0.f);
    const auto wf = as_fp32(w, N, 1.f);
    const uint16_t *DY = bits(dy), *X = bits(x);
    uint16_t* DX = want_x ? bits_out(dx) : nullptr;
    const float *Mean = mean.data_ptr<float>(), *Rstd = rstd.data_ptr<float>();
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t k = first; k < last; ++k) {
        float* DW = want_w ? dwp.data() + k * N : nullptr;
        float* DB = want_b ? dbp.data() + k * N : nullptr;
        const int64_t lo = k * per, hi = std::min(M, lo + per);
        if (bf16) {
          backward_rows<BF16>(DY, X, wf.data(), Mean, Rstd, DX, DW, DB, N, lo, hi);
        } else {
          backward_rows_f16(DY, X, wf.data(), Mean, Rstd, DX, DW, DB, N, lo, hi);
        }
      }
    });
    if (want_w) dw = in_block_order(dwp, blocks, N, w);
    if (want_b) db = in_block_order(dbp, blocks, N, b);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

// ---- GroupNorm ------------------------------------------------------------------------------------

// Values of a chunk summed in 16 fp32 lanes; the chunks' sums added in double (groups run to 10^5
// and more values: the error of one long fp32 sum a lane would grow with them).
constexpr int64_t kChunk = 1024;

// y / dx values rounded to 16 bits: bf16's rounding without its NaN test (16% of the forward's time),
// NaN ("v != v") flagged instead; a channel whose values hold one (rare) is stored again with
// C::store. (fp16's conversion keeps its own.)
template <typename C>
inline typename C::Raw round_nonnan(float f) {
  if constexpr (std::is_same_v<C, BF16>) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  } else {
    return C::store(f);
  }
}

// mean and rstd of rows [lo, hi) of L = D * S values, and y; W, B: C fp32 values (row r: group r % G).
template <typename C>
NK_CLONES void gn_forward_rows(const typename C::Raw* X, const float* W, const float* B, typename C::Raw* Y,
                               float* Mean, float* Rstd, int64_t G, int64_t D, int64_t S, float eps, int64_t lo,
                               int64_t hi) {
  const int64_t L = D * S;
  for (int64_t r = lo; r < hi; ++r) {
    const typename C::Raw* x = X + r * L;
    double total = 0., sq_total = 0.;  // chunks of kChunk values, added in double
    for (int64_t i0 = 0; i0 < L; i0 += kChunk) total += lane_sum<C>(x + i0, std::min(kChunk, L - i0));
    const float mean = static_cast<float>(total / static_cast<double>(L));
    for (int64_t i0 = 0; i0 < L; i0 += kChunk) sq_total += lane_sq<C>(x + i0, std::min(kChunk, L - i0), mean);
    const float rstd = 1.f / std::sqrt(static_cast<float>(sq_total / static_cast<double>(L)) + eps);
    Mean[r] = mean;
    Rstd[r] = rstd;
    const float *w = W + (r % G) * D, *b = B + (r % G) * D;
    typename C::Raw* y = Y + r * L;
    if (S == 1) {  // (N, C): the group's channels are its values
      int nan = 0;
      for (int64_t k = 0; k < D; ++k) {
        const float v = (C::load(x[k]) - mean) * (rstd * w[k]) + b[k];
        y[k] = round_nonnan<C>(v);
        nan |= v != v;
      }
      if (nan)
        for (int64_t k = 0; k < D; ++k) y[k] = C::store((C::load(x[k]) - mean) * (rstd * w[k]) + b[k]);
      continue;
    }
    for (int64_t c = 0; c < D; ++c) {
      const float a = rstd * w[c], bc = b[c];
      const typename C::Raw* xc = x + c * S;
      typename C::Raw* yc = y + c * S;
      int nan = 0;
      for (int64_t s = 0; s < S; ++s) {
        const float v = (C::load(xc[s]) - mean) * a + bc;
        yc[s] = round_nonnan<C>(v);
        nan |= v != v;
      }
      if (nan)
        for (int64_t s = 0; s < S; ++s) yc[s] = C::store((C::load(xc[s]) - mean) * a + bc);
    }
  }
}

// dx of rows [lo, hi) (row r: sample r / G, group r % G) and, where wanted, their channels' dweight /
// dbias terms added into DW / DB (fp32, C channels). dx = rstd * (dy * w - xhat * c1 - c2), c1 / c2
// the row's means of dy * w * xhat and of dy * w.
template <typename C>
NK_CLONES void gn_backward_rows(const typename C::Raw* DY, const typename C::Raw* X, const float* W,
                                const float* Mean, const float* Rstd, typename C::Raw* DX, float* DW_all,
                                float* DB_all, int64_t G, int64_t D, int64_t S, int64_t lo, int64_t hi) {
  const int64_t L = D * S;
  for (int64_t r = lo; r < hi; ++r) {
    const int64_t c0 = (r % G) * D;
    const float* w = W + c0;
    float* DW = DW_all != nullptr ? DW_all + c0 : nullptr;
    float* DB = DB_all != nullptr ? DB_all + c0 : nullptr;
    const typename C::Raw* dy = DY + r * L;
    const typename C::Raw* x = X + r * L;
    typename C::Raw* dx = DX != nullptr ? DX + r * L : nullptr;
    const float mean = Mean[r], rstd = Rstd[r];
    if (S == 1) {  // (N, C): as a LayerNorm row of D values, weights w
      float k1 = 0.f, c2 = 0.f;  // rstd * c1, c2
      if (dx != nullptr) {
        double t1 = 0., t2 = 0.;
        for (int64_t i0 = 0; i0 < D; i0 += kChunk) {
          const int64_t m = std::min(kChunk, D - i0);
          float a1[kLanes] = {0.f}, a2[kLanes] = {0.f};
          int64_t i = 0;
          for (; i + kLanes <= m; i += kLanes)
            NK_LANES for (int j = 0; j < kLanes; ++j) {
              const int64_t k = i0 + i + j;
              const float gk = C::load(dy[k]) * w[k];
              a1[j] += gk * (C::load(x[k]) - mean);
              a2[j] += gk;
            }
          float s1 = 0.f, s2 = 0.f;
          for (int j = 0; j < kLanes; ++j) {
            s1 += a1[j];
            s2 += a2[j];
          }
          for (; i < m; ++i) {
            const int64_t k = i0 + i;
            const float gk = C::load(dy[k]) * w[k];
            s1 += gk * (C::load(x[k]) - mean);
            s2 += gk;
          }
          t1 += s1;
          t2 += s2;
        }
        k1 = static_cast<float>(t1 * rstd / static_cast<double>(D)) * rstd;
        c2 = static_cast<float>(t2 / static_cast<double>(D));
      }
      int nan = 0;  // one pass for dx and the parameters' terms (all three spelled out, as LayerNorm's)
      if (dx != nullptr && DW != nullptr && DB != nullptr) {
        for (int64_t k = 0; k < D; ++k) {
          const float d = C::load(dy[k]), xc = C::load(x[k]) - mean;
          const float v = rstd * (d * w[k] - xc * k1 - c2);
          dx[k] = round_nonnan<C>(v);
          nan |= v != v;
          DW[k] += d * (xc * rstd);
          DB[k] += d;
        }
      } else {
        for (int64_t k = 0; k < D; ++k) {
          const float d = C::load(dy[k]), xc = C::load(x[k]) - mean;
          if (dx != nullptr) {
            const float v = rstd * (d * w[k] - xc * k1 - c2);
            dx[k] = round_nonnan<C>(v);
            nan |= v != v;
          }
          if (DW != nullptr) DW[k] += d * (xc * rstd);
          if (DB != nullptr) DB[k] += d;
        }
      }
      if (nan)
        for (int64_t k = 0; k < D; ++k)
          dx[k] = C::store(rstd * (C::load(dy[k]) * w[k] - (C::load(x[k]) - mean) * k1 - c2));
      continue;
    }
    // Each channel's sums of dy * (x - mean) and of dy: times rstd, its dweight term; its dbias
    // term; with w, its part of c1 / c2.
    double t1 = 0., t2 = 0.;
    for (int64_t c = 0; c < D; ++c) {
      const typename C::Raw* dyc = dy + c * S;
      const typename C::Raw* xc = x + c * S;
      double u1 = 0., u2 = 0.;
      for (int64_t i0 = 0; i0 < S; i0 += kChunk) {
        const int64_t m = std::min(kChunk, S - i0);
        float a1[kLanes] = {0.f}, a2[kLanes] = {0.f};
        int64_t i = 0;
        for (; i + kLanes <= m; i += kLanes)
          NK_LANES for (int j = 0; j < kLanes; ++j) {
            const float d = C::load(dyc[i0 + i + j]);
            a1[j] += d * (C::load(xc[i0 + i + j]) - mean);
            a2[j] += d;
          }
        float s1 = 0.f, s2 = 0.f;
        for (int j = 0; j < kLanes; ++j) {
          s1 += a1[j];
          s2 += a2[j];
        }
        for (; i < m; ++i) {
          const float d = C::load(dyc[i0 + i]);
          s1 += d * (C::load(xc[i0 + i]) - mean);
          s2 += d;
        }
        u1 += s1;
        u2 += s2;
      }
      u1 *= rstd;
      if (DW != nullptr) DW[c] += static_cast<float>(u1);
      if (DB != nullptr) DB[c] += static_cast<float>(u2);
      t1 += static_cast<double>(w[c]) * u1;
      t2 += static_cast<double>(w[c]) * u2;
    }
    if (dx == nullptr) continue;
    // dx = dy * (rstd * w) - (x - mean) * (rstd * rstd * c1) - rstd * c2
    const float k1 = static_cast<float>(t1 * rstd / static_cast<double>(L)) * rstd,
                k2 = static_cast<float>(t2 * rstd / static_cast<double>(L));
    for (int64_t c = 0; c < D; ++c) {
      const float a = rstd * w[c];
      const typename C::Raw* dyc = dy + c * S;
      const typename C::Raw* xc = x + c * S;
      typename C::Raw* dxc = dx + c * S;
      int nan = 0;
      for (int64_t s = 0; s < S; ++s) {
        const float v = C::load(dyc[s]) * a - (C::load(xc[s]) - mean) * k1 - k2;
        dxc[s] = round_nonnan<C>(v);
        nan |= v != v;
      }
      if (nan)
        for (int64_t s = 0; s < S; ++s) dxc[s] = C::store(C::load(dyc[s]) * a - (C::load(xc[s]) - mean) * k1 - k2);
    }
  }
}

// fp16 GroupNorm rows [lo, hi), as LayerNorm's (forward_rows_f16): each (sample, group) row to fp32
// and back, its group's parameters (and parameter terms) passed as those of one group.
void gn_forward_rows_f16(const uint16_t* X, const float* W, const float* B, uint16_t* Y, float* Mean, float* Rstd,
                         int64_t G, int64_t D, int64_t S, float eps, int64_t lo, int64_t hi) {
  if (!f16c_on()) return gn_forward_rows<F16>(X, W, B, Y, Mean, Rstd, G, D, S, eps, lo, hi);
  via_f16c(X, nullptr, Y, D * S, lo, hi, [&](int64_t r, const float* x, const float*, float* y) {
    const int64_t c0 = (r % G) * D;
    gn_forward_rows<F32>(x, W + c0, B + c0, y, Mean + r, Rstd + r, 1, D, S, eps, 0, 1);
  });
}

void gn_backward_rows_f16(const uint16_t* DY, const uint16_t* X, const float* W, const float* Mean,
                          const float* Rstd, uint16_t* DX, float* DW_all, float* DB_all, int64_t G, int64_t D,
                          int64_t S, int64_t lo, int64_t hi) {
  if (!f16c_on()) return gn_backward_rows<F16>(DY, X, W, Mean, Rstd, DX, DW_all, DB_all, G, D, S, lo, hi);
  via_f16c(DY, X, DX, D * S, lo, hi, [&](int64_t r, const float* dy, const float* x, float* dx) {
    const int64_t c0 = (r % G) * D;
    gn_backward_rows<F32>(dy, x, W + c0, Mean + r, Rstd + r, dx, DW_all != nullptr ? DW_all + c0 : nullptr,
                          DB_all != nullptr ? DB_all + c0 : nullptr, 1, D, S, 0, 1);
  });
}

// The rows (sample, group) of one block: the threads' grain, and the backward's parameter sums.
int64_t groups_per_block(int64_t L) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(L, 1)); }

struct CpuHalfGroupNorm : public torch::autograd::Function<CpuHalfGroupNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Opt& w, const Opt& b, int64_t groups,
                            double eps) {
    const at::Tensor wt = w.has_value() ? *w : at::Tensor(), bt = b.has_value() ? *b : at::Tensor();
    const int64_t N = x.size(0), C = x.size(1), S = x.numel() / (N * C), D = C / groups, L = D * S;
    auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
    auto stats = at::empty({2, N * groups}, x.options().dtype(at::kFloat));  // mean, rstd (one allocation)
    const auto wf = as_fp32(wt, C, 1.f), bf = as_fp32(bt, C, 0.f);
    const uint16_t* X = bits(x);
    uint16_t* Y = bits_out(y);
    float *Mean = stats.data_ptr<float>(), *Rstd = Mean + N * groups;
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const float e = static_cast<float>(eps);
    at::parallel_for(0, N * groups, groups_per_block(L), [&](int64_t lo, int64_t hi) {
      if (bf16) {
        gn_forward_rows<BF16>(X, wf.data(), bf.data(), Y, Mean, Rstd, groups, D, S, e, lo, hi);
      } else {
        gn_forward_rows_f16(X, wf.data(), bf.data(), Y, Mean, Rstd, groups, D, S, e, lo, hi);
      }
    });
    ctx->save_for_backward({x, wt, bt, stats});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["eps"] = eps;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &b = saved[2], &stats = saved[3];
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool want_x = ctx->needs_input_grad(0), want_w = w.defined() && ctx->needs_input_grad(1),
               want_b = b.defined() && ctx->needs_input_grad(2);
    at::Tensor dy = grads[0], dx, dw, db;
    if (!dy.defined()) return {dx, dw, db, at::Tensor(), at::Tensor()};
    if (at::GradMode::is_enabled()) {  // create_graph: the fp32 composite, differentiable again
      // x less its groups' (saved, constant) means: the same function of x, whose fp32 derivatives stay
      // exact for large means (torch's fp32 backward works on x itself: second-order gradients of
      // groups around 300 off by 30x their size)
      const int64_t N = x.size(0);
      auto xc = (x.to(at::kFloat).view({N, groups, -1}) - stats.select(0, 0).view({N, groups, 1})).view(x.sizes());
      auto y = at::group_norm(xc, groups, w.defined() ? w.to(at::kFloat) : at::Tensor(),
                              b.defined() ? b.to(at::kFloat) : at::Tensor(), eps);
      variable_list inputs;
      for (auto [t, want] : {std::pair{&x, want_x}, std::pair{&w, want_w}, std::pair{&b, want_b}})
        if (want) inputs.push_back(*t);
      if (inputs.empty()) return {dx, dw, db, at::Tensor(), at::Tensor()};
      auto g = torch::autograd::grad({y}, inputs, {dy.to(at::kFloat)}, true, true, true);
      size_t i = 0;
      if (want_x) dx = g[i++];
      if (want_w) dw = g[i++];
      if (want_b) db = g[i++];
      return {dx, dw, db, at::Tensor(), at::Tensor()};
    }
    const int64_t N = x.size(0), C = x.size(1), S = x.numel() / (N * C), D = C / groups, L = D * S;
    if (dy.scalar_type() != x.scalar_type() || !dy.is_contiguous()) dy = dy.to(x.scalar_type()).contiguous();
    if (want_x) dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    // Blocks of rows in memory order; block k adds its terms into row k of the (blocks, C) partial
    // sums, which are added up block after block.
    const int64_t M = N * groups, per = groups_per_block(L), blocks = (M + per - 1) / per;
    std::vector<float> dwp(want_w ? blocks * C : 0, 0.f), dbp(want_b ? blocks * C : 0, 0.f);
    const auto wf = as_fp32(w, C, 1.f);
    const uint16_t *DY = bits(dy), *X = bits(x);
    uint16_t* DX = want_x ? bits_out(dx) : nullptr;
    const float *Mean = stats.data_ptr<float>(), *Rstd = Mean + M;
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t k = first; k < last; ++k) {
        float* DW = want_w ? dwp.data() + k * C : nullptr;
        float* DB = want_b ? dbp.data() + k * C : nullptr;
        const int64_t lo = k * per, hi = std::min(M, lo + per);
        if (bf16) {
          gn_backward_rows<BF16>(DY, X, wf.data(), Mean, Rstd, DX, DW, DB, groups, D, S, lo, hi);
        } else {
          gn_backward_rows_f16(DY, X, wf.data(), Mean, Rstd, DX, DW, DB, groups, D, S, lo, hi);
        }
      }
    });
    if (want_w) dw = in_block_order(dwp, blocks, C, w);
    if (want_b) db = in_block_order(dbp, blocks, C, b);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

// --- the door: the common CPU calls from one C++ call ---------------------------------------------
// normkit's public functions try door(op, ...) first on the CPU (normkit/cpu.py, DOOR): the calls whose
// Python path would call one torch operator as it is (normkit/cpu.py's first routes), checked here and
// run by that operator, without the Python checks. Anything else, and any error of the operator,
// answers None: the Python path serves it (and words the error).
enum CpuOp : long long {
  SOFTMAX = 0, LOG_SOFTMAX = 1, LAYER_NORM = 2, RMS_NORM = 3, ADD_LAYER_NORM = 4, ADD_RMS_NORM = 5,
  BATCH_NORM = 6
};

// x: an exact torch.Tensor (`parameter`: or an nn.Parameter) on the CPU, or nullptr
const at::Tensor* cpu_tensor(PyObject* o, bool parameter = false) {
  PyTypeObject* type = Py_TYPE(o);
  if (type != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
      !(parameter && type == reinterpret_cast<PyTypeObject*>(ParameterClass))) {
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(o);
  return t.device().is_cpu() ? &t : nullptr;
}

// None or a CPU Tensor / Parameter (of `dtype` where it is given)
bool cpu_param(PyObject* o, Opt& out, std::optional<at::ScalarType> dtype = std::nullopt) {
  if (o == Py_None) return true;
  const at::Tensor* t = cpu_tensor(o, true);
  if (t == nullptr || (dtype && t->scalar_type() != *dtype)) return false;
  out = *t;
  return true;
}

// normalized_shape: an int, or a tuple / torch.Size / list of ints
bool int_list(PyObject* o, std::vector<int64_t>& out) {
  int overflow = 0;
  if (PyLong_CheckExact(o)) {
    out.push_back(PyLong_AsLongLongAndOverflow(o, &overflow));
    return overflow == 0;
  }
  if (!(PyTuple_CheckExact(o) || THPSize_Check(o) || PyList_CheckExact(o))) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* d = PySequence_Fast_GET_ITEM(o, i);
    if (!PyLong_CheckExact(d)) return false;
    out.push_back(PyLong_AsLongLongAndOverflow(d, &overflow));
    if (overflow != 0) return false;
  }
  return true;
}

// eps: a float in [0, inf) (`positive`: (0, inf)); None where `none_ok` (out stays empty)
bool eps_of(PyObject* o, std::optional<double>& out, bool none_ok = false, bool positive = false) {
  if (o == Py_None) return none_ok;
  if (!PyFloat_CheckExact(o)) return false;
  double v = PyFloat_AS_DOUBLE(o);
  if (!(positive ? v > 0 : v >= 0) || !(v < std::numeric_limits<double>::infinity())) return false;
  out = v;
  return true;
}

bool half(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// a gradient wanted through any of these
bool differentiated(std::initializer_list<const at::Tensor*> ts, const Opt& w = {}, const Opt& b = {}) {
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor* t : ts) {
    if (t->requires_grad()) return true;
  }
  return (w && w->requires_grad()) || (b && b->requires_grad());
}

// rms_norm's eps None: the input dtype's epsilon, passed explicitly for 16-bit inputs (torch's CPU
// kernel takes its math dtype's, fp32's, there); fp32 / fp64 keep None, torch's faster route
std::optional<double> rms_eps(const at::Tensor& x, std::optional<double> eps) {
  if (eps || !half(x)) return eps;
  return x.scalar_type() == at::kBFloat16 ? 0.0078125 : 0.0009765625;
}

// f() (the operator) without the GIL from 32768 elements, as torch's bindings run their operators
template <class F>
at::Tensor run(const at::Tensor& x, F f) {
  if (x.numel() < (1 << 15)) return f();
  py::gil_scoped_release no_gil;
  return f();
}

// the operator's output, or nullopt where the door does not serve the call
std::optional<at::Tensor> cpu_call(PyObject* const* a, Py_ssize_t n) {
  int overflow = 0;
  long long op = n > 0 && PyLong_CheckExact(a[0]) ? PyLong_AsLongLongAndOverflow(a[0], &overflow) : -1;
  const at::Tensor* x = n > 1 ? cpu_tensor(a[1]) : nullptr;
  if (overflow != 0 || x == nullptr || !at::isFloatingType(x->scalar_type())) return std::nullopt;
  if (at::impl::torch_function_mode_enabled()) return std::nullopt;  // (torch's ops would see the mode)
  std::vector<int64_t> shape;
  std::optional<double> eps;
  Opt w, b;
  switch (op) {
    case SOFTMAX:
    case LOG_SOFTMAX: {  // (op, x, dim)
      if (n != 3 || !PyLong_CheckExact(a[2])) return std::nullopt;
      int64_t dim = PyLong_AsLongLongAndOverflow(a[2], &overflow);
      if (overflow != 0) return std::nullopt;
      return run(*x, [&] { return op == SOFTMAX ? at::softmax(*x, dim) : at::log_softmax(*x, dim); });
    }
    case LAYER_NORM:  // (op, x, normalized_shape, weight, bias, eps)
      if (n != 6 || x->numel() == 0 || !int_list(a[2], shape) || !cpu_param(a[3], w) || !cpu_param(a[4], b) ||
          !eps_of(a[5], eps) || (half(*x) && differentiated({x}, w, b))) {
        return std::nullopt;  // (a 16-bit input with gradients: normkit/cpu.py's routes)
      }
      return run(*x, [&] { return at::layer_norm(*x, shape, w, b, *eps); });
    case RMS_NORM:  // (op, x, normalized_shape, weight, eps)
      if (n != 5 || x->numel() == 0 || !int_list(a[2], shape) || !cpu_param(a[3], w, x->scalar_type()) ||
          !eps_of(a[4], eps, true)) {
        return std::nullopt;  // (a weight of another dtype: normkit/cpu.py's routes)
      }
      return run(*x, [&] { return at::rms_norm(*x, shape, w, rms_eps(*x, eps)); });
    case ADD_LAYER_NORM:  // (op, x, residual, normalized_shape, weight, bias, eps)
    case ADD_RMS_NORM: {  // (op, x, residual, normalized_shape, weight, eps)
      bool rms = op == ADD_RMS_NORM;
      const at::Tensor* r = n > 2 ? cpu_tensor(a[2]) : nullptr;
      if (n != (rms ? 6 : 7) || r == nullptr || r->scalar_type() != x->scalar_type() || r->sizes() != x->sizes() ||
          x->numel() == 0 || !int_list(a[3], shape)) {
        return std::nullopt;
      }
      if (rms) {
        if (!cpu_param(a[4], w, x->scalar_type()) || !eps_of(a[5], eps, true)) return std::nullopt;
        return run(*x, [&] { return at::rms_norm(*x + *r, shape, w, rms_eps(*x, eps)); });
      }
      if (!cpu_param(a[4], w) || !cpu_param(a[5], b) || !eps_of(a[6], eps) ||
          (half(*x) && differentiated({x, r}, w, b))) {
        return std::nullopt;
      }
      return run(*x, [&] { return at::layer_norm(*x + *r, shape, w, b, *eps); });
    }
    case BATCH_NORM: {  // (op, x, running_mean, running_var, weight, bias, training, momentum, eps)
      Opt rm, rv;
      auto dtype = x->scalar_type();
      if (n != 9 || x->dim() < 2 || x->numel() == 0 || !cpu_param(a[2], rm, dtype) || !cpu_param(a[3], rv, dtype) ||
          !cpu_param(a[4], w, dtype) || !cpu_param(a[5], b, dtype) || rm.has_value() != rv.has_value() ||
          (a[6] != Py_True && a[6] != Py_False) || !PyFloat_CheckExact(a[7]) || !eps_of(a[8], eps, false, true)) {
        return std::nullopt;
      }
      bool training = a[6] == Py_True;
      if (training ? x->numel() <= x->size(1) : !rm.has_value()) return std::nullopt;
      double momentum = PyFloat_AS_DOUBLE(a[7]);
      if (training && half(*x)) {
        // torch's operator with 16-bit or no parameters rounds the batch mean to 16 bits: run it with
        // fp32 ones (its mixed-type path, fp32 statistics), the running statistics through fp32
        // copies written back; the same operators as normkit.cpu._half_training, so the same bits
        auto f32 = x->options().dtype(at::kFloat);
        int64_t c = x->size(1);
        at::Tensor w32 = w ? w->to(at::kFloat) : at::ones({c}, f32);
        at::Tensor b32 = b ? b->to(at::kFloat) : at::zeros({c}, f32);
        Opt rm32, rv32;
        if (rm) rm32 = rm->to(at::kFloat), rv32 = rv->to(at::kFloat);
        at::Tensor y = run(*x, [&] { return at::batch_norm(*x, w32, b32, rm32, rv32, true, momentum, *eps, false); });
        if (rm) {
          at::NoGradGuard no_grad;
          rm->copy_(*rm32);
          rv->copy_(*rv32);
        }
        return y;
      }
      return run(*x, [&] { return at::batch_norm(*x, w, b, rm, rv, training, momentum, *eps, false); });
    }
    default:
      return std::nullopt;
  }
}

PyObject* cpu_door(PyObject*, PyObject* const* args, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  std::optional<at::Tensor> y;
  try {
    y = cpu_call(args, n);
  } catch (const std::exception&) {  // the operator refused the call: the Python path words the error
    y.reset();
  }
  if (!y) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(*y));
  END_HANDLE_TH_ERRORS
}

PyMethodDef cpu_door_def = {
    "door", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(cpu_door)), METH_FASTCALL,
    "door(op, x, ...) -> the CPU call's output from its torch operator, or None (normkit/cpu.py's DOOR)"};
}  // namespace

// Checks with one C-string message: TORCH_CHECK with a message of several parts crashed the process
// instead of raising on one torch build (backends/cuda/native.cpp's fail()); normkit/cpu.py checks the
// arguments before these, so these name the broken rule only.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "normkit's CPU LayerNorm and GroupNorm of 16-bit inputs with gradients (normkit/cpu.py)";
  m.def("cpu_layer_norm", [](const at::Tensor& x, Opt w, Opt b, std::vector<int64_t> shape, double eps) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
                "normkit native: cpu_layer_norm takes a contiguous 16-bit CPU tensor");
    const int64_t N = c10::multiply_integers(shape);
    TORCH_CHECK(!shape.empty() && x.dim() >= static_cast<int64_t>(shape.size()) &&
                    x.sizes().slice(x.dim() - shape.size()) == c10::IntArrayRef(shape),
                "normkit native: cpu_layer_norm: normalized_shape is not x's trailing shape");
    for (const Opt* p : {&w, &b})
      TORCH_CHECK(!p->has_value() || ((*p)->device().is_cpu() && (*p)->sizes() == c10::IntArrayRef(shape) &&
                                      ((*p)->scalar_type() == x.scalar_type() || (*p)->scalar_type() == at::kFloat)),
                  "normkit native: cpu_layer_norm: a parameter of normalized_shape, x's dtype or float32");
    TORCH_CHECK(N > 0, "normkit native: cpu_layer_norm: empty rows");
    return CpuHalfLayerNorm::apply(x, w, b, shape, eps);
  });
  m.def("cpu_group_norm", [](const at::Tensor& x, Opt w, Opt b, int64_t groups, double eps) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.dim() >= 2 &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
                "normkit native: cpu_group_norm takes a contiguous 16-bit CPU tensor (N, C, *)");
    const int64_t C = x.size(1);
    TORCH_CHECK(x.numel() > 0 && groups > 0 && C % groups == 0,
                "normkit native: cpu_group_norm: groups that do not divide the channels, or an empty input");
    for (const Opt* p : {&w, &b})
      TORCH_CHECK(!p->has_value() || ((*p)->device().is_cpu() && (*p)->dim() == 1 && (*p)->size(0) == C &&
                                      ((*p)->scalar_type() == x.scalar_type() || (*p)->scalar_type() == at::kFloat)),
                  "normkit native: cpu_group_norm: a parameter of (C,), x's dtype or float32");
    return CpuHalfGroupNorm::apply(x, w, b, groups, eps);
  });
  m.add_object("door", py::reinterpret_steal<py::object>(PyCFunction_New(&cpu_door_def, nullptr)));
  m.def(
      "f16c",
      [](std::optional<bool> on) {
        if (on.has_value()) g_f16c.store(*on && f16c_supported() ? 1 : 0, std::memory_order_relaxed);
        return f16c_on();
      },
      py::arg("on") = py::none(),
      "Whether fp16 rows run through the CPU's F16C conversions (where it has AVX2 and F16C); f16c(False) "
      "runs the portable conversions instead (the same bits; a test hook), f16c(True) turns them back on");
}
