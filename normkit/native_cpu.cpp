// CPU LayerNorm of 16-bit inputs with gradients, one C++ operator each way (normkit/cpu.py): the
// native extension "cpu", built by `normkit native` (normkit/native.py).
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
// Rows are split over threads (at::parallel_for, OpenMP on Linux); each row function is compiled for
// AVX2 and for the baseline, chosen at run time (GCC / Clang target_clones, x86-64 Linux), with 16
// independent fp32 partial sums a pass so that the compiler vectorizes them without reassociating.

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/Parallel.h>

#include <c10/util/Half.h>
#include <c10/util/accumulate.h>

#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))  // (ifunc: ELF only)
#define NK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define NK_CLONES
#endif

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;

constexpr int kLanes = 16;

// 16-bit values as raw bits, converted in branch-free code the compiler vectorizes.
struct BF16 {
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

struct F16 {
  static float load(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
  static uint16_t store(float f) { return c10::detail::fp16_ieee_from_fp32_value(f); }
};

// The rows of one block, for the backward's parameter sums and the threads' grain.
int64_t rows_per_block(int64_t N) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)); }

template <typename C>
NK_CLONES void forward_rows(const uint16_t* X, const float* W, const float* B, uint16_t* Y, float* Mean, float* Rstd,
                            int64_t N, float eps, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const uint16_t* x = X + r * N;
    float acc[kLanes] = {0.f};
    int64_t i = 0;
    for (; i + kLanes <= N; i += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += C::load(x[i + j]);
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    for (; i < N; ++i) sum += C::load(x[i]);
    const float mean = sum / static_cast<float>(N);
    float sq[kLanes] = {0.f};
    i = 0;
    for (; i + kLanes <= N; i += kLanes)
      for (int j = 0; j < kLanes; ++j) {
        const float d = C::load(x[i + j]) - mean;
        sq[j] += d * d;
      }
    float var = 0.f;
    for (int j = 0; j < kLanes; ++j) var += sq[j];
    for (; i < N; ++i) {
      const float d = C::load(x[i]) - mean;
      var += d * d;
    }
    const float rstd = 1.f / std::sqrt(var / static_cast<float>(N) + eps);
    Mean[r] = mean;
    Rstd[r] = rstd;
    uint16_t* y = Y + r * N;
    for (int64_t k = 0; k < N; ++k) y[k] = C::store((C::load(x[k]) - mean) * rstd * W[k] + B[k]);
  }
}

// dx of rows [lo, hi) and, where wanted, their dweight / dbias terms added into DW / DB (fp32, N).
template <typename C>
NK_CLONES void backward_rows(const uint16_t* DY, const uint16_t* X, const float* W, const float* Mean,
                             const float* Rstd, uint16_t* DX, float* DW, float* DB, int64_t N, int64_t lo, int64_t hi) {
  for (int64_t r = lo; r < hi; ++r) {
    const uint16_t* dy = DY + r * N;
    const uint16_t* x = X + r * N;
    const float mean = Mean[r], rstd = Rstd[r];
    float c1 = 0.f, c2 = 0.f;  // dx's row terms: the means of g * xhat and of g, g = dy * w
    if (DX != nullptr) {
      float a1[kLanes] = {0.f}, a2[kLanes] = {0.f};
      int64_t i = 0;
      for (; i + kLanes <= N; i += kLanes)
        for (int j = 0; j < kLanes; ++j) {
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
    // One pass for dx and the parameters' terms (the tests are loop-invariant: the compiler makes a
    // loop for each case).
    uint16_t* dx = DX != nullptr ? DX + r * N : nullptr;
    for (int64_t k = 0; k < N; ++k) {
      const float d = C::load(dy[k]), xhat = (C::load(x[k]) - mean) * rstd;
      if (dx != nullptr) dx[k] = C::store(rstd * (d * W[k] - xhat * c1 - c2));
      if (DW != nullptr) DW[k] += d * xhat;
      if (DB != nullptr) DB[k] += d;
    }
  }
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
      forward_rows<F16>(X, wf.data(), bf.data(), Y, Mean, Rstd, N, static_cast<float>(eps), lo, hi);
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
          backward_rows<F16>(DY, X, wf.data(), Mean, Rstd, DX, DW, DB, N, lo, hi);
        }
      }
    });
    if (want_w) dw = in_block_order(dwp, blocks, N, w);
    if (want_b) db = in_block_order(dbp, blocks, N, b);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }
};
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "normkit's CPU LayerNorm of 16-bit inputs with gradients (normkit/cpu.py)";
  m.def("cpu_layer_norm", [](const at::Tensor& x, Opt w, Opt b, std::vector<int64_t> shape, double eps) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
                "normkit native: cpu_layer_norm takes a contiguous 16-bit CPU tensor, got ", x.toString());
    const int64_t N = c10::multiply_integers(shape);
    TORCH_CHECK(!shape.empty() && x.dim() >= static_cast<int64_t>(shape.size()) &&
                    x.sizes().slice(x.dim() - shape.size()) == c10::IntArrayRef(shape),
                "normkit native: cpu_layer_norm: normalized_shape ", c10::IntArrayRef(shape),
                " is not x's trailing shape ", x.sizes());
    for (const Opt* p : {&w, &b})
      TORCH_CHECK(!p->has_value() || ((*p)->device().is_cpu() && (*p)->sizes() == c10::IntArrayRef(shape) &&
                                      ((*p)->scalar_type() == x.scalar_type() || (*p)->scalar_type() == at::kFloat)),
                  "normkit native: cpu_layer_norm: a parameter of normalized_shape, x's dtype or float32");
    TORCH_CHECK(N > 0, "normkit native: cpu_layer_norm: empty rows");
    return CpuHalfLayerNorm::apply(x, w, b, shape, eps);
  });
}
