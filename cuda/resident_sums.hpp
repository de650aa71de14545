#pragma once
// Sums kept on the device between blocks of rows (Residency): each host range's device copy is owned by its entry
// and released with it; the moments name a sum by its host address, and a C argument may be any part of a range.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "cuda/device_resources.hpp"

namespace crosskv::cuda {

template <class T>
class ResidentSums {
 public:
  explicit ResidentSums(const DeviceResources& r) : r_(r) {}

  // The device copy of host [p, p + count), or null when no resident range holds p.
  T* find(const T* p, int64_t count) const {
    auto it = containing(p);
    if (it == ranges_.end()) return nullptr;
    CROSSKV_ASSERT(p + count <= it->first + it->second.count,
                   "CUDA backend: a sum reaches beyond its resident range (" + dims({{"elements", count}}) + ")");
    return static_cast<T*>(it->second.dev) + (p - it->first);
  }
  // The device copy of host [p, p + count) when one range holds all of it, else null.
  T* find_whole(const T* p, int64_t count) const {
    auto it = containing(p);
    if (it == ranges_.end() || p + count > it->first + it->second.count) return nullptr;
    return static_cast<T*>(it->second.dev) + (p - it->first);
  }
  // Releases the range that starts at p, after the compute stream is done with it (false: none starts there).
  bool forget(const T* p) {
    auto it = ranges_.find(p);
    if (it == ranges_.end()) return false;
    CROSSKV_CUDA_CHECK(cudaStreamSynchronize(r_.compute()), r_.where(), "forget a kept range");
    ranges_.erase(it);
    return true;
  }
  // Host [p, p + count) made resident, its device copy zeroed (`host_is_zero`) or copied up; a range already
  // resident stays as it is.
  void keep(T* p, int64_t count, bool host_is_zero) {
    if (count > 0 && !find(p, count)) make(p, count, host_is_zero);
  }
  // The device copy of a C argument, made resident (copied up) at its first use.
  T* resident(T* p, int64_t count) {
    T* d = find(p, count);
    return d ? d : make(p, count, false);
  }
  // Every range's device copy back to its host array, in compute-stream order (the caller waits).
  void queue_write_back() const {
    for (const auto& [host, range] : ranges_)
      check(cudaMemcpyAsync(const_cast<T*>(host), range.dev, range.count * sizeof(T), cudaMemcpyDeviceToHost,
                            r_.compute()),
            range.count);
  }
  // Releases every range; the caller has waited for the compute stream.
  void clear() { ranges_.clear(); }
  // Flat values [off, off + len) of `pieces` to dst (device memory when dst_on_device): a resident piece from its
  // device copy, another from the host; returns when they are there.
  void copy_out(const std::vector<Residency::SumPiece<T>>& pieces, int64_t off, int64_t len, T* dst,
                bool dst_on_device) const {
    const std::string ops = dims({{"offset", off}, {"elements", len}});
    for_each_sum_run(pieces, off, len, [&](const T* src, int64_t ld, int64_t rows, int64_t cols, int64_t flat) {
      const T* from = find(src, (rows - 1) * ld + cols);
      T* to = dst + (flat - off);
      if (!from && !dst_on_device) {
        for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * ld, cols, to + r * cols);
        return;
      }
      CROSSKV_CUDA_CHECK(cudaMemcpy2DAsync(to, cols * sizeof(T), from ? from : src, ld * sizeof(T), cols * sizeof(T),
                                           rows, cudaMemcpyDefault, r_.compute()),
                         r_.where(), ops + ", run " + dims({{"rows", rows}, {"cols", cols}, {"ld", ld}}));
    });
    CROSSKV_CUDA_CHECK(cudaStreamSynchronize(r_.compute()), r_.where(), ops);
  }
  // Zero where current: on the device for a resident range, else on the host.
  void zero(T* p, int64_t count) {
    if (count <= 0) return;
    if (T* d = find(p, count))
      check(cudaMemsetAsync(d, 0, count * sizeof(T), r_.compute()), count);
    else
      std::fill_n(p, count, T{0});
  }

 private:
  struct Range {
    Range(int64_t n, const Where& w) : dev(static_cast<size_t>(n), w), count(n) {}
    DeviceArray<T> dev;
    int64_t count;
  };
  using Map = std::map<const T*, Range>;
  typename Map::const_iterator containing(const T* p) const {
    auto it = ranges_.upper_bound(p);
    if (it == ranges_.begin()) return ranges_.end();
    --it;
    return p < it->first + it->second.count ? it : ranges_.end();
  }
  // A new range's device copy, zeroed or copied up in compute-stream order.
  T* make(T* p, int64_t count, bool zero) {
    T* dev = add(p, count);
    if (zero)
      check(cudaMemsetAsync(dev, 0, count * sizeof(T), r_.compute()), count);
    else
      check(cudaMemcpyAsync(dev, p, count * sizeof(T), cudaMemcpyHostToDevice, r_.compute()), count);
    return dev;
  }
  T* add(T* p, int64_t count) {
    auto next = ranges_.upper_bound(p);
    CROSSKV_ASSERT(
        next == ranges_.end() || p + count <= next->first,
        "CUDA backend: a new resident range overlaps one already resident (" + dims({{"elements", count}}) + ")");
    auto [it, fresh] = ranges_.try_emplace(p, count, r_.where());
    return it->second.dev;
  }
  void check(cudaError_t e, int64_t count) const { CROSSKV_CUDA_CHECK(e, r_.where(), dims({{"elements", count}})); }

  const DeviceResources& r_;
  Map ranges_;
};

}  // namespace crosskv::cuda
