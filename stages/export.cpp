#include "stages/export.hpp"

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "core/backend.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/half.hpp"
#include "core/kv_spec.hpp"
#include "core/sha256.hpp"
#include "io/atomic_file.hpp"
#include "io/safetensors.hpp"

namespace fs = std::filesystem;

namespace crosskv {

nlohmann::json nan_to_null(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x));
  return a;
}

namespace {

struct Converted {
  std::string dtype;
  std::vector<uint16_t> half;
  const void* data;
  size_t bytes;
};

Converted convert(ComputeBackend& be, const std::vector<float>& w, WeightDtype d) {
  Converted c;
  if (d == WeightDtype::fp32) {
    c.dtype = "F32";
    c.data = w.data();
    c.bytes = w.size() * 4;
    return c;
  }
  c.dtype = d == WeightDtype::bf16 ? "BF16" : "F16";
  c.half.resize(w.size());
  be.to_half(w.data(), static_cast<int64_t>(w.size()), d == WeightDtype::bf16, c.half.data());
  c.data = c.half.data();
  c.bytes = c.half.size() * 2;
  return c;
}

std::string layer_file(int l) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "layer-%03d.safetensors", l);
  return buf;
}

}  // namespace

ArtifactWriter::ArtifactWriter(const Calibration& cal, const FitPlan& plan, ComputeBackend& be, int rank)
    : cal_(cal), plan_(plan), be_(be), layers_(plan.ks.size(), nlohmann::json::array()), rank_(rank) {}

std::string ArtifactWriter::final_dir(const KPlan& k) const { return (fs::path(cal_.cfg.output_dir) / ("k" + k.label)).string(); }
std::string ArtifactWriter::partial_dir(const KPlan& k) const { return final_dir(k) + ".partial"; }

void ArtifactWriter::written() {
  if (fault("kill_in_export", ++files_, rank_)) std::raise(SIGKILL);
}

void ArtifactWriter::begin() {
  for (const auto& k : plan_.ks) {
    std::error_code ec;
    fs::remove_all(partial_dir(k), ec);
    fs::create_directories(partial_dir(k), ec);
    if (ec) throw InputError("output.dir: cannot create " + partial_dir(k) + ": " + ec.message());
  }
}

void ArtifactWriter::write_layer(int l, const std::vector<LayerFit>& fk, const std::vector<LayerFit>& fv) {
  const PairDims d = plan_.dims;
  for (size_t i = 0; i < plan_.ks.size(); ++i) {
    const KPlan& k = plan_.ks[i];
    CROSSKV_ASSERT(fk[i].k == k.count && fv[i].k == k.count && fk[i].layers == fv[i].layers, "fit/plan mismatch");
    const Converted wk = convert(be_, fk[i].W, cal_.cfg.dtype), wv = convert(be_, fv[i].W, cal_.cfg.dtype);
    const std::vector<int64_t> wshape = {k.features, d.G()}, bshape = {d.G()};
    std::string layers_csv;
    for (int a : fk[i].layers) layers_csv += (layers_csv.empty() ? "" : ",") + std::to_string(a);
    const std::string file = layer_file(l);
    const std::string path = (fs::path(partial_dir(k)) / file).string();
    write_safetensors(path,
                      {{"k.weight", wk.dtype, wshape, wk.data, wk.bytes},
                       {"k.bias", "F32", bshape, fk[i].b.data(), fk[i].b.size() * 4},
                       {"v.weight", wv.dtype, wshape, wv.data, wv.bytes},
                       {"v.bias", "F32", bshape, fv[i].b.data(), fv[i].b.size() * 4}},
                      {{"format", "crosskv-mapper"}, {"target_layer", std::to_string(l)}, {"source_layers", layers_csv}});
    written();
    layers_[i].push_back({{"target_layer", l},
                          {"source_layers", fk[i].layers},
                          {"file", file},
                          {"sha256", sha256_file(path)},
                          {"r2_k", nan_to_null(fk[i].r2)},
                          {"r2_v", nan_to_null(fv[i].r2)}});
  }
}

void ArtifactWriter::add_layer_entries(const nlohmann::json& per_k) {
  CROSSKV_ASSERT(per_k.size() == layers_.size(), "layer entries for a different k list");
  for (size_t i = 0; i < layers_.size(); ++i)
    for (const auto& e : per_k[i]) layers_[i].push_back(e);
}

std::vector<std::string> ArtifactWriter::finish(const nlohmann::json& extra) {
  for (auto& list : layers_)
    std::sort(list.begin(), list.end(),
              [](const nlohmann::json& a, const nlohmann::json& b) { return a["target_layer"] < b["target_layer"]; });
  std::vector<std::string> out;
  const auto& c = cal_.cfg;
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& s : cal_.shards)
    shards.push_back({{"path", s.rel}, {"domain", s.domain}, {"tokens", s.rows}, {"tokens_used", s.used},
                      {"fingerprint_sha256", s.fingerprint}});
  for (size_t i = 0; i < plan_.ks.size(); ++i) {
    const KPlan& k = plan_.ks[i];
    nlohmann::json m = {
        {"format", "crosskv-mapper"},
        {"format_version", 1},
        {"tool", {{"name", "crosskv"}, {"version", CROSSKV_VERSION}}},
        {"source", {{"model", cal_.source_model}, {"kv_spec", kv_spec_to_json(cal_.source)}}},
        {"target", {{"model", cal_.target_model}, {"kv_spec", kv_spec_to_json(cal_.target)}}},
        {"fit",
         {{"k", k.label == "all" ? nlohmann::json("all") : nlohmann::json(k.count)},
          {"k_count", k.count},
          {"features", k.features},
          {"lambda", c.lambda},
          {"lambda_scale", "covariance"},
          {"probe", to_string(c.probe)},
          {"dtype", to_string(c.dtype)},
          {"content_space", true},
          {"params", k.params},
          {"bias_params", k.bias_params}}},
        {"layers", layers_[i]},
        {"calibration",
         {{"domains", cal_.domains},
          {"weights", c.weights},
          {"shards", shards},
          {"tokens_used", cal_.tokens_used},
          {"token_stride", c.token_stride},
          {"max_tokens", c.max_tokens ? nlohmann::json(*c.max_tokens) : nlohmann::json(nullptr)}}}};
    for (auto it = extra.begin(); it != extra.end(); ++it) m[it.key()] = it.value();
    write_file_atomic((fs::path(partial_dir(k)) / "manifest.json").string(), m.dump(2) + "\n");
    std::error_code ec;
    fs::remove_all(final_dir(k), ec);
    fs::rename(partial_dir(k), final_dir(k), ec);
    if (ec) throw SystemError("rename " + partial_dir(k) + " -> " + final_dir(k) + ": " + ec.message());
    fsync_dir(c.output_dir);
    out.push_back(final_dir(k));
    written();
  }
  return out;
}

}  // namespace crosskv
