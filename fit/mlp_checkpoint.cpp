#include "fit/mlp_checkpoint.hpp"

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

std::string serialise_state(const MlpTrained& t) {
  ByteWriter w;
  const int64_t head[3] = {static_cast<int64_t>(t.epoch_mse.size()), t.steps,
                           static_cast<int64_t>(t.params.flat.size())};
  w.put(head, sizeof head);
  w.put(t.epoch_mse.data(), t.epoch_mse.size() * 8);
  for (const auto* v : {&t.params.flat, &t.adam_m, &t.adam_v}) w.put(v->data(), v->size() * 4);
  return std::move(w.bytes());
}

std::optional<MlpTrained> deserialise_state(const std::string& s, const MlpShape& shape) {
  ByteReader r(s, "a residual-MLP training state");
  int64_t head[3];
  r.get(head, sizeof head);
  const size_t n = static_cast<size_t>(shape.parameters());
  if (head[0] < 0 || head[2] != static_cast<int64_t>(n) ||
      s.size() != sizeof head + static_cast<size_t>(head[0]) * 8 + 3 * n * 4)
    return std::nullopt;
  MlpTrained t{MlpParams(shape), std::vector<double>(static_cast<size_t>(head[0])), head[1], {}, {}, false};
  t.adam_m.resize(n), t.adam_v.resize(n);
  r.get(t.epoch_mse.data(), t.epoch_mse.size() * 8);
  for (auto* v : {&t.params.flat, &t.adam_m, &t.adam_v}) r.get(v->data(), v->size() * 4);
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
