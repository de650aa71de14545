#include "fit/mlp_checkpoint.hpp"

#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/sealed_file.hpp"
#include "core/bytes.hpp"
#include "core/error.hpp"
#include "core/sha256.hpp"
#include "runtime/log.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

constexpr const char* kFormat = "crosskv-mlp-checkpoint";
constexpr int kVersion = 2;

}  // namespace

// A training state's fields (core/bytes.hpp): the epochs, steps and parameter count, then the epochs' MSE, the
// parameters and Adam's two moments at those lengths.
template <class T, class IO>
void state_fields(T& t, IO& io, int64_t epochs, int64_t n) {
  io(epochs, t.steps, n);
  io.fixed(t.epoch_mse, static_cast<size_t>(epochs));
  for (auto* v : {&t.params.flat, &t.adam_m, &t.adam_v}) io.fixed(*v, static_cast<size_t>(n));
}

std::string serialise_state(const MlpTrained& t) {
  ByteWriter w;
  state_fields(t, w, static_cast<int64_t>(t.epoch_mse.size()), static_cast<int64_t>(t.params.flat.size()));
  return std::move(w.bytes());
}

std::optional<MlpTrained> deserialise_state(const std::string& s, const MlpShape& shape) {
  int64_t head[3] = {-1, 0, -1};  // epochs, steps, parameters: checked before anything is sized by them
  if (s.size() >= sizeof head) std::memcpy(head, s.data(), sizeof head);
  const size_t n = static_cast<size_t>(shape.parameters());
  if (head[0] < 0 || head[2] != static_cast<int64_t>(n) ||
      s.size() != sizeof head + static_cast<size_t>(head[0]) * 8 + 3 * n * 4)
    return std::nullopt;
  MlpTrained t{MlpParams(shape), {}, 0, {}, {}, false};
  ByteReader r(s, "a residual-MLP training state");
  state_fields(t, r, head[0], head[2]);
  return t;
}

MlpCheckpoint::MlpCheckpoint(const std::string& ckpt_dir, const std::string& k, const nlohmann::json& identity)
    : dir_((fs::path(ckpt_dir) / "mlp").string()), k_(k), identity_(identity) {}

std::string MlpCheckpoint::path(int l, Kind kind, const char* what) const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "k%s-layer-%03d-%s.%s", k_.c_str(), l, kind_name(kind), what);
  return (fs::path(dir_) / buf).string();
}

void MlpCheckpoint::write(const std::string& file, const std::string& payload) const {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw SystemError("cannot create " + dir_ + ": " + ec.message());
  write_sealed(file, {kFormat, kVersion, identity_}, payload);
}

std::optional<std::string> MlpCheckpoint::read(const std::string& file) const {
  std::string why;
  std::optional<std::string> payload = read_sealed(file, {kFormat, kVersion, identity_}, &why);
  if (!payload && why != "missing" && why != "of another identity") spdlog::warn("{}: {}; not used", file, why);
  return payload;
}

std::optional<std::string> read_on_root(Comm& comm, const MlpCheckpoint& ck, const std::string& file) {
  std::optional<std::string> got;
  if (comm.rank() == 0) got = ck.read(file);
  if (!comm.all_ok(comm.rank() != 0 || got.has_value())) return std::nullopt;
  std::string s = got.value_or(std::string());
  broadcast_string(comm, s, 0);
  return s;
}

}  // namespace crosskv
