#include <type_traits>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/log.hpp"
#include "stages/stages.hpp"

namespace crosskv {

double reduce_round(const std::vector<Moments*>& ms, ComputeBackend& be, Comm& readers, std::vector<float>& base_f,
                    std::vector<double>& base_d) {
  size_t nf = 0, nd = 0;
  for (const Moments* m : ms) {
    nf += m->live_floats();
    nd += m->live_doubles();
  }
  if (readers.size() == 1) {
    // One reader: the round's sums are added straight into its share (packed into it in the first round).
    const auto t0 = std::chrono::steady_clock::now();
    be.flush();
    const double flush_s = seconds_since(t0);
    const bool first = base_f.empty() && base_d.empty();
    base_f.resize(nf);
    base_d.resize(nd);
    float* pf = base_f.data();
    double* pd = base_d.data();
    for (Moments* m : ms) {
      first ? m->pack_live(pf, pd) : m->add_live_to(pf, pd);
      pf += m->live_floats();
      pd += m->live_doubles();
      m->zero_live(be);
    }
    return flush_s;
  }
  std::vector<ComputeBackend::SumPiece<float>> fp;
  std::vector<ComputeBackend::SumPiece<double>> dp;
  int64_t f_at = 0, d_at = 0;
  for (const Moments* m : ms) {
    m->live_pieces(fp, dp, f_at, d_at);
    f_at += static_cast<int64_t>(m->live_floats());
    d_at += static_cast<int64_t>(m->live_doubles());
  }
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
    for (size_t i = 0; i < part.size(); ++i) base[i] += part[i];
  };
  reduce_into(base_f, fp, nf);
  reduce_into(base_d, dp, nd);
  for (Moments* m : ms) m->zero_live(be);
  return 0.0;
}

}  // namespace crosskv
