#pragma once
// Applying a mapper for serving (issue 16): every layer's weights resident on the backend for the object's
// lifetime, every target layer in one call, and the caches in the backend's memory — a GPU's, for caches that live
// there (DLPack tensors from Python: no copy through the host) — or on the host. A batch of sequences is their
// tokens back to back, each token at its own position. Per kind, one call sets every layer's bias, the selected
// source layers of a chunk of target layers are gathered in one call and multiplied in one batched GEMM (k = all
// needs no gather: every layer reads the cache as it is), each layer's residual MLP on the input its product read,
// then the target RoPE. Each layer's product is Transfer's (the same operands and shapes), so on the CPU backend the
// two agree bit for bit; a device backend is held to the CPU within fp32 tolerance. One call at a time per object
// (its scratch is shared): callers on several threads take turns, as the Python Mapper's do.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/rope.hpp"
#include "artifact/mapper.hpp"
#include "serve/transfer.hpp"

namespace crosskv {

// One call's arrays, all in the backend's memory (ServingKernels::memory_on_device).
struct ServingBatch {
  const float* keys = nullptr;    // [rows, Ls, Hs, Ds] as the source caches them: post-RoPE at source_positions
  const float* values = nullptr;  // [rows, Ls, Hs, Ds]
  const int32_t* source_positions = nullptr;  // [rows]
  const int32_t* target_positions = nullptr;  // [rows]
  int64_t rows = 0;
  float* out_keys = nullptr;    // [rows, Lt, Ht, Dt]: post-RoPE at target_positions
  float* out_values = nullptr;  // [rows, Lt, Ht, Dt]
  TargetLayers layers;          // only these target layers: the outputs are then [rows, layers.count, Ht, Dt]
};

class ServingMapper {
 public:
  // Reads the manifest and every layer file (each SHA-256 checked when `verify`) and moves the weights to `be`.
  // With `heads`, only those target KV heads' weights are kept and mapped (a tensor-parallel worker's): the outputs
  // are then [rows, Lt, heads.count, Dt], equal to those heads of the whole mapping.
  ServingMapper(const std::string& mapper_dir, ServingKernels& be, bool verify = true, TargetHeads heads = {});
  // A mapper already in memory (benchmarks): `layers` in target-layer order.
  ServingMapper(MapperManifest m, std::vector<MapperLayer> layers, ServingKernels& be, TargetHeads heads = {});
  ServingMapper(const ServingMapper&) = delete;
  ServingMapper& operator=(const ServingMapper&) = delete;

  const MapperManifest& manifest() const { return m_; }
  const KvSpec& source() const { return m_.source; }
  const KvSpec& target() const { return m_.target; }
  ServingKernels& backend() const { return be_; }
  TargetHeads heads() const { return heads_; }  // the target KV heads mapped: {first, count}, count resolved
  int64_t weight_bytes() const { return weight_bytes_; }  // resident: ridge and MLP parameters, fp32
  // The cap on the gathered source layers of one batched product (default 256 MiB): below it, fewer target layers
  // per product; at least one.
  void set_gather_bytes(int64_t bytes) { gather_bytes_ = bytes; }

  // Arrays in the backend's memory. With a caller's stream (a cudaStream_t; 0 is the legacy default stream), the
  // work starts after what the stream holds when called and the stream's later work waits for it, with no wait on
  // the host (ServingKernels::begin_after); without one, in the backend's own order. Asynchronous on a device.
  void apply(const ServingBatch& b, std::optional<void*> stream = std::nullopt);
  // Host arrays (Transfer::apply's contract); copied to and from a device backend's memory, waited for.
  void apply_host(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos,
                  int64_t rows, float* out_keys, float* out_values, TargetLayers layers = {});

 private:
  struct Kind {  // keys or values of every target layer, in backend memory
    ServingKernels::MemoryPtr w;             // [Lt][K x G]: layer l's weights at l*K*G
    ServingKernels::MemoryPtr b;             // [Lt * G]: a row of the output's width
    std::vector<ServingKernels::MemoryPtr> mlp;  // per layer: its residual MLP's parameters, or null
    std::vector<MlpShape> mlp_shape;
  };
  // A scratch array of at least `count` Ts (grown, contents not kept).
  template <class T>
  T* scratch(ServingKernels::MemoryPtr& m, int64_t count);
  void upload(std::vector<MapperLayer> layers, TargetHeads heads);
  // Target layers [l0, l1) of one kind into Y [rows x (l1 - l0) * G].
  void map_kind(const Kind& kd, const float* X, int64_t rows, int l0, int l1, float* Y);
  void add_mlp(const MlpShape& s, const float* p, const float* X, int64_t rows, float* Y, int64_t ldy);

  MapperManifest m_;
  ServingKernels& be_;
  Rope src_rope_, tgt_rope_;
  std::vector<std::vector<int>> selected_;  // per target layer, its source layers
  int64_t k_ = 0;                           // source layers per target layer (the same for every one)
  bool all_layers_ = false;                 // every target layer reads every source layer: X is its input as is
  bool per_head_ = false;                   // head-matched weights: [Ht][k*Ds x Dt] per layer
  TargetHeads heads_;                       // the target heads mapped (all by default)
  int64_t G_ = 0;                           // output features per layer: heads_.count * Dt
  Kind keys_, values_;
  int64_t weight_bytes_ = 0;
  int64_t gather_bytes_ = int64_t{256} << 20;
  ServingKernels::MemoryPtr content_, gathered_, h1_, h2_, mlp_out_, io_;
};

}  // namespace crosskv
