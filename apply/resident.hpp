#pragma once
// Applying a mapper for serving (issue 16): every layer's weights resident on the backend for the object's
// lifetime, every target layer in one call, and the caches in the backend's memory — a GPU's, for caches that live
// there (DLPack tensors from Python: no copy through the host) — or on the host. A batch of sequences is their
// tokens back to back, each token at its own position. The products are Transfer's, in Transfer's order (strip
// the source RoPE, per target layer: bias, one GEMM over the gathered source layers, the residual MLP, then the
// target RoPE), so on the CPU backend the two agree bit for bit; a device backend is held to the CPU within fp32
// tolerance.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/rope.hpp"
#include "io/mapper.hpp"

namespace crosskv {

// One call's arrays, all in the backend's memory (ResidentKernels::memory_on_device).
struct ResidentBatch {
  const float* keys = nullptr;    // [rows, Ls, Hs, Ds] as the source caches them: post-RoPE at source_positions
  const float* values = nullptr;  // [rows, Ls, Hs, Ds]
  const int32_t* source_positions = nullptr;  // [rows]
  const int32_t* target_positions = nullptr;  // [rows]
  int64_t rows = 0;
  float* out_keys = nullptr;    // [rows, Lt, Ht, Dt]: post-RoPE at target_positions
  float* out_values = nullptr;  // [rows, Lt, Ht, Dt]
};

class ResidentTransfer {
 public:
  // Reads the manifest and every layer file (each SHA-256 checked when `verify`) and moves the weights to `be`.
  ResidentTransfer(const std::string& mapper_dir, ComputeBackend& be, bool verify = true);
  // A mapper already in memory (benchmarks): `layers` in target-layer order.
  ResidentTransfer(MapperManifest m, std::vector<MapperLayer> layers, ComputeBackend& be);
  ResidentTransfer(const ResidentTransfer&) = delete;
  ResidentTransfer& operator=(const ResidentTransfer&) = delete;

  const MapperManifest& manifest() const { return m_; }
  const KvSpec& source() const { return m_.source; }
  const KvSpec& target() const { return m_.target; }
  ComputeBackend& backend() const { return be_; }
  int64_t weight_bytes() const { return weight_bytes_; }  // resident: ridge and MLP parameters, fp32

  // Arrays in the backend's memory. With a caller's stream (a cudaStream_t; 0 is the legacy default stream), the
  // work starts after what the stream holds when called and the stream's later work waits for it, with no wait on
  // the host (ResidentKernels::begin_after); without one, in the backend's own order. Asynchronous on a device.
  void apply(const ResidentBatch& b, std::optional<void*> stream = std::nullopt);
  // Host arrays (Transfer::apply's contract); copied to and from a device backend's memory, waited for.
  void apply_host(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos,
                  int64_t rows, float* out_keys, float* out_values);

 private:
  struct Kind {  // one kind (keys or values) of one target layer, in backend memory
    ResidentKernels::MemoryPtr w, b, mlp;
    MlpShape mlp_shape;
  };
  struct Layer {
    std::vector<int> source_layers;
    Kind k, v;
  };
  // A scratch array of at least `count` Ts (grown, contents not kept).
  template <class T>
  T* scratch(ResidentKernels::MemoryPtr& m, int64_t count);
  void upload(std::vector<MapperLayer> layers);
  Kind upload_kind(const std::vector<float>& w, const std::vector<float>& b, const MlpParams& mlp);
  void map_kind(const Layer& l, const Kind& kd, const float* X, int64_t rows, float* Y);

  MapperManifest m_;
  ComputeBackend& be_;
  Rope src_rope_, tgt_rope_;
  std::vector<Layer> layers_;
  int64_t weight_bytes_ = 0;
  ResidentKernels::MemoryPtr content_, gathered_, h1_, h2_, mlp_out_, io_;
};

}  // namespace crosskv
