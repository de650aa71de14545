#pragma once
// Applying a mapper: the one apply behind every caller (serving, crosskv-apply, the eval, the MLP stage). The
// weights of a window of target layers (every layer by default) are resident on the backend for the object's
// lifetime, and the caches are in the backend's memory (a GPU's, for caches that live there: DLPack tensors from
// Python, no copy through the host) or on the host (the *_host calls). A batch of sequences is their tokens back to
// back, each token at its own position. Per kind, one call sets every layer's bias, the selected source layers of a
// chunk of target layers are gathered in one call and multiplied in one batched GEMM (k = all needs no gather: every
// layer reads the cache as it is), each layer's residual MLP (core/mlp's forward) on the input its product read, then
// the target RoPE. A device backend is held to the CPU within fp32 tolerance. One call at a time per object (its
// scratch is shared): callers on several threads take turns, as the Python Mapper's do.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/rope.hpp"
#include "artifact/mapper.hpp"

namespace crosskv {

// Target layers [first, first + count) of a mapper (count -1: to the last). A call given a range writes outputs
// that hold those layers alone: [rows, count, Ht, Dt]. Layer by layer, a serving stack maps layer l while the model
// computes the layers before it.
struct TargetLayers {
  int first = 0, count = -1;
  int end(int n_layers) const { return count < 0 ? n_layers : first + count; }
  int size(int n_layers) const { return end(n_layers) - first; }
};
// InputError naming `layers` unless the range is a non-empty part of [0, n_layers).
void check_target_layers(const TargetLayers& r, int n_layers);

// Target KV heads [first, first + count) (count -1: to the last): the heads one tensor-parallel worker of a serving
// engine holds. A mapper restricted to them computes their output columns alone ([rows, Lt, count, Dt]).
struct TargetHeads {
  int first = 0, count = -1;
  int end(int n_heads) const { return count < 0 ? n_heads : first + count; }
  int size(int n_heads) const { return end(n_heads) - first; }
};
// InputError naming `target_heads` unless the range is a non-empty part of [0, n_heads).
void check_target_heads(const TargetHeads& r, int n_heads);

// The index of the first NaN or infinity in x[0, n), or -1: a source cache that holds one would map to wrong KV.
// Memory-bound (every value read once, the exponents OR-ed 4096 at a time), a few percent of a mapping's time.
int64_t first_non_finite(const float* x, int64_t n);
// A serving call's caches checked, so that it fails closed: keys and values finite. Throws InputError naming the
// argument and the element ("keys: element 17 (token 0) is NaN"). (Positions are checked where they are cast.)
void check_finite_caches(const float* keys, const float* values, int64_t values_per_token, int64_t rows);

// One source slot j of a per_head layer's product, as one GEMM batched over the heads: for every head h of
// [h0, h0 + n), Y[:, (h-h0)*Dt..] += X[:, a*F + h*Ds..] W[h-h0][j*Ds.., :] (a the slot's source layer, F = heads*Ds;
// X row stride XW, Y row stride YW; W [n][k*Ds x Dt]). The k slots in turn, after the bias, are the layer's product:
// nothing is gathered. `only` (default: every head) is a tensor-parallel worker's heads.
DenseMaths::BatchedGemm per_head_slot(const float* X, int64_t XW, int a, int j, int k, int heads, int64_t Ds,
                                      int64_t Dt, const float* W, int64_t rows, float* Y, int64_t YW,
                                      TargetHeads only = {});

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
  bool target_rope = true;      // false leaves the mapped keys in content space: the "- inference RoPE" ablation
};

// The mapping in content space (RoPE-free on both sides), in the backend's memory. A null input or output skips
// that kind.
struct ContentBatch {
  // [rows, Ls * F]: every source layer (keys RoPE-stripped). With `gathered`, [rows, k * F]: the window's one
  // target layer's selected source layers side by side, as the fit's stages hold them.
  const float* keys = nullptr;
  const float* values = nullptr;
  int64_t rows = 0;
  float* out_keys = nullptr;    // [rows, layers.count * G]
  float* out_values = nullptr;
  TargetLayers layers;
  bool gathered = false;
  bool residual_mlp = true;  // false: the ridge alone (the eval's baseline for a mapper with MLPs)
};

class ServingMapper {
 public:
  // Reads the manifest and the window's layer files (each SHA-256 checked when `verify`) and moves the weights to
  // `be`. With `heads`, only those target KV heads' weights are kept and mapped (a tensor-parallel worker's): the
  // outputs are then [rows, Lt, heads.count, Dt], equal to those heads of the whole mapping. With `window`, only
  // those target layers are held, and calls may name only them (Transfer streams a mapper a layer at a time).
  ServingMapper(const std::string& mapper_dir, ServingKernels& be, bool verify = true, TargetHeads heads = {},
                TargetLayers window = {});
  // A mapper already in memory: `layers` are the window's, in target-layer order.
  ServingMapper(MapperManifest m, std::vector<MapperLayer> layers, ServingKernels& be, TargetHeads heads = {},
                TargetLayers window = {});
  ServingMapper(const ServingMapper&) = delete;
  ServingMapper& operator=(const ServingMapper&) = delete;

  const MapperManifest& manifest() const { return m_; }
  const KvSpec& source() const { return m_.source; }
  const KvSpec& target() const { return m_.target; }
  ServingKernels& backend() const { return be_; }
  TargetHeads heads() const { return heads_; }  // the target KV heads mapped: {first, count}, count resolved
  TargetLayers window() const { return window_; }  // the target layers held: {first, count}, count resolved
  int64_t weight_bytes() const { return weight_bytes_; }  // resident: ridge and MLP parameters, fp32
  // The cap on the gathered source layers of one batched product (default 256 MiB): below it, fewer target layers
  // per product; at least one.
  void set_gather_bytes(int64_t bytes) { gather_bytes_ = bytes; }

  // Arrays in the backend's memory. With a caller's stream (a cudaStream_t; 0 is the legacy default stream), the
  // work starts after what the stream holds when called and the stream's later work waits for it, with no wait on
  // the host (ServingKernels::begin_after); without one, in the backend's own order. Asynchronous on a device.
  void apply(const ServingBatch& b, std::optional<void*> stream = std::nullopt);
  // Host arrays; copied to and from a device backend's memory, waited for.
  void apply_host(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos,
                  int64_t rows, float* out_keys, float* out_values, TargetLayers layers = {},
                  bool target_rope = true);
  // Content space: arrays in the backend's memory, or (map_content_host) host arrays.
  void map_content(const ContentBatch& b);
  void map_content_host(const ContentBatch& b);

 private:
  struct Kind {  // keys or values of the window's target layers, in backend memory
    ServingKernels::MemoryPtr w;             // [n][K x G]: window layer i's weights at i*K*G
    ServingKernels::MemoryPtr b;             // [n * G]: a row of the output's width
    std::vector<ServingKernels::MemoryPtr> mlp;  // per layer: its residual MLP's parameters, or null
    std::vector<MlpShape> mlp_shape;
  };
  // A scratch array of at least `count` Ts (grown, contents not kept).
  template <class T>
  T* scratch(ServingKernels::MemoryPtr& m, int64_t count);
  void upload(std::vector<MapperLayer> layers, TargetHeads heads, TargetLayers window);
  TargetLayers checked(TargetLayers layers) const;  // resolved, and inside the window
  // Target layers [l0, l1) of one kind into Y [rows x (l1 - l0) * G]; X [rows x XW].
  void map_kind(const Kind& kd, const float* X, int64_t XW, bool gathered, bool with_mlp, int64_t rows, int l0,
                int l1, float* Y);
  void add_mlp(const MlpShape& s, const float* p, const float* X, int64_t rows, float* Y, int64_t ldy);

  MapperManifest m_;
  ServingKernels& be_;
  Rope src_rope_, tgt_rope_;
  TargetLayers window_;                     // resolved: count >= 1
  std::vector<std::vector<int>> selected_;  // per window layer, its source layers
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
