#include "fit/export.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "core/backend.hpp"
#include "core/host_kernels.hpp"
#include "core/error.hpp"
#include "runtime/fault.hpp"
#include "core/half.hpp"
#include "core/kv_spec.hpp"
#include "runtime/log.hpp"
#include "core/sha256.hpp"
#include "core/atomic_file.hpp"
#include "core/sealed_file.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "artifact/mapper.hpp"
#include "core/bytes.hpp"

namespace fs = std::filesystem;

namespace crosskv {


namespace {

// Inside a k<K>.partial folder: the per-layer records of an export in progress, and its identity (sealed files).
fs::path records_in(const std::string& partial_dir) { return fs::path(partial_dir) / ".layers"; }
std::string identity_file(const std::string& record_dir) { return (fs::path(record_dir) / "identity").string(); }
// A layer file's record: its manifest entry (with the file's SHA-256).
std::string record_file(const std::string& record_dir, const std::string& layer_file) {
  return (fs::path(record_dir) / (layer_file + ".record")).string();
}
SealId export_seal(const nlohmann::json& identity) { return {"crosskv-export", 1, identity}; }
SealId record_seal(const nlohmann::json& identity) { return {"crosskv-export-record", 1, identity}; }

// Files an interrupted atomic write left ("<name>.tmp-<pid>").
void remove_temporaries(const std::string& dir) {
  for (const auto& p : remove_files_matching(dir, ".*\\.tmp-[0-9]+"))
    spdlog::warn("removed {}: a temporary file of an interrupted export", p);
}

// Leaves in `dir` only the files named in `keep`: a finished k<K>/ holds exactly its manifest's files.
void keep_only(const std::string& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  std::vector<fs::path> extra;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (!keep.count(e.path().filename().string())) extra.push_back(e.path());
  for (const auto& p : extra) {
    fs::remove_all(p, ec);
    spdlog::warn("removed {}: not a file of the mapper", p.string());
  }
}

}  // namespace

ArtifactWriter::ArtifactWriter(const Calibration& cal, const FitPlan& plan, int rank)
    : cal_(cal), plan_(plan), layers_(plan.slots()), rank_(rank) {}

std::string ArtifactWriter::final_dir(size_t slot) const {
  return (fs::path(cal_.cfg.output.dir) / plan_.slot_folder(slot)).string();
}
std::string ArtifactWriter::partial_dir(size_t slot) const { return final_dir(slot) + ".partial"; }

void ArtifactWriter::written() {
  fault_point("kill_in_export", ++files_, rank_);
}

std::string ArtifactWriter::record_dir(size_t slot) const { return records_in(partial_dir(slot)).string(); }

void ArtifactWriter::begin(const nlohmann::json& identity) {
  identity_ = identity;
  for (size_t slot = 0; slot < plan_.slots(); ++slot) {
    const std::string idfile = identity_file(record_dir(slot));
    if (read_sealed(idfile, export_seal(identity))) {  // an interrupted export of this job: its layers stand, its temporaries go
      remove_temporaries(partial_dir(slot));
      remove_temporaries(record_dir(slot));
      continue;
    }
    std::error_code ec;
    fs::remove_all(partial_dir(slot), ec);
    fs::create_directories(record_dir(slot), ec);
    if (ec) throw InputError("output.dir: cannot create " + record_dir(slot) + ": " + ec.message());
    write_sealed(idfile, export_seal(identity), "");
  }
}

bool ArtifactWriter::resume_layer(int l) {
  std::vector<ManifestLayer> entries;
  for (size_t slot = 0; slot < plan_.slots(); ++slot) {
    const auto rec = read_sealed(record_file(record_dir(slot), layer_file_name(l)), record_seal(identity_));
    if (!rec) return false;
    std::optional<ManifestLayer> e = parse_manifest_layer_text(*rec);
    if (!e || e->target_layer != l) return false;
    const std::string file = (fs::path(partial_dir(slot)) / layer_file_name(l)).string();
    std::error_code ec;
    if (!fs::is_regular_file(file, ec) || sha256_file(file) != e->sha256) return false;
    entries.push_back(std::move(*e));
  }
  std::lock_guard<std::mutex> lk(m_);
  for (size_t i = 0; i < entries.size(); ++i) layers_[i].push_back(std::move(entries[i]));
  return true;
}

ArtifactWriter::~ArtifactWriter() {
  {
    std::lock_guard<std::mutex> lk(m_);
    closing_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ArtifactWriter::write_layer(int l, std::vector<LayerFit> fk, std::vector<LayerFit> fv,
                                 std::optional<ManifestLambda> lambda) {
  CROSSKV_ASSERT(fk.size() == plan_.slots() && fv.size() == plan_.slots(), "fit/plan mismatch");
  Job job;
  job.l = l;
  for (size_t i = 0; i < plan_.slots(); ++i)
    CROSSKV_ASSERT(fk[i].k == plan_.slot_k(i).count && fv[i].k == plan_.slot_k(i).count &&
                       fk[i].structure == plan_.slot_structure(i) && fv[i].structure == plan_.slot_structure(i) &&
                       fk[i].layers == fv[i].layers,
                   "fit/plan mismatch");
  job.fk = std::move(fk);
  job.fv = std::move(fv);
  job.lambda = std::move(lambda);
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lk(m_);
  cv_.wait(lk, [&] { return queue_.empty() || error_; });
  wait_s_ += seconds_since(t0);
  if (error_) std::rethrow_exception(error_);
  queue_.push_back(std::move(job));
  if (!thread_.joinable()) thread_ = std::thread([this] { run_writer(); });
  cv_.notify_all();
}

void ArtifactWriter::run_writer() {
  std::unique_lock<std::mutex> lk(m_);
  for (;;) {
    cv_.wait(lk, [&] { return !queue_.empty() || closing_; });
    if (queue_.empty()) return;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    cv_.notify_all();
    lk.unlock();
    std::exception_ptr e;
    const auto t0 = std::chrono::steady_clock::now();
    try {
      write_job(job);
    } catch (...) {
      e = std::current_exception();
    }
    lk.lock();
    write_s_ += seconds_since(t0);
    busy_ = false;
    if (e && !error_) error_ = e;
    if (error_) queue_.clear();
    cv_.notify_all();
  }
}

void ArtifactWriter::drain() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lk(m_);
  cv_.wait(lk, [&] { return (queue_.empty() && !busy_) || error_; });
  wait_s_ += seconds_since(t0);
  if (error_) std::rethrow_exception(error_);
}

double ArtifactWriter::write_seconds() const {
  std::lock_guard<std::mutex> lk(m_);
  return write_s_;
}

double ArtifactWriter::convert_seconds() const {
  std::lock_guard<std::mutex> lk(m_);
  return convert_s_;
}

std::string ArtifactWriter::layer_entries() const {
  std::lock_guard<std::mutex> lk(m_);
  CROSSKV_ASSERT(queue_.empty() && !busy_, "layer_entries() before drain()");
  ByteWriter w;
  for (const auto& list : layers_) {
    w.as<uint64_t>(list.size());
    for (const ManifestLayer& e : list) w(manifest_layer_text(e));
  }
  return std::move(w.bytes());
}

void ArtifactWriter::write_job(const Job& job) {
  const PairDims d = plan_.dims;
  const int l = job.l;
  const bool half = cal_.cfg.fit.dtype != Dtype::f32;
  const std::string wdtype = !half ? "F32" : cal_.cfg.fit.dtype == Dtype::bf16 ? "BF16" : "F16";
  for (size_t i = 0; i < plan_.slots(); ++i) {
    const LayerFit &fk = job.fk[i], &fv = job.fv[i];
    if (half) {
      const auto c0 = std::chrono::steady_clock::now();
      const bool bf16 = cal_.cfg.fit.dtype == Dtype::bf16;
      half_k_.resize(fk.W.size());
      half_v_.resize(fv.W.size());
      to_half_on_host(fk.W.data(), static_cast<int64_t>(fk.W.size()), bf16, half_k_.data());
      to_half_on_host(fv.W.data(), static_cast<int64_t>(fv.W.size()), bf16, half_v_.data());
      const double s = seconds_since(c0);
      std::lock_guard<std::mutex> lk(m_);
      convert_s_ += s;
    }
    const void* wk = half ? static_cast<const void*>(half_k_.data()) : fk.W.data();
    const void* wv = half ? static_cast<const void*>(half_v_.data()) : fv.W.data();
    const size_t wbytes = fk.W.size() * (half ? 2 : 4);
    const std::string file = layer_file_name(l);
    const std::string path = (fs::path(partial_dir(i)) / file).string();
    if (fault("kill_in_layer_write", files_ + 1, rank_)) {  // a write cut short: its temporary stays behind
      AtomicFile partial(path);
      partial.write(wk, wbytes / 2);
      fault_kill();
    }
    LayerFileContent content{l, fk.layers, plan_.slot_k(i).features_of(fk.structure), d.G(), {{wdtype, wk, fk.b.data()},
                             {wdtype, wv, fv.b.data()}}};
    if (fk.structure == Structure::per_head) content.heads = d.Ht;
    write_layer_file(path, content);
    written();
    ManifestLayer entry{l, fk.layers, file, sha256_file(path), fk.r2, fv.r2, job.lambda, {}};
    if (entry.lambda) entry.lambda->lambda = {fk.lambda, fv.lambda};
    // The layer's record: with it an interrupted export resumes after this layer (resume_layer).
    write_sealed(record_file(record_dir(i), file), record_seal(identity_), manifest_layer_text(entry));
    std::lock_guard<std::mutex> lk(m_);
    layers_[i].push_back(std::move(entry));
  }
}

void ArtifactWriter::add_layer_entries(const std::string& per_k) {
  ByteReader r(per_k, "another rank's layer entries");
  for (auto& list : layers_) {
    uint64_t n = 0;
    r.as<uint64_t>(n);
    for (uint64_t j = 0; j < n; ++j) {
      std::string text;
      r(text);
      std::optional<ManifestLayer> e = parse_manifest_layer_text(text);
      CROSSKV_ASSERT(e.has_value(), "another rank's layer entry does not read back: " + text);
      list.push_back(std::move(*e));
    }
  }
  CROSSKV_ASSERT(r.done(), "layer entries for a different k list");
}

std::vector<std::string> ArtifactWriter::finish(const ManifestRun& run, bool publish) {
  drain();
  for (auto& list : layers_)
    std::sort(list.begin(), list.end(),
              [](const ManifestLayer& a, const ManifestLayer& b) { return a.target_layer < b.target_layer; });
  std::vector<std::string> out;
  const auto& c = cal_.cfg;
  ManifestCalibration calibration;
  calibration.domains = cal_.domains, calibration.weights = c.calibration.weights;
  for (const auto& s : cal_.shards) calibration.shards.push_back({s.rel, s.domain, s.fingerprint, s.rows, s.used});
  calibration.tokens_used = cal_.tokens_used, calibration.token_stride = c.calibration.token_stride;
  calibration.max_tokens = c.calibration.max_tokens;
  calibration.token_weighting = to_string(c.fit.weighting);
  for (size_t i = 0; i < plan_.slots(); ++i) {
    const KPlan& kp = plan_.slot_k(i);
    const Structure st = plan_.slot_structure(i);
    const ManifestFit fit{kp.label,         kp.count,       kp.features_of(st), kp.params_of(st), kp.bias_params,
                          c.fit.lambda.automatic ? std::nullopt : std::optional(c.fit.lambda.value), lambda_choice_,
                          to_string(c.fit.probe), weight_dtype_name(c.fit.dtype), to_string(st)};
    write_manifest(partial_dir(i), {cal_.source_model, cal_.source_weights}, cal_.source,
                   {cal_.target_model, cal_.target_weights}, cal_.target, fit, layers_[i], calibration, run);
    if (!publish) {
      out.push_back(partial_dir(i));
      continue;
    }
    out.push_back(publish_artifact(c.output.dir, plan_.slot_folder(i)));
    written();
  }
  return out;
}

std::string publish_artifact(const std::string& output_dir, const std::string& folder) {
  const std::string final_dir = (fs::path(output_dir) / folder).string(), partial = final_dir + ".partial";
  std::set<std::string> files = {kManifestFile};
  for (const ManifestLayer& e : read_mapper_manifest(partial).layers) files.insert(e.file);
  std::error_code ec;
  fs::remove_all(records_in(partial), ec);
  keep_only(partial, files);
  fs::remove_all(final_dir, ec);
  fs::rename(partial, final_dir, ec);
  if (ec) throw SystemError("rename " + partial + " -> " + final_dir + ": " + ec.message());
  fsync_dir(output_dir);
  return final_dir;
}

void record_rewritten_layer(const std::string& partial_dir, const ManifestLayer& entry) {
  const std::string dir = records_in(partial_dir).string();
  const nlohmann::json seal = read_seal(identity_file(dir));
  CROSSKV_ASSERT(seal.is_object(), "a rewritten layer's record without its export's identity in " + dir);
  write_sealed(record_file(dir, entry.file), record_seal(seal["identity"]), manifest_layer_text(entry));
}

}  // namespace crosskv
