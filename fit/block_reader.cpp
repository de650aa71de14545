#include "fit/block_reader.hpp"

#include <cmath>

#include "core/error.hpp"
#include "core/host_kernels.hpp"

namespace crosskv {
namespace {

// Non-finite values are found on the stored bits (an all-ones exponent), before any conversion.
template <class U>
int64_t first_nonfinite(const U* v, int64_t n, U exponent) {
  U any = 0;
  for (int64_t i = 0; i < n; ++i) any |= static_cast<U>(((v[i] & exponent) == exponent) ? 1 : 0);
  if (!any) return -1;
  for (int64_t i = 0; i < n; ++i)
    if ((v[i] & exponent) == exponent) return i;
  return -1;
}

void check_finite(const Stored& s, int64_t rows, int64_t per_layer, const std::string& path, const char* dataset,
                  int64_t t0, int64_t stride) {
  int64_t i;
  bool nan;
  if (s.dtype == Dtype::f32) {
    const auto* u = reinterpret_cast<const uint32_t*>(s.f32.data());
    i = first_nonfinite<uint32_t>(u, static_cast<int64_t>(s.f32.size()), 0x7f800000u);
    nan = i >= 0 && (u[i] & 0x007fffffu) != 0;
  } else {
    const uint16_t exponent = s.dtype == Dtype::bf16 ? 0x7f80 : 0x7c00;
    i = first_nonfinite<uint16_t>(s.u16.data(), static_cast<int64_t>(s.u16.size()), exponent);
    nan = i >= 0 && (s.u16[i] & static_cast<uint16_t>(~exponent & 0x7fff)) != 0;
  }
  if (i < 0) return;
  const int64_t t = i / s.cols, layer = (i % s.cols) / per_layer;
  throw InputError(path + ": dataset '" + dataset + "' has " + (nan ? "NaN" : "Inf") + " at layer " +
                   std::to_string(layer) + ", token " + std::to_string(t0 + t * stride));
}

}  // namespace

void read_block(ShardPairReader& r, const Rope& rs, const Rope& rt, const Calibration& cal, int64_t j0, int64_t rows,
                const std::vector<Kind>& kinds, bool weighted, const InputShifts* host, Block& b) {
  const int64_t stride = cal.cfg.calibration.token_stride, t0 = j0 * stride;
  const PairDims d = cal.dims();
  b.rows = rows;
  auto side = [&](ShardReader& sr, int64_t per_layer, int layers, Stored& k, Stored& v, std::vector<int32_t>& pos) {
    const std::string& path = sr.header().path;
    k.cols = v.cols = layers * per_layer;
    k.dtype = sr.read_stored("keys", t0, rows, stride, k.f32, k.u16);
    check_finite(k, rows, per_layer, path, "keys", t0, stride);
    v.dtype = sr.read_stored("values", t0, rows, stride, v.f32, v.u16);
    check_finite(v, rows, per_layer, path, "values", t0, stride);
    pos.resize(rows);
    sr.read_positions(t0, rows, stride, pos.data());
  };
  side(r.source, d.F(), d.Ls, b.sk, b.sv, b.spos);
  side(r.target, d.G(), d.Lt, b.tk, b.tv, b.tpos);
  b.sqrt_w.clear();
  b.weight_sum = 0;
  if (weighted) {
    b.sqrt_w.resize(static_cast<size_t>(rows));
    r.target.read_weights(t0, rows, stride, b.sqrt_w.data());
    for (float& w : b.sqrt_w) {  // read_weights refused negative and non-finite ones
      b.weight_sum += w;
      w = std::sqrt(w);
    }
  }
  if (!host) return;
  const float* scale = b.sqrt_w.empty() ? nullptr : b.sqrt_w.data();
  const ComputeBackend::Strip ss{&rs, b.spos.data()}, st{&rt, b.tpos.data()};
  for (Kind kind : kinds) {
    const size_t i = kind_index(kind);
    const bool strip = strips_rope(kind);
    prepare_on_host(b.source(kind).block(rows), strip ? &ss : nullptr, host->x[i], scale, b.x[i]);
    prepare_on_host(b.target(kind).block(rows), strip ? &st : nullptr, host->y[i], scale, b.y[i]);
  }
}


}  // namespace crosskv
