#include "fit/shifts.hpp"

#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/sealed_file.hpp"
#include "fit/block_reader.hpp"
#include "fit/checkpoint.hpp"
#include "runtime/log.hpp"

namespace crosskv {
namespace {

std::vector<float> column_means(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<double> s(cols, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) s[c] += v[t * cols + c];
  std::vector<float> m(cols);
  for (int64_t c = 0; c < cols; ++c) m[c] = static_cast<float>(s[c] / rows);
  return m;
}

}  // namespace

Shifts compute_shifts(const Calibration& cal) {
  const ShardPair& p = cal.shift_shard;
  ShardPairReader r{&p, ShardReader(p.source_path), ShardReader(p.target_path)};
  Rope rs(cal.source, p.source_path), rt(cal.target, p.target_path);
  const int64_t rows = std::min<int64_t>(cal.cfg.runtime.block_tokens, p.used);
  Block b;
  const InputShifts none{};
  // Any shift serves; this one does not depend on the weighting (or need the shift shard to carry weights).
  const std::vector<Kind> kinds(kAllKinds.begin(), kAllKinds.end());
  read_block(r, rs, rt, cal, 0, rows, kinds, /*weighted=*/false, &none, b);
  const PairDims d = cal.dims();
  Shifts s;
  for (Kind kind : kAllKinds) {
    const size_t i = kind_index(kind);
    s[kind] = {column_means(b.x[i], rows, d.X()), column_means(b.y[i], rows, d.Y())};
  }
  return s;
}

namespace {

namespace fs = std::filesystem;

// shifts.bin: a sealed file (core/sealed_file.hpp) of the shift shard's identity; its payload is each kind's source
// and target shifts (fp32), in kAllKinds order.
SealId shift_seal(const Calibration& cal) {
  const ShardPair& p = cal.shift_shard;
  return {"crosskv-shifts", 2,
          {{"shard", p.rel}, {"source", p.source_path}, {"target", p.target_path}, {"used", p.used},
           {"stamps", {file_stamp(p.source_path), file_stamp(p.target_path)}}, {"block_tokens", cal.cfg.runtime.block_tokens},
           {"token_stride", cal.cfg.calibration.token_stride}}};
}

std::string shifts_file(const std::string& ckpt_dir) { return (fs::path(ckpt_dir) / "shifts.bin").string(); }

// The shifts in `path` when it holds those of this shard, whole; nullopt otherwise (missing, another shard, damaged).
std::optional<Shifts> read_kept_shifts(const std::string& path, const SealId& id, const PairDims& d) {
  SealedReader in(path, id);
  if (!in.ok()) return std::nullopt;
  Shifts s;
  for (Shift& k : s.by_kind)
    for (auto [v, size] : {std::pair{&k.x, d.X()}, std::pair{&k.y, d.Y()}}) {
      v->resize(static_cast<size_t>(size));
      if (!in.read(v->data(), v->size() * sizeof(float))) return std::nullopt;
    }
  if (const std::string why = in.finish(); !why.empty()) {
    spdlog::warn("{}: {}; the shifts are computed again", path, why);
    return std::nullopt;
  }
  return s;
}

void keep_shifts(const std::string& path, const SealId& id, const Shifts& s) {
  SealedWriter f(path, id);
  for (const Shift& k : s.by_kind)
    for (const auto* v : {&k.x, &k.y}) f.write(v->data(), v->size() * sizeof(float));
  f.commit();
}

}  // namespace

std::string kept_shift_shard(const std::string& ckpt_dir) {
  const nlohmann::json h = read_seal(shifts_file(ckpt_dir));
  const nlohmann::json id = h.is_object() ? h["identity"] : nlohmann::json();
  return id.is_object() && id.contains("shard") && id["shard"].is_string() ? id["shard"].get<std::string>() : "";
}

Shifts provisional_shifts(const Calibration& cal, const std::string& ckpt_dir, bool writer, bool fresh) {
  const std::string path = shifts_file(ckpt_dir);
  const SealId id = shift_seal(cal);
  if (auto kept = fresh ? std::nullopt : read_kept_shifts(path, id, cal.dims())) return *kept;
  Shifts s = compute_shifts(cal);
  if (writer) {
    std::error_code ec;
    fs::create_directories(ckpt_dir, ec);
    try {
      keep_shifts(path, id, s);
    } catch (const std::exception& e) {  // the fit goes on; a refit then reads the shift shard again
      spdlog::warn("could not keep the provisional shifts in {}: {}", path, e.what());
    }
  }
  return s;
}

}  // namespace crosskv
