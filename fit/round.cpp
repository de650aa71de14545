#include "fit/round.hpp"

#include <algorithm>
#include <type_traits>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"


namespace crosskv {

size_t LiveState::floats(const Moments& m) {
  size_t n = 0;
  for (const auto& [b, at] : m.blocks_.live_layout()) n += b->size();
  return n;
}

size_t LiveState::doubles(const Moments& m) { return m.stats_done_ ? 0 : 1 + m.sum_x_.size() + 2 * m.sum_y_.size(); }

void LiveState::unpack_doubles(Moments& m, const double* d) {
  m.blocks_.touched();
  if (!m.stats_done_) {
    m.n_ = *d++;
    std::copy_n(d, m.sum_x_.size(), m.sum_x_.begin());
    d += m.sum_x_.size();
    std::copy_n(d, m.sum_y_.size(), m.sum_y_.begin());
    d += m.sum_y_.size();
    std::copy_n(d, m.sq_y_.size(), m.sq_y_.begin());
  }
}

void LiveState::pieces(Moments& m, std::vector<ComputeBackend::SumPiece<float>>& f,
                          std::vector<ComputeBackend::SumPiece<double>>& d) {
  m.blocks_.live_pieces(f, flat_size(f));
  if (m.stats_done_) return;
  int64_t d_at = flat_size(d);
  d.push_back({&m.n_, 1, 1, 1, d_at++});
  std::vector<double>* stats[3] = {&m.sum_x_, &m.sum_y_, &m.sq_y_};
  for (int i = 0; i < 3; ++i) {
    const auto n = static_cast<int64_t>(stats[i]->size());
    d.push_back({stats[i]->data(), 1, n, n, d_at});
    if (!m.held_stats_.empty()) d.back().held = m.held_stats_[i]->held();
    d_at += n;
  }
}

void LiveState::zero(Moments& m) {
  m.blocks_.zero_live();
  if (m.stats_done_) return;
  m.n_ = 0;
  if (m.held_stats_.empty()) {
    for (std::vector<double>* v : {&m.sum_x_, &m.sum_y_, &m.sq_y_}) std::fill(v->begin(), v->end(), 0.0);
    return;
  }
  for (auto& h : m.held_stats_) h->zero();
}

void reduce_round(const PassMoments& ms, Residency& be, Comm& readers, std::vector<float>& base_f,
                  std::vector<double>& base_d) {
  CROSSKV_ASSERT(readers.size() > 1, "one reader's share is its moments: nothing to reduce");
  std::vector<Residency::SumPiece<float>> fp;
  std::vector<Residency::SumPiece<double>> dp;
  ms.each([&](Moments& m) { LiveState::pieces(m, fp, dp); });
  auto reduce_into = [&](auto& base, const auto& pieces) {
    using T = typename std::decay_t<decltype(base)>::value_type;
    std::vector<T> part;
    readers.reduce_scatter_filled(
        static_cast<size_t>(flat_size(pieces)),
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
  reduce_into(base_f, fp);
  reduce_into(base_d, dp);
  ms.each([](Moments& m) { LiveState::zero(m); });
}

}  // namespace crosskv
