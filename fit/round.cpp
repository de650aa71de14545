#include "fit/round.hpp"

#include <algorithm>
#include <type_traits>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"


namespace crosskv {

void reduce_round(const std::vector<Moments*>& ms, Residency& be, Comm& readers, std::vector<float>& base_f,
                  std::vector<double>& base_d) {
  CROSSKV_ASSERT(readers.size() > 1, "one reader's share is its moments: nothing to reduce");
  std::vector<Residency::SumPiece<float>> fp;
  std::vector<Residency::SumPiece<double>> dp;
  for (Moments* m : ms) m->live_pieces(fp, dp);
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
  for (Moments* m : ms) m->zero_live();
}

}  // namespace crosskv
