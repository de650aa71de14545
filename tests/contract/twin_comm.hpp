#pragma once
// TwinComm: a two-rank comm seen from rank 0, whose partner holds the same sums, for checking a round's reduction
// without a second rank (tests/cuda/test_cuda.cpp).
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/comm.hpp"

namespace crosskv::test {

// Rank 0 of two whose partner holds the same sums: its share of a reduce-scatter is twice its part of the values
// (exact in floating point). With `device_buffers` it hands its segments out as a device comm does.
class TwinComm final : public Comm {
 public:
  explicit TwinComm(bool device_buffers) : device_(device_buffers) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string name() const override { return "twin"; }
  void reduce_scatter_sum(const float* in, size_t n, std::vector<float>& c) override { twice(in, n, c); }
  void reduce_scatter_sum(const double* in, size_t n, std::vector<double>& c) override { twice(in, n, c); }
  void reduce_scatter_filled(size_t n, const Fill<float>& f, std::vector<float>& c) override { filled(n, f, c); }
  void reduce_scatter_filled(size_t n, const Fill<double>& f, std::vector<double>& c) override { filled(n, f, c); }
  int segments = 0;
  // Not used by a round's end.
  void allreduce_sum(float*, size_t) override { ADD_FAILURE(); }
  void allreduce_sum(double*, size_t) override { ADD_FAILURE(); }
  void broadcast(void*, size_t, int) override { ADD_FAILURE(); }
  void barrier() override { ADD_FAILURE(); }
  bool all_ok(bool ok) override { return ok; }
  void allgather(const std::vector<float>&, float*, size_t) override { ADD_FAILURE(); }
  void allgather(const std::vector<double>&, double*, size_t) override { ADD_FAILURE(); }
  std::unique_ptr<Comm> split(int, int) override { return nullptr; }

 private:
  template <class T>
  void twice(const T* in, size_t n, std::vector<T>& chunk) {
    chunk.clear();
    for (const ShareSegment& s : share_layout(n, 2))
      for (int i = 0; i < s.counts[0]; ++i) chunk.push_back(2 * in[s.off + s.displs[0] + i]);
  }
  template <class T>
  void filled(size_t n, const Fill<T>& fill, std::vector<T>& chunk) {
    if (!device_) return Comm::reduce_scatter_filled(n, fill, chunk);
    chunk.clear();
    for (const ShareSegment& s : share_layout(n, 2)) {
      std::vector<T> seg(s.len, std::numeric_limits<T>::quiet_NaN());  // "device memory": every value written
      fill(s.off, s.len, seg.data(), true);
      ++segments;
      for (int i = 0; i < s.counts[0]; ++i) chunk.push_back(2 * seg[s.displs[0] + i]);
    }
  }
  bool device_;
};

}  // namespace crosskv::test
