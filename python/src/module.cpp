// crosskv._crosskv: the apply layer (apply/transfer) for Python. Arrays in are float32/int32 C-contiguous CPU arrays
// of any framework that speaks DLPack or the buffer protocol (numpy, torch CPU tensors: zero-copy); arrays out are
// numpy arrays that own their memory. The GIL is released while a transfer runs.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <spdlog/spdlog.h>

#include <memory>
#include <string>

#include "apply/transfer.hpp"
#include "backends/backends.hpp"
#include "core/error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace crosskv {
namespace {

using Cache = nb::ndarray<const float, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using Positions = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Out = nb::ndarray<nb::numpy, float, nb::ndim<4>>;

Out owned(size_t rows, const KvSpec& s) {
  const size_t shape[4] = {rows, static_cast<size_t>(s.n_layers), static_cast<size_t>(s.n_kv_heads),
                           static_cast<size_t>(s.head_dim)};
  float* data = new float[rows * shape[1] * shape[2] * shape[3]];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return Out(data, 4, shape, owner);
}

std::unique_ptr<ComputeBackend> backend_for(const std::string& device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend(0);
  if (device.rfind("cuda:", 0) == 0) return make_cuda_backend(std::stoi(device.substr(5)));
  throw ConfigError("device: expected cpu, cuda or cuda:N, got \"" + device + "\"");
}

nb::dict spec_dict(const KvSpec& s) {
  nb::dict d;
  d["n_layers"] = s.n_layers, d["n_kv_heads"] = s.n_kv_heads, d["head_dim"] = s.head_dim;
  d["n_q_heads"] = s.n_q_heads, d["rope_type"] = s.rope.type, d["rope_theta"] = s.rope.theta;
  return d;
}

// A mapper folder (k<K>/) loaded for applying: its weights resident for the object's lifetime (on a CUDA backend in
// device memory too) unless resident=False, each file's SHA-256 checked when first read.
class PyMapper {
 public:
  PyMapper(const std::string& path, const std::string& device, bool resident, bool verify)
      : device_(device), be_(backend_for(device)) {
    TransferOptions o;
    o.resident = resident, o.verify = verify;
    tr_ = std::make_unique<Transfer>(path, *be_, o);
  }

  nb::tuple transfer(const Cache& keys, const Cache& values, const Positions& src_pos, const Positions& tgt_pos) {
    const KvSpec &s = tr_->source(), &t = tr_->target();
    const size_t rows = keys.shape(0);
    for (auto [name, a] : {std::pair{"keys", &keys}, std::pair{"values", &values}})
      if (a->shape(0) != rows || a->shape(1) != static_cast<size_t>(s.n_layers) ||
          a->shape(2) != static_cast<size_t>(s.n_kv_heads) || a->shape(3) != static_cast<size_t>(s.head_dim))
        throw InputError(std::string(name) + ": expected shape [tokens, " + std::to_string(s.n_layers) + ", " +
                         std::to_string(s.n_kv_heads) + ", " + std::to_string(s.head_dim) +
                         "] (the mapper's source), got [" + std::to_string(a->shape(0)) + ", " +
                         std::to_string(a->shape(1)) + ", " + std::to_string(a->shape(2)) + ", " +
                         std::to_string(a->shape(3)) + "]");
    if (src_pos.shape(0) != rows || tgt_pos.shape(0) != rows)
      throw InputError("positions: expected " + std::to_string(rows) + " (one per token), got " +
                       std::to_string(src_pos.shape(0)) + " and " + std::to_string(tgt_pos.shape(0)));
    Out k = owned(rows, t), v = owned(rows, t);
    {
      nb::gil_scoped_release unlocked;
      tr_->apply(keys.data(), values.data(), src_pos.data(), tgt_pos.data(), static_cast<int64_t>(rows), k.data(),
                 v.data());
    }
    return nb::make_tuple(k, v);
  }

  nb::dict source() const { return spec_dict(tr_->source()); }
  nb::dict target() const { return spec_dict(tr_->target()); }
  std::string source_model() const { return tr_->manifest().source_model; }
  std::string target_model() const { return tr_->manifest().target_model; }
  int k() const { return tr_->manifest().k_count; }
  std::string path() const { return tr_->manifest().dir; }
  std::string backend() const { return be_->name(); }
  std::vector<std::vector<int>> source_layers() const {
    std::vector<std::vector<int>> out;
    for (const auto& e : tr_->manifest().layers) out.push_back(e.source_layers);
    return out;
  }

 private:
  std::string device_;
  std::unique_ptr<ComputeBackend> be_;
  std::unique_ptr<Transfer> tr_;
};

}  // namespace
}  // namespace crosskv

NB_MODULE(_crosskv, m) {
  using crosskv::PyMapper;
  spdlog::set_level(spdlog::level::warn);
  m.doc() = "crosskv's apply layer: a fitted mapper turns a source model's KV cache into the target model's";
  m.attr("__version__") = CROSSKV_VERSION;
  m.attr("cuda_compiled_in") = crosskv::cuda_compiled_in();
  nb::exception<crosskv::UserError>(m, "MapperError", PyExc_ValueError);
  nb::class_<PyMapper>(m, "_Mapper")
      .def(nb::init<const std::string&, const std::string&, bool, bool>(), "path"_a, "device"_a = "cpu",
           "resident"_a = true, "verify"_a = true)
      .def("transfer", &PyMapper::transfer, "keys"_a, "values"_a, "source_positions"_a, "target_positions"_a,
           "keys, values: float32 [tokens, Ls, Hs, Ds] as the source caches them (keys post-RoPE at "
           "source_positions); returns the target's (keys, values) [tokens, Lt, Ht, Dt], keys post-RoPE at "
           "target_positions")
      .def_prop_ro("source", &PyMapper::source)
      .def_prop_ro("target", &PyMapper::target)
      .def_prop_ro("source_model", &PyMapper::source_model)
      .def_prop_ro("target_model", &PyMapper::target_model)
      .def_prop_ro("k", &PyMapper::k)
      .def_prop_ro("path", &PyMapper::path)
      .def_prop_ro("backend", &PyMapper::backend)
      .def_prop_ro("source_layers", &PyMapper::source_layers);
}
