#include <algorithm>
#include <type_traits>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "stages/stages.hpp"

namespace crosskv {
namespace {

// Adds the flat values of `pieces` [0, n) into `share` (made from them when `first`), a segment at a time, read
// where they are (ComputeBackend::copy_sums): no packed copy of all n, and a device's sums are not flushed.
template <class T>
void add_into_share(ComputeBackend& be, const std::vector<ComputeBackend::SumPiece<T>>& pieces, size_t n,
                    std::vector<T>& share, bool first) {
  constexpr size_t kSegment = size_t{1} << 24;
  if (first) share.resize(n);
  std::vector<T> part(first ? 0 : std::min(n, kSegment));
  for (size_t off = 0; off < n; off += kSegment) {
    const size_t len = std::min(kSegment, n - off);
    T* dst = share.data() + off;
    be.copy_sums(pieces, static_cast<int64_t>(off), static_cast<int64_t>(len), first ? dst : part.data(), false);
    if (first) continue;
    const T* src = part.data();
#pragma omp parallel for schedule(static) if (len > (size_t{1} << 22))
    for (size_t i = 0; i < len; ++i) dst[i] += src[i];
  }
}

}  // namespace

void reduce_round(const std::vector<Moments*>& ms, ComputeBackend& be, Comm& readers, std::vector<float>& base_f,
                  std::vector<double>& base_d) {
  std::vector<ComputeBackend::SumPiece<float>> fp;
  std::vector<ComputeBackend::SumPiece<double>> dp;
  for (Moments* m : ms) m->live_pieces(fp, dp);
  const auto nf = static_cast<size_t>(flat_size(fp)), nd = static_cast<size_t>(flat_size(dp));
  if (readers.size() == 1) {
    // One reader: its share is every sum; the round's are added into it.
    const bool first = base_f.empty() && base_d.empty();
    add_into_share(be, fp, nf, base_f, first);
    add_into_share(be, dp, nd, base_d, first);
  } else {
    auto reduce_into = [&](auto& base, const auto& pieces, size_t n) {
      using T = typename std::decay_t<decltype(base)>::value_type;
      std::vector<T> part;
      readers.reduce_scatter_filled(
          n,
          [&](size_t off, size_t len, T* dst, bool on_device) {
            be.copy_sums(pieces, static_cast<int64_t>(off), static_cast<int64_t>(len), dst, on_device);
          },
          part);
      if (base.empty()) {
        base.swap(part);
        return;
      }
      T* b = base.data();
      const T* q = part.data();
      const size_t len = part.size();
#pragma omp parallel for schedule(static) if (len > (size_t{1} << 22))
      for (size_t i = 0; i < len; ++i) b[i] += q[i];
    };
    reduce_into(base_f, fp, nf);
    reduce_into(base_d, dp, nd);
  }
  for (Moments* m : ms) m->zero_live(be);
}

}  // namespace crosskv
