#include "stages/checkpoint.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>
#include <type_traits>

#include "core/comm.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "core/sha256.hpp"
#include "io/atomic_file.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

volatile std::sig_atomic_t g_stop = 0;
void on_stop_signal(int) { g_stop = 1; }

constexpr char kMagic[8] = {'C', 'K', 'V', 'S', 'T', 'A', 'T', '2'};

// A state file is a sequence of pieces (header, counts, vectors) followed by its checksum: the SHA-256 of the
// SHA-256 digests of its 64 MiB chunks, the chunks hashed in parallel (a state is as large as the job's moments).
struct Piece {
  const void* data;
  size_t bytes;
};
constexpr size_t kDigestChunk = size_t{64} << 20;

std::string chunked_sha256(const std::vector<Piece>& pieces) {
  size_t total = 0;
  for (const Piece& p : pieces) total += p.bytes;
  const int64_t chunks = static_cast<int64_t>((total + kDigestChunk - 1) / kDigestChunk);
  std::vector<std::string> digests(chunks);
  bool failed = false;
#pragma omp parallel for schedule(dynamic) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    try {
      const size_t lo = c * kDigestChunk, hi = std::min(total, lo + kDigestChunk);
      Sha256 h;
      size_t at = 0;
      for (const Piece& p : pieces) {
        const size_t a = std::max(lo, at), b = std::min(hi, at + p.bytes);
        if (a < b) h.update(static_cast<const char*>(p.data) + (a - at), b - a);
        at += p.bytes;
      }
      digests[c] = h.hex();
    } catch (...) {
#pragma omp atomic write
      failed = true;
    }
  }
  if (failed) throw SystemError("SHA-256 of a checkpoint state failed");
  Sha256 h;
  for (const std::string& d : digests) h.update(d.data(), d.size());
  return h.hex();
}

template <class T>
void put(std::string& b, const T& v) {
  b.append(reinterpret_cast<const char*>(&v), sizeof(T));
}
constexpr size_t kHexDigest = 64;

// Reads a state file straight into `s` (never a second copy of the moments), then checks its checksum over the same
// pieces save() hashed. Returns "" or what is wrong with the file.
std::string read_state(const std::string& path, int64_t seq, int rank, PassState& s) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "missing";
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  constexpr size_t kHead = sizeof(kMagic) + 8 + 8 + 4 + 8;
  if (size < kHead + kHexDigest) return "truncated";
  std::string head(kHead, '\0');
  if (!in.read(head.data(), kHead)) return "unreadable";
  if (std::memcmp(head.data(), kMagic, sizeof(kMagic)) != 0) return "not a state file of this crosskv version";
  int64_t fseq = 0, frank = 0;
  int32_t pass = 0;
  size_t at = sizeof(kMagic);
  auto field = [&](auto& v) {
    std::memcpy(&v, head.data() + at, sizeof v);
    at += sizeof v;
  };
  field(fseq);
  field(frank);
  field(pass);
  field(s.rounds_done);
  s.pass = pass;
  if (fseq != seq || frank != rank) return "malformed (another sequence number or rank)";
  uint64_t counts[4] = {0, 0, 0, 0};
  uint64_t left = size - kHead - kHexDigest;
  auto vec = [&](uint64_t& n, auto& v) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    if (left < 8 || !in.read(reinterpret_cast<char*>(&n), 8)) return false;
    left -= 8;
    if (n > left / sizeof(T)) return false;
    v.resize(n);
    if (!in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)))) return false;
    left -= n * sizeof(T);
    return true;
  };
  if (!vec(counts[0], s.pass1_f) || !vec(counts[1], s.pass1_d) || !vec(counts[2], s.pass2_f) ||
      !vec(counts[3], s.pass2_d) || left != 0)
    return "malformed";
  std::string hex(kHexDigest, '\0');
  if (!in.read(hex.data(), kHexDigest)) return "truncated";
  const std::vector<Piece> pieces = {{head.data(), head.size()},
                                     {&counts[0], 8}, {s.pass1_f.data(), s.pass1_f.size() * 4},
                                     {&counts[1], 8}, {s.pass1_d.data(), s.pass1_d.size() * 8},
                                     {&counts[2], 8}, {s.pass2_f.data(), s.pass2_f.size() * 4},
                                     {&counts[3], 8}, {s.pass2_d.data(), s.pass2_d.size() * 8}};
  if (chunked_sha256(pieces) != hex) return "checksum mismatch";
  return "";
}

}  // namespace

void install_stop_signal_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
}
bool stop_requested() { return g_stop != 0; }

nlohmann::json checkpoint_identity(const Calibration& cal, const FitPlan& plan, int ranks) {
  nlohmann::json shards = nlohmann::json::array();
  // Sizes and modification times catch shards re-captured in place (the fingerprint covers ids and positions).
  auto stamp = [](const std::string& path) {
    std::error_code ec;
    return nlohmann::json{fs::file_size(path, ec), fs::last_write_time(path, ec).time_since_epoch().count()};
  };
  for (const auto& s : cal.shards)
    shards.push_back({s.rel, s.used, s.fingerprint, stamp(s.source_path), stamp(s.target_path)});
  const auto& c = cal.cfg;
  return {{"source_store", c.source_store}, {"target_store", c.target_store}, {"domains", cal.domains},
          {"token_stride", c.token_stride}, {"max_tokens", c.max_tokens ? nlohmann::json(*c.max_tokens) : nlohmann::json()},
          {"block_tokens", c.block_tokens}, {"every_shards", c.checkpoint_every_shards},
          {"probe", to_string(c.probe)}, {"single_pass", plan.single_pass}, {"ranks", ranks}, {"layer_groups", plan.layer_groups},
          {"shards", shards}};
}

CheckpointStore::CheckpointStore(std::string dir, nlohmann::json identity, Comm& comm)
    : dir_(std::move(dir)), identity_(std::move(identity)), comm_(comm) {}

std::string CheckpointStore::state_path(int64_t seq, int rank) const {
  return (fs::path(dir_) / ("state-" + std::to_string(seq) + "-rank" + std::to_string(rank) + ".bin")).string();
}
std::string CheckpointStore::commit_path(int64_t seq) const {
  return (fs::path(dir_) / ("commit-" + std::to_string(seq) + ".json")).string();
}

std::vector<int64_t> CheckpointStore::committed() const {
  std::vector<int64_t> seqs;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return seqs;
  static const std::regex re("commit-([0-9]+)\\.json");
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (std::regex_match(name, m, re)) seqs.push_back(std::stoll(m[1]));
  }
  std::sort(seqs.rbegin(), seqs.rend());
  return seqs;
}

std::optional<PassState> CheckpointStore::load(bool fresh, bool cache) {
  const auto seqs = committed();
  if (cache && !fresh && !seqs.empty()) {
    // Moments about another provisional shift (an internal choice, e.g. after a domain that sorts first was added)
    // are re-read rather than refused.
    nlohmann::json commit;
    std::ifstream(commit_path(seqs.front())) >> commit;
    nlohmann::json theirs = commit["identity"], ours = identity_;
    if (theirs != ours && theirs.is_object()) {
      theirs.erase("shift_sha256");
      ours.erase("shift_sha256");
      if (theirs == ours) {
        spdlog::info("{}: the stored moments use another provisional shift; reading this domain again", dir_);
        fresh = true;
      }
    }
  }
  if (fresh) {
    comm_.barrier();
    if (comm_.rank() == 0 && fs::exists(dir_)) {
      for (const auto& e : fs::directory_iterator(dir_)) fs::remove_all(e.path());
      spdlog::info("removed the checkpoints in {}", dir_);
    }
    comm_.barrier();
    return std::nullopt;
  }
  if (seqs.empty()) return std::nullopt;
  nlohmann::json commit;
  std::ifstream(commit_path(seqs.front())) >> commit;
  if (commit["identity"] != identity_) {
    std::string diff;
    for (auto it = identity_.begin(); it != identity_.end(); ++it)
      if (commit["identity"].value(it.key(), nlohmann::json()) != it.value())
        diff += (diff.empty() ? "" : ", ") + it.key() + " (checkpoint: " +
                commit["identity"].value(it.key(), nlohmann::json()).dump().substr(0, 80) + ", now: " +
                it.value().dump().substr(0, 80) + ")";
    throw UserError(commit_path(seqs.front()) + ": the committed checkpoint is for another job; differs in " + diff +
                    "; use --fresh to start over");
  }
  for (size_t i = 0; i < seqs.size() && i < 2; ++i) {
    const int64_t seq = seqs[i];
    PassState s;
    const std::string why = read_state(state_path(seq, comm_.rank()), seq, comm_.rank(), s);
    const bool ok = why.empty();
    if (!ok) s = PassState{};  // release what a bad file made us read
    if (!ok) spdlog::warn("checkpoint {}: {} is {}", seq, state_path(seq, comm_.rank()), why);
    if (comm_.all_ok(ok)) {
      seq_ = seq;
      spdlog::info("resuming from committed checkpoint {} in {} (pass {}, {} rounds done)", seq, dir_, s.pass,
                   s.rounds_done);
      return s;
    }
    spdlog::warn("checkpoint {} does not verify on every rank; {}", seq,
                 i + 1 < seqs.size() ? "falling back to the previous one" : "starting over");
  }
  return std::nullopt;
}

void CheckpointStore::save(const PassState& s) {
  const int64_t seq = seq_ + 1;
  bool ok = true;
  std::string error;
  try {
    fs::create_directories(dir_);
    // Streamed to the temp file piece by piece (the state can be as large as the moments): header, vectors, then
    // the checksum of everything before it (chunked_sha256), in hex.
    std::string head(kMagic, sizeof(kMagic));
    put<int64_t>(head, seq);
    put<int64_t>(head, comm_.rank());
    put<int32_t>(head, s.pass);
    put<int64_t>(head, s.rounds_done);
    uint64_t counts[4] = {s.pass1_f.size(), s.pass1_d.size(), s.pass2_f.size(), s.pass2_d.size()};
    const std::vector<Piece> pieces = {{head.data(), head.size()},
                            {&counts[0], 8}, {s.pass1_f.data(), s.pass1_f.size() * 4},
                            {&counts[1], 8}, {s.pass1_d.data(), s.pass1_d.size() * 8},
                            {&counts[2], 8}, {s.pass2_f.data(), s.pass2_f.size() * 4},
                            {&counts[3], 8}, {s.pass2_d.data(), s.pass2_d.size() * 8}};
    size_t total = 0;
    for (const Piece& p : pieces) total += p.bytes;
    if (fault("fail_state_write", seq, comm_.rank())) throw SystemError("injected write failure (CROSSKV_FAULT)");
    const bool kill_half = fault("kill_in_state_write", seq, comm_.rank());  // half the bytes, then SIGKILL
    const std::string hex = chunked_sha256(pieces);
    AtomicFile f(state_path(seq, comm_.rank()));
    size_t written = 0;
    constexpr size_t kChunk = size_t{64} << 20;
    for (const Piece& p : pieces)
      for (size_t at = 0; at < p.bytes; at += kChunk) {
        const char* d = static_cast<const char*>(p.data) + at;
        size_t n = std::min(kChunk, p.bytes - at);
        if (kill_half && written + n >= total / 2) {
          f.write(d, total / 2 - written);
          std::raise(SIGKILL);
        }
        f.write(d, n);
        written += n;
      }
    f.write(hex.data(), hex.size());
    f.commit();
  } catch (const std::exception& e) {
    ok = false;
    error = e.what();
    spdlog::warn("checkpoint {}: writing {} failed: {}", seq, state_path(seq, comm_.rank()), error);
  }
  if (fault("kill_before_commit", seq, comm_.rank())) std::raise(SIGKILL);
  if (!comm_.all_ok(ok)) {
    // The previous commit stands; remove this attempt's files.
    std::error_code ec;
    fs::remove(state_path(seq, comm_.rank()), ec);
    spdlog::warn("checkpoint {} not committed (a rank failed to write); the previous one stands", seq);
    return;
  }
  if (comm_.rank() == 0)
    write_file_atomic(commit_path(seq),
                      nlohmann::json{{"seq", seq}, {"pass", s.pass}, {"rounds_done", s.rounds_done},
                                     {"ranks", comm_.size()}, {"identity", identity_}}
                              .dump(1) +
                          "\n");
  comm_.barrier();
  // Keep this commit and the previous one.
  std::error_code ec;
  if (seq >= 3) {
    fs::remove(state_path(seq - 2, comm_.rank()), ec);
    if (comm_.rank() == 0) fs::remove(commit_path(seq - 2), ec);
  }
  seq_ = seq;
  if (fault("pause_after_commit", seq, comm_.rank()))
    for (int i = 0; i < 2400 && !stop_requested(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

}  // namespace crosskv
