#pragma once
// Sums held on the device between blocks of rows (Residency::HeldSums): each handle owns its device copy and names
// it; nothing is looked up by host address.
#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "backends/cuda/device_resources.hpp"

namespace crosskv::cuda {

// A held range's device copy, made (zeroed or copied up) and used in compute-stream order.
template <class T>
class DeviceSums final : public Residency::HeldSums<T> {
 public:
  static std::unique_ptr<DeviceSums> make(const DeviceResources& r, T* host, int64_t count, bool host_is_zero) {
    DeviceArray<T> dev(static_cast<size_t>(std::max<int64_t>(count, 1)), r.where());
    auto h = std::unique_ptr<DeviceSums>(new DeviceSums(r, host, count, std::move(dev)));
    if (host_is_zero)
      h->zero();
    else
      h->check(cudaMemcpyAsync(h->dev_, host, count * sizeof(T), cudaMemcpyHostToDevice, r.compute()), "copy up");
    return h;
  }
  ~DeviceSums() override { cudaStreamSynchronize(r_.compute()); }  // then dev_ is freed
  void to_host() override {
    check(cudaMemcpyAsync(this->host(), dev_, this->count() * sizeof(T), cudaMemcpyDeviceToHost, r_.compute()),
          "to the host");
    check(cudaStreamSynchronize(r_.compute()), "to the host");
  }
  void zero() override { check(cudaMemsetAsync(dev_, 0, this->count() * sizeof(T), r_.compute()), "zero"); }

 private:
  DeviceSums(const DeviceResources& r, T* host, int64_t count, DeviceArray<T> dev)
      : Residency::HeldSums<T>(host, static_cast<T*>(dev), count), r_(r), dev_(std::move(dev)) {}
  void check(cudaError_t e, const char* what) const {
    CROSSKV_CUDA_CHECK(e, r_.where(), std::string("held sums, ") + what + ", " + dims({{"elements", this->count()}}));
  }
  const DeviceResources& r_;
  DeviceArray<T> dev_;
};

// Flat values [off, off + len) of `pieces` to dst (device memory when dst_on_device), each from where it is current:
// a held piece from its device copy, another from the host. Returns when they are there.
template <class T>
void copy_current_sums(const DeviceResources& r, const std::vector<Residency::SumPiece<T>>& pieces, int64_t off,
                       int64_t len, T* dst, bool dst_on_device) {
  const std::string ops = dims({{"offset", off}, {"elements", len}});
  for_each_sum_run(
      pieces, off, len, [&](const Residency::SumPiece<T>& q, int64_t e, int64_t rows, int64_t cols, int64_t flat) {
        T* to = dst + (flat - off);
        if (!q.held && !dst_on_device) {
          for (int64_t i = 0; i < rows; ++i) std::copy_n(q.host + e + i * q.ld, cols, to + i * cols);
          return;
        }
        CROSSKV_CUDA_CHECK(cudaMemcpy2DAsync(to, cols * sizeof(T), q.current() + e, q.ld * sizeof(T), cols * sizeof(T),
                                             rows, cudaMemcpyDefault, r.compute()),
                           r.where(), ops + ", run " + dims({{"rows", rows}, {"cols", cols}, {"ld", q.ld}}));
      });
  CROSSKV_CUDA_CHECK(cudaStreamSynchronize(r.compute()), r.where(), ops);
}

}  // namespace crosskv::cuda
