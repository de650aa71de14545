// crosskv._crosskv: the apply layer (serve/serving_mapper, serve/transfer) for Python. transfer(): float32/int32
// C-contiguous CPU arrays of any framework that speaks DLPack or the buffer protocol (numpy, torch CPU tensors:
// zero-copy) in, numpy arrays that own their memory out. transfer_into(): CUDA arrays (DLPack: torch, CuPy, JAX)
// in and out, read and written in place on the mapper's GPU, ordered on the caller's stream. The GIL is released
// while a transfer runs; calls on one mapper from several threads take turns.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>


#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include <nlohmann/json.hpp>

#include "serve/serving_mapper.hpp"
#include "serve/transfer.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "backends/backends.hpp"
#include "core/sha256.hpp"
#include "core/blas_kernels.hpp"
#include "core/error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace crosskv {
namespace {

using Cache = nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using Positions = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out = nb::ndarray<nb::numpy, float, nb::ndim<4>>;
using DeviceCache = nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cuda>;
using DeviceOut = nb::ndarray<float, nb::ndim<4>, nb::c_contig, nb::device::cuda>;
using DevicePositions = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cuda>;

std::string shape_of(size_t n, const size_t* shape) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// InputError unless `a` is [rows, L, H, D] of spec `s` (L: `layers` when given, else the spec's).
template <class A>
void check_cache(const char* name, const A& a, size_t rows, const KvSpec& s, const char* side, int layers = -1) {
  const size_t want[4] = {rows, static_cast<size_t>(layers < 0 ? s.n_layers : layers),
                          static_cast<size_t>(s.n_kv_heads), static_cast<size_t>(s.head_dim)};
  const size_t got[4] = {a.shape(0), a.shape(1), a.shape(2), a.shape(3)};
  if (!std::equal(want, want + 4, got)) {
    std::string w = shape_of(4, want);
    if (a.shape(0) == rows) w = "[tokens" + w.substr(w.find(','));  // the leading dimension is not what is wrong
    throw InputError(std::string(name) + ": expected shape " + w + " (the mapper's " + side + "), got " +
                     shape_of(4, got));
  }
}

Out owned(size_t rows, const KvSpec& s, int layers) {
  const size_t shape[4] = {rows, static_cast<size_t>(layers), static_cast<size_t>(s.n_kv_heads),
                           static_cast<size_t>(s.head_dim)};
  float* data = new float[rows * shape[1] * shape[2] * shape[3]];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return Out(data, 4, shape, owner);
}

// -1 for the CPU, else the CUDA device's index.
int device_index(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) == 0 && device.size() > 5 &&
      device.find_first_not_of("0123456789", 5) == std::string::npos)
    return std::stoi(device.substr(5));
  throw ConfigError("device: expected cpu, cuda or cuda:N, got \"" + device + "\"");
}

std::unique_ptr<ComputeBackend> backend_for(const std::string& device, int index, bool tf32) {
  if (index < 0) return make_cpu_backend();
  if (!cuda_compiled_in())
    throw ConfigError("device: " + device + ": this crosskv package was built without CUDA (pip install . -C "
                      "cmake.define.CROSSKV_CUDA=ON)");
  if (index >= cuda_device_count())
    throw ConfigError("device: " + device + ": no such CUDA device here (" + std::to_string(cuda_device_count()) +
                      " present)");
  return make_cuda_backend(index, 0, tf32);
}

// A kv_spec as crosskv.kvspec reads a model config: the shape, every RoPE parameter (None where unset), each layer's
// attention and RoPE where they differ (`layers`), and the flat rope_type and rope_theta.
nb::dict spec_dict(const KvSpec& s) {
  nb::dict d = nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(kv_spec_to_string(s)));
  d["rope_type"] = s.rope.type, d["rope_theta"] = s.rope.theta;
  return d;
}

// A mapper folder (k<K>/) loaded for applying. resident: every layer's weights in the backend's memory (a GPU's for
// cuda) for the object's lifetime, all layers in one call (ServingMapper); else one layer at a time (Transfer).
// Each layer file's SHA-256 is checked when first read.
class PyMapper {
 public:
  PyMapper(const std::string& path, const std::string& device, bool resident, bool verify, bool tf32,
           int first_head, int head_count)
      : device_(device_index(device)), be_(backend_for(device, device_, tf32)) {
    if (resident) {
      resident_ = std::make_unique<ServingMapper>(path, *be_, verify, TargetHeads{first_head, head_count});
      out_ = resident_->target();
      out_.n_kv_heads = resident_->heads().count;
    } else {
      if (first_head != 0 || head_count != -1)
        throw InputError("target_heads: a subset of the target's heads needs a resident mapper (resident=True)");
      TransferOptions o;
      o.verify = verify;
      streamed_ = std::make_unique<Transfer>(path, *be_, o);
      out_ = streamed_->target();
    }
  }

  const MapperManifest& manifest() const { return resident_ ? resident_->manifest() : streamed_->manifest(); }

  // Target layers [first_layer, first_layer + layer_count) (-1: to the last); the outputs hold those alone.
  nb::tuple transfer(const Cache& keys, const Cache& values, const Positions& src_pos, const Positions& tgt_pos,
                     int first_layer, int layer_count) {
    const KvSpec &s = manifest().source, &t = out_;
    const TargetLayers layers{first_layer, layer_count};
    check_target_layers(layers, t.n_layers);
    const size_t rows = keys.shape(0);
    check_cache("keys", keys, rows, s, "source");
    check_cache("values", values, rows, s, "source");
    check_positions(src_pos.shape(0), tgt_pos.shape(0), rows);
    Out k = owned(rows, t, layers.size(t.n_layers)), v = owned(rows, t, layers.size(t.n_layers));
    {
      nb::gil_scoped_release unlocked;
      check_finite_caches(keys.data(), values.data(), int64_t{s.n_layers} * s.n_kv_heads * s.head_dim,
                          static_cast<int64_t>(rows));
      std::lock_guard<std::mutex> one_at_a_time(busy_);
      if (resident_)
        resident_->apply_host(keys.data(), values.data(), src_pos.data(), tgt_pos.data(), static_cast<int64_t>(rows),
                              k.data(), v.data(), layers);
      else
        streamed_->apply(keys.data(), values.data(), src_pos.data(), tgt_pos.data(), static_cast<int64_t>(rows),
                         k.data(), v.data(), layers);
    }
    return nb::make_tuple(k, v);
  }

  // CUDA arrays on this mapper's GPU, read and written in place; ordered after the work `stream` (a cudaStream_t
  // as an integer: torch.cuda.current_stream().cuda_stream) holds now, and the stream's later work after it.
  void transfer_into(const DeviceCache& keys, const DeviceCache& values, const DevicePositions& src_pos,
                     const DevicePositions& tgt_pos, DeviceOut& out_keys, DeviceOut& out_values, uintptr_t stream,
                     int first_layer, int layer_count) {
    if (device_ < 0 || !resident_)
      throw InputError(std::string("keys: CUDA arrays need a resident mapper on their GPU (Mapper(path, "
                                   "device='cuda:N')); this one is ") +
                       (device_ < 0 ? "on the CPU" : "not resident"));
    for (auto [name, id] : {std::pair{"keys", keys.device_id()}, std::pair{"values", values.device_id()},
                            std::pair{"source_positions", src_pos.device_id()},
                            std::pair{"target_positions", tgt_pos.device_id()},
                            std::pair{"out_keys", out_keys.device_id()},
                            std::pair{"out_values", out_values.device_id()}})
      if (id != device_)
        throw InputError(std::string(name) + ": on cuda:" + std::to_string(id) + ", the mapper is on cuda:" +
                         std::to_string(device_));
    const KvSpec &s = manifest().source, &t = out_;
    const TargetLayers layers{first_layer, layer_count};
    check_target_layers(layers, t.n_layers);
    const size_t rows = keys.shape(0);
    check_cache("keys", keys, rows, s, "source");
    check_cache("values", values, rows, s, "source");
    check_cache("out_keys", out_keys, rows, t, "target", layers.size(t.n_layers));
    check_cache("out_values", out_values, rows, t, "target", layers.size(t.n_layers));
    check_positions(src_pos.shape(0), tgt_pos.shape(0), rows);
    ServingBatch b;
    b.keys = keys.data(), b.values = values.data(), b.rows = static_cast<int64_t>(rows);
    b.source_positions = src_pos.data(), b.target_positions = tgt_pos.data();
    b.out_keys = out_keys.data(), b.out_values = out_values.data(), b.layers = layers;
    nb::gil_scoped_release unlocked;
    std::lock_guard<std::mutex> one_at_a_time(busy_);
    resident_->apply(b, reinterpret_cast<void*>(stream));
  }

  nb::dict source() const { return spec_dict(manifest().source); }
  nb::dict target() const { return spec_dict(manifest().target); }
  std::string source_model() const { return manifest().source_model; }
  std::string target_model() const { return manifest().target_model; }
  int k() const { return manifest().k_count; }
  std::string structure() const { return to_string(manifest().structure); }
  std::string path() const { return manifest().dir; }
  std::string backend() const { return be_->name(); }
  std::vector<int> heads() const {  // [first, end) of the target heads this mapper maps
    const int first = resident_ ? resident_->heads().first : 0;
    return {first, first + out_.n_kv_heads};
  }
  bool resident() const { return resident_ != nullptr; }
  int64_t weight_bytes() const { return resident_ ? resident_->weight_bytes() : 0; }
  std::vector<std::vector<int>> source_layers() const {
    std::vector<std::vector<int>> out;
    for (const auto& e : manifest().layers) out.push_back(e.source_layers);
    return out;
  }

 private:
  static void check_positions(size_t src, size_t tgt, size_t rows) {
    if (src != rows || tgt != rows)
      throw InputError("positions: expected " + std::to_string(rows) + " (one per token), got " +
                       std::to_string(src) + " and " + std::to_string(tgt));
  }

  int device_;
  std::unique_ptr<ComputeBackend> be_;
  std::unique_ptr<ServingMapper> resident_;
  std::unique_ptr<Transfer> streamed_;
  KvSpec out_;  // the outputs' spec: the target's, with the heads mapped
  std::mutex busy_;  // the transfers share the mapper's scratch: threads take turns (the GIL is released first)
};

// A mapper folder's manifest as a dict, without loading a weight.
nb::dict manifest_dict(const std::string& dir) {
  const MapperManifest mm = read_mapper_manifest(dir);
  nb::dict d;
  d["source"] = spec_dict(mm.source), d["target"] = spec_dict(mm.target);
  d["source_model"] = mm.source_model, d["target_model"] = mm.target_model;
  d["source_weights"] = mm.source_weights.empty() ? nb::none() : nb::cast(mm.source_weights);
  d["target_weights"] = mm.target_weights.empty() ? nb::none() : nb::cast(mm.target_weights);
  d["structure"] = to_string(mm.structure), d["k"] = mm.k_count;
  return d;
}

using Weights = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Bias = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using SyntheticLayer = std::tuple<std::vector<int>, Weights, Bias, Weights, Bias>;  // (source layers, k_w, k_b, v_w, v_b)

// A mapper folder of the given weights, written by artifact/'s own writer, fit.synthetic set.
void write_synthetic_mapper(const std::string& dir, const std::string& source_spec, const std::string& target_spec,
                            const std::string& source_model, const std::string& target_model,
                            const std::vector<SyntheticLayer>& layers) {
  const KvSpec S = parse_kv_spec(source_spec, "source kv_spec"), T = parse_kv_spec(target_spec, "target kv_spec");
  if (static_cast<int>(layers.size()) != T.n_layers)
    throw InputError("layers: expected one per target layer (" + std::to_string(T.n_layers) + "), got " +
                     std::to_string(layers.size()));
  const int k = static_cast<int>(std::get<0>(layers.at(0)).size());
  const int64_t F = S.features_per_layer(), G = T.features_per_layer();
  std::vector<ManifestLayer> entries;
  for (int l = 0; l < T.n_layers; ++l) {
    const auto& [sel, wk, bk, wv, bv] = layers[l];
    const int64_t K = static_cast<int64_t>(sel.size()) * F;
    if (static_cast<int>(sel.size()) != k || wk.shape(0) != static_cast<size_t>(K) ||
        wk.shape(1) != static_cast<size_t>(G) || wv.shape(0) != wk.shape(0) || wv.shape(1) != wk.shape(1) ||
        bk.shape(0) != static_cast<size_t>(G) || bv.shape(0) != static_cast<size_t>(G))
      throw InputError("layers[" + std::to_string(l) + "]: expected " + std::to_string(k) +
                       " source layers, weights [" + std::to_string(K) + ", " + std::to_string(G) +
                       "] and biases [" + std::to_string(G) + "]");
    LayerFileContent c;
    c.target_layer = l, c.source_layers = sel, c.features = K, c.G = G;
    c.kinds.k.weight = wk.data(), c.kinds.k.bias = bk.data(), c.kinds.v.weight = wv.data(), c.kinds.v.bias = bv.data();
    const std::string file = layer_file_name(l), path = dir + "/" + file;
    write_layer_file(path, c);
    entries.push_back({l, sel, file, sha256_file(path), {}, {}, {}, {}});
  }
  ManifestFit fit;
  fit.k_label = k == S.n_layers ? "all" : std::to_string(k), fit.k_count = k, fit.features = int64_t{k} * F;
  fit.params = 2 * fit.features * G * T.n_layers, fit.bias_params = 2 * G * T.n_layers;
  fit.probe = "none", fit.dtype = "fp32", fit.synthetic = true;
  write_manifest(dir, source_model, S, target_model, T, fit, entries, ManifestCalibration{});
}

}  // namespace
}  // namespace crosskv

NB_MODULE(_crosskv, m) {
  using crosskv::PyMapper;
  const crosskv::BlasKernels& blas = crosskv::select_blas_kernels();  // at import, before any BLAS call
  m.attr("blas") = blas.summary();
  m.attr("blas_warning") = blas.warning;
  m.doc() = "crosskv's apply layer: a fitted mapper turns a source model's KV cache into the target model's";
  m.attr("__version__") = CROSSKV_VERSION;
  m.attr("cuda_compiled_in") = crosskv::cuda_compiled_in();
  nb::exception<crosskv::UserError>(m, "MapperError", PyExc_ValueError);
  m.def("read_manifest", &crosskv::manifest_dict, "mapper_dir"_a,
        "A mapper folder's manifest, read and validated as crosskv-fit's readers do, without loading a weight: "
        "{source, target (kv_specs), source_model, target_model, structure, k}");
  m.def("write_synthetic_mapper", &crosskv::write_synthetic_mapper, "dir"_a, "source_spec"_a, "target_spec"_a,
        "source_model"_a, "target_model"_a, "layers"_a,
        "A mapper folder of the given weights written by crosskv's own writer (artifact/): one (source_layers, "
        "k_weight [K, G], k_bias [G], v_weight, v_bias) per target layer, kv_specs as JSON text; fit.synthetic is "
        "set. For timing at a model's real shape without a fit.");
  nb::class_<PyMapper>(m, "_Mapper")
      .def(nb::init<const std::string&, const std::string&, bool, bool, bool, int, int>(), "path"_a,
           "device"_a = "cpu", "resident"_a = true, "verify"_a = true, "tf32"_a = false, "first_head"_a = 0,
           "head_count"_a = -1)
      .def("transfer", &PyMapper::transfer, "keys"_a, "values"_a, "source_positions"_a, "target_positions"_a,
           "first_layer"_a = 0, "layer_count"_a = -1,
           "keys, values: float32 [tokens, Ls, Hs, Ds] as the source caches them (keys post-RoPE at "
           "source_positions); returns the target's (keys, values) [tokens, Lt, Ht, Dt], keys post-RoPE at "
           "target_positions")
      .def("transfer_into", &PyMapper::transfer_into, "keys"_a, "values"_a, "source_positions"_a,
           "target_positions"_a, "out_keys"_a, "out_values"_a, "stream"_a = 0, "first_layer"_a = 0,
           "layer_count"_a = -1,
           "CUDA arrays on the mapper's GPU: transfer() in place, ordered on `stream` (a cudaStream_t as an int)")
      .def_prop_ro("source", &PyMapper::source)
      .def_prop_ro("target", &PyMapper::target)
      .def_prop_ro("source_model", &PyMapper::source_model)
      .def_prop_ro("target_model", &PyMapper::target_model)
      .def_prop_ro("k", &PyMapper::k)
      .def_prop_ro("structure", &PyMapper::structure)
      .def_prop_ro("path", &PyMapper::path)
      .def_prop_ro("backend", &PyMapper::backend)
      .def_prop_ro("heads", &PyMapper::heads)
      .def_prop_ro("resident", &PyMapper::resident)
      .def_prop_ro("weight_bytes", &PyMapper::weight_bytes)
      .def_prop_ro("source_layers", &PyMapper::source_layers);
}
