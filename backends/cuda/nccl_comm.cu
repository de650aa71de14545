// NCCL collectives behind the Comm interface. Buffers are host arrays, copied to the device, or (reduce_scatter_filled)
// segments the caller writes into device memory: a CUDA backend's resident sums, read in place. They are exchanged
// with grouped ncclSend/ncclRecv and summed in rank order by a kernel, so the result is the same as MpiComm's bit for
// bit and does not depend on NCCL's reduction algorithm. Barriers, votes and splits go through the host (MPI)
// communicator, which also carries the NCCL unique id.
#include <algorithm>
#include <vector>

#include "backends/backends.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "backends/cuda/cuda_check.hpp"
#include "backends/cuda/launch.hpp"
#include "backends/cuda/resources.hpp"

namespace crosskv {
namespace {

#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, where_, ops)

template <class T>
__global__ void sum_in_rank_order(const T* __restrict__ parts, int64_t count, int ranks, T* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
    T s = parts[i];
    for (int r = 1; r < ranks; ++r) s += parts[r * count + i];
    out[i] = s;
  }
}

template <class T>
ncclDataType_t nccl_type();
template <>
ncclDataType_t nccl_type<float>() { return ncclFloat32; }
template <>
ncclDataType_t nccl_type<double>() { return ncclFloat64; }

class NcclComm final : public Comm {
 public:
  NcclComm(std::unique_ptr<Comm> host, int device) : host_(std::move(host)), where_{host_->rank(), device} {
    CK(cudaSetDevice(device), "device " + std::to_string(device));
    stream_ = cuda::Stream(where_);
    ncclUniqueId id{};
    if (host_->rank() == 0) CK(ncclGetUniqueId(&id), "");
    host_->broadcast(&id, sizeof id, 0);
    ncclComm_t comm{};
    CK(ncclCommInitRank(&comm, host_->size(), id, host_->rank()),
       "ranks " + std::to_string(host_->size()) + ", rank " + std::to_string(host_->rank()));
    comm_ = cuda::NcclHandle::adopt(comm);
  }
  ~NcclComm() override {
    cudaStreamSynchronize(stream_);
    cudaFree(buf_);
  }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string name() const override { return "nccl"; }
  void barrier() override { host_->barrier(); }
  bool all_ok(bool ok) override { return host_->all_ok(ok); }
  std::unique_ptr<Comm> split(int color, int key) override {
    return std::make_unique<NcclComm>(host_->split(color, key), where_.device);
  }

  void broadcast(void* data, size_t bytes, int root) override {
    if (size() == 1 || bytes == 0) return;
    char* d = static_cast<char*>(device(bytes));
    const std::string ops = "bytes " + std::to_string(bytes) + ", root " + std::to_string(root);
    if (rank() == root) CK(cudaMemcpyAsync(d, data, bytes, cudaMemcpyHostToDevice, stream_), ops);
    CK(ncclBroadcast(d, d, bytes, ncclChar, root, comm_, stream_), ops);
    CK(cudaMemcpyAsync(data, d, bytes, cudaMemcpyDeviceToHost, stream_), ops);
    CK(cudaStreamSynchronize(stream_), ops);
  }
  void allreduce_sum(float* d, size_t n) override { allreduce(d, n); }
  void allreduce_sum(double* d, size_t n) override { allreduce(d, n); }
  void reduce_scatter_sum(const float* in, size_t n, std::vector<float>& c) override { scatter(n, from_host(in), c); }
  void reduce_scatter_sum(const double* in, size_t n, std::vector<double>& c) override { scatter(n, from_host(in), c); }
  // The caller writes each segment straight into the device buffer (a device backend's sums, read in place).
  void reduce_scatter_filled(size_t n, const Fill<float>& f, std::vector<float>& c) override { scatter(n, f, c); }
  void reduce_scatter_filled(size_t n, const Fill<double>& f, std::vector<double>& c) override { scatter(n, f, c); }
  void allgather(const std::vector<float>& c, float* out, size_t n) override { gather(c, out, n); }
  void allgather(const std::vector<double>& c, double* out, size_t n) override { gather(c, out, n); }

 private:
  void* device(size_t bytes) {
    if (bytes > cap_) {
      if (buf_) CK(cudaFree(buf_), "");
      buf_ = nullptr;
      CK(cudaMalloc(&buf_, bytes), "bytes " + std::to_string(bytes));
      cap_ = bytes;
    }
    return buf_;
  }

  // A host array as a fill: copied into the device buffer in stream order.
  template <class T>
  Fill<T> from_host(const T* in) {
    return [this, in](size_t off, size_t len, T* dst, bool dst_on_device) {
      if (!dst_on_device) return void(std::copy_n(in + off, len, dst));
      CK(cudaMemcpyAsync(dst, in + off, len * sizeof(T), cudaMemcpyHostToDevice, stream_),
         "segment of " + std::to_string(len) + " elements");
    };
  }

  template <class T>
  void scatter(size_t n, const Fill<T>& fill, std::vector<T>& chunk) {
    const int P = size(), me = rank();
    chunk.clear();
    if (P == 1) {
      chunk.resize(n);
      if (n > 0) fill(0, n, chunk.data(), false);
      return;
    }
    chunk.reserve(share_size(n, P, me));
    for (const ShareSegment& s : share_layout(n, P)) {
      const size_t c = static_cast<size_t>(s.counts[me]);
      // [segment | P received parts | summed part]
      T* d = static_cast<T*>(device((s.len + c * P + c) * sizeof(T)));
      T* parts = d + s.len;
      T* sum = parts + c * P;
      const std::string ops = "segment of " + std::to_string(s.len) + " elements";
      fill(s.off, s.len, d, true);  // a fill from another stream returns when its copies are done
      CK(ncclGroupStart(), ops);
      for (int r = 0; r < P; ++r) {
        CK(ncclSend(d + s.displs[r], s.counts[r], nccl_type<T>(), r, comm_, stream_), ops);
        CK(ncclRecv(parts + r * c, c, nccl_type<T>(), r, comm_, stream_), ops);
      }
      CK(ncclGroupEnd(), ops);
      if (c > 0) {
        const int threads = 256, blocks = static_cast<int>(std::min<size_t>((c + threads - 1) / threads, 4096));
        CK(cuda::launch(sum_in_rank_order<T>, blocks, threads, stream_, parts, static_cast<int64_t>(c), P, sum), ops);
      }
      const size_t at = chunk.size();
      chunk.resize(at + c);
      CK(cudaMemcpyAsync(chunk.data() + at, sum, c * sizeof(T), cudaMemcpyDeviceToHost, stream_), ops);
      CK(cudaStreamSynchronize(stream_), ops);
    }
  }

  template <class T>
  void gather(const std::vector<T>& chunk, T* out, size_t n) {
    const int P = size(), me = rank();
    if (P == 1) {
      std::copy(chunk.begin(), chunk.end(), out);
      return;
    }
    size_t at = 0;
    for (const ShareSegment& s : share_layout(n, P)) {
      const size_t c = static_cast<size_t>(s.counts[me]);
      T* d = static_cast<T*>(device(s.len * sizeof(T)));
      const std::string ops = "segment of " + std::to_string(s.len) + " elements";
      CK(cudaMemcpyAsync(d + s.displs[me], chunk.data() + at, c * sizeof(T), cudaMemcpyHostToDevice, stream_), ops);
      CK(ncclGroupStart(), ops);
      for (int r = 0; r < P; ++r) {
        if (r == me) continue;
        CK(ncclSend(d + s.displs[me], c, nccl_type<T>(), r, comm_, stream_), ops);
        CK(ncclRecv(d + s.displs[r], s.counts[r], nccl_type<T>(), r, comm_, stream_), ops);
      }
      CK(ncclGroupEnd(), ops);
      CK(cudaMemcpyAsync(out + s.off, d, s.len * sizeof(T), cudaMemcpyDeviceToHost, stream_), ops);
      CK(cudaStreamSynchronize(stream_), ops);
      at += c;
    }
  }

  template <class T>
  void allreduce(T* d, size_t n) {
    if (size() == 1) return;
    std::vector<T> chunk;
    scatter(n, from_host(static_cast<const T*>(d)), chunk);
    gather(chunk, d, n);
  }

  std::unique_ptr<Comm> host_;
  cuda::Where where_;
  // Declared in this order so that the communicator goes before its stream.
  cuda::Stream stream_;
  cuda::NcclHandle comm_;
  void* buf_ = nullptr;
  size_t cap_ = 0;
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, int device) {
  return std::make_unique<NcclComm>(std::move(host), device);
}
bool nccl_compiled_in() { return true; }

}  // namespace crosskv
