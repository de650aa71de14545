#include "fit/checkpoint.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <thread>
#include <type_traits>

#include <omp.h>

#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/fault.hpp"
#include "runtime/log.hpp"
#include "core/memory.hpp"
#include "core/sha256.hpp"
#include "core/atomic_file.hpp"
#include "core/sealed_file.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

// A state file is sealed (core/sealed_file.hpp) with its sequence number and rank; its payload is the pass and the
// rounds done (int64 each), then four vectors, each a count (uint64) and its values: pass 1's floats and doubles, pass
// 2's. It goes through the sealed file's buffer both ways (a state is as large as the job's moments).
SealId state_seal(int64_t seq, int rank) { return {"crosskv-checkpoint-state", 3, {{"seq", seq}, {"rank", rank}}}; }

// The bytes of a state file in order: each part fills [off, off + len) of itself on demand.
struct Part {
  size_t bytes;
  std::function<void(size_t off, size_t len, char* dst)> fill;
};

Part memory_part(const void* p, size_t bytes) {
  return {bytes, [p](size_t off, size_t len, char* dst) { std::memcpy(dst, static_cast<const char*>(p) + off, len); }};
}

// Sums where they are (LiveSums), as bytes: straight into the buffer when the bytes asked for are whole values there,
// else whole values through a temporary.
template <class T>
Part live_part(Residency& be, const std::vector<Residency::SumPiece<T>>& pieces) {
  return {static_cast<size_t>(flat_size(pieces)) * sizeof(T), [&be, &pieces](size_t off, size_t len, char* dst) {
            if (off % sizeof(T) == 0 && len % sizeof(T) == 0 && reinterpret_cast<uintptr_t>(dst) % alignof(T) == 0)
              return be.copy_sums(pieces, static_cast<int64_t>(off / sizeof(T)), static_cast<int64_t>(len / sizeof(T)),
                                  reinterpret_cast<T*>(dst), false);
            const size_t e0 = off / sizeof(T), e1 = (off + len + sizeof(T) - 1) / sizeof(T);
            std::vector<T> values(e1 - e0);
            be.copy_sums(pieces, static_cast<int64_t>(e0), static_cast<int64_t>(e1 - e0), values.data(), false);
            std::memcpy(dst, reinterpret_cast<const char*>(values.data()) + off % sizeof(T), len);
          }};
}

// Reads a state file into `s` (the vectors of pass s.pass only located when `defer`), checking its checksum on the
// way. Returns "" or what is wrong with the file.
std::string read_state(const std::string& path, int64_t seq, int rank, bool defer, PassState& s) {
  SealedReader r(path, state_seal(seq, rank));
  if (!r.ok()) return r.why();
  int64_t pass = 0;
  if (!r.read(&pass, sizeof pass) || !r.read(&s.rounds_done, sizeof s.rounds_done)) return "truncated";
  if (pass != 1 && pass != 2) return "malformed (pass " + std::to_string(pass) + ")";
  s.pass = static_cast<int>(pass);
  PassState::Deferred later{path};
  auto vec = [&](auto& v, bool skip, uint64_t& count, uint64_t& offset) {
    using T = typename std::decay_t<decltype(v)>::value_type;
    uint64_t n = 0;
    if (!r.read(&n, 8) || n > r.remaining() / sizeof(T)) return false;
    count = n;
    offset = r.offset();
    if (skip) return r.read(nullptr, n * sizeof(T));
    v.resize(n);
    return r.read(v.data(), n * sizeof(T));
  };
  uint64_t unused[2];
  const bool skip1 = defer && pass == 1, skip2 = defer && pass == 2;
  if (!vec(s.pass1_f, skip1, skip1 ? later.f_count : unused[0], skip1 ? later.f_at : unused[1]) ||
      !vec(s.pass1_d, skip1, skip1 ? later.d_count : unused[0], skip1 ? later.d_at : unused[1]) ||
      !vec(s.pass2_f, skip2, skip2 ? later.f_count : unused[0], skip2 ? later.f_at : unused[1]) ||
      !vec(s.pass2_d, skip2, skip2 ? later.d_count : unused[0], skip2 ? later.d_at : unused[1]))
    return "malformed";
  if (std::string why = r.finish(); !why.empty()) return why;
  if (defer) s.deferred = later;
  return "";
}

}  // namespace

void check_state_size(const std::string& where, uint64_t have, uint64_t want) {
  if (have != want)
    throw InputError(where + ": the checkpoint holds " + std::to_string(have) + " sums of this pass, the job " +
                     std::to_string(want) + " (written by another version?); use --fresh to start over");
}

std::vector<double> read_deferred(const PassState::Deferred& d,
                                  const std::vector<Residency::SumPiece<float>>& into) {
  check_state_size(d.path, d.f_count, static_cast<uint64_t>(flat_size(into)));
  std::ifstream in(d.path, std::ios::binary);
  auto read = [&](uint64_t at, void* dst, uint64_t bytes) {
    in.seekg(static_cast<std::streamoff>(at));
    if (!in.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes)))
      throw SystemError(d.path + ": cannot read " + std::to_string(bytes) + " bytes at " + std::to_string(at) +
                        " of the checkpoint state (it verified when loaded)");
  };
  constexpr uint64_t kSegment = uint64_t{1} << 24;
  std::vector<float> segment(std::min(d.f_count, kSegment));
  for (uint64_t off = 0; off < d.f_count; off += kSegment) {
    const uint64_t len = std::min(kSegment, d.f_count - off);
    read(d.f_at + off * 4, segment.data(), len * 4);
    place_sums(into, static_cast<int64_t>(off), static_cast<int64_t>(len), segment.data());
  }
  std::vector<double> doubles(d.d_count);
  read(d.d_at, doubles.data(), d.d_count * 8);
  return doubles;
}


nlohmann::json file_stamp(const std::string& path) {
  std::error_code ec;
  return nlohmann::json{fs::file_size(path, ec), fs::last_write_time(path, ec).time_since_epoch().count()};
}

nlohmann::json checkpoint_identity(const Calibration& cal, const FitPlan& plan, int ranks) {
  nlohmann::json shards = nlohmann::json::array();
  // Sizes and modification times catch shards re-captured in place (the fingerprint covers ids and positions).
  for (const auto& s : cal.shards)
    shards.push_back({s.rel, s.used, s.fingerprint, file_stamp(s.source_path), file_stamp(s.target_path)});
  const auto& c = cal.cfg;
  nlohmann::json id = {{"source_store", c.source.store}, {"target_store", c.target.store}, {"domains", cal.domains},
          {"token_stride", c.calibration.token_stride}, {"max_tokens", c.calibration.max_tokens ? nlohmann::json(*c.calibration.max_tokens) : nlohmann::json()},
          {"block_tokens", c.runtime.block_tokens}, {"every_shards", c.runtime.checkpoint.every_shards},
          {"probe", to_string(c.fit.probe)}, {"single_pass", plan.single_pass}, {"ranks", ranks}, {"layer_groups", plan.layer_groups},
          {"shards", shards}};
  // Weighted moments are other moments (absent when uniform, so that checkpoints from before it stay valid).
  if (c.fit.weighting != Weighting::uniform) id["weighting"] = to_string(c.fit.weighting);
  return id;
}

CheckpointStore::CheckpointStore(std::string dir, nlohmann::json identity, Comm& comm, StopFlag stop)
    : dir_(std::move(dir)), identity_(std::move(identity)), comm_(comm), stop_(stop) {}

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

// A commit record as written by save(), or why it is not one.
std::optional<nlohmann::json> CheckpointStore::read_commit(int64_t seq, std::string& why) const {
  std::ifstream in(commit_path(seq));
  if (!in) {
    why = "unreadable";
    return std::nullopt;
  }
  nlohmann::json c = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  auto integer = [&](const char* key) { return c.contains(key) && c[key].is_number_integer(); };
  if (c.is_discarded() || !c.is_object())
    why = "not valid JSON";
  else if (!integer("seq") || c["seq"].get<int64_t>() != seq)
    why = "its seq is not " + std::to_string(seq);
  else if (!integer("pass") || (c["pass"] != 1 && c["pass"] != 2))
    why = "its pass is not 1 or 2";
  else if (!integer("rounds_done") || c["rounds_done"].get<int64_t>() < 0)
    why = "its rounds_done is not a count";
  else if (!integer("ranks") || c["ranks"].get<int64_t>() <= 0)
    why = "its ranks is not a count";
  else if (!c.contains("identity") || !c["identity"].is_object())
    why = "it has no identity";
  else
    return c;
  return std::nullopt;
}

void CheckpointStore::remove_stray_temporaries() const {
  // Each rank its own states' temporaries, rank 0 the commits': nobody removes a file another rank may be writing.
  const std::string mine = comm_.rank() == 0
                               ? "(state-[0-9]+-rank0\\.bin|commit-[0-9]+\\.json)\\.tmp-[0-9]+"
                               : "state-[0-9]+-rank" + std::to_string(comm_.rank()) + "\\.bin\\.tmp-[0-9]+";
  for (const auto& p : remove_files_matching(dir_, mine))
    spdlog::warn("removed {}: a temporary file of an interrupted checkpoint write", p);
}

std::optional<PassState> CheckpointStore::load(const LoadOptions& options) {
  bool fresh = options.fresh;  // set below too: moments about another provisional shift are read again
  const bool defer = options.defer_latest_sums;
  remove_stray_temporaries();
  // Commits that read, newest first: a damaged one is reported and the previous one used.
  std::vector<std::pair<int64_t, nlohmann::json>> commits;
  for (int64_t seq : committed()) {
    std::string why;
    if (auto c = read_commit(seq, why)) {
      commits.emplace_back(seq, std::move(*c));
      if (commits.size() == 2) break;
    } else if (comm_.rank() == 0) {
      spdlog::warn("checkpoint {}: {} is damaged ({}); falling back to the previous commit", seq, commit_path(seq),
                   why);
    }
  }
  if (options.reread_other_shift && !fresh && !commits.empty()) {
    // Moments about another provisional shift (an internal choice, e.g. after a domain that sorts first was added)
    // are re-read rather than refused.
    nlohmann::json theirs = commits.front().second["identity"], ours = identity_;
    if (theirs != ours) {
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
  if (commits.empty()) return std::nullopt;
  const auto& [newest, newest_commit] = commits.front();
  const nlohmann::json& theirs = newest_commit["identity"];
  if (theirs != identity_) {
    std::string diff;
    for (auto it = identity_.begin(); it != identity_.end(); ++it)
      if (theirs.value(it.key(), nlohmann::json()) != it.value())
        diff += (diff.empty() ? "" : ", ") + it.key() + " (checkpoint: " +
                theirs.value(it.key(), nlohmann::json()).dump().substr(0, 80) + ", now: " +
                it.value().dump().substr(0, 80) + ")";
    throw UserError(commit_path(newest) + ": the committed checkpoint is for another job; differs in " + diff +
                    "; use --fresh to start over");
  }
  for (size_t i = 0; i < commits.size(); ++i) {
    const auto& [seq, commit] = commits[i];
    PassState s;
    std::string why = commit["identity"] != identity_ ? "of another job"
                                                      : read_state(state_path(seq, comm_.rank()), seq, comm_.rank(), defer, s);
    // A commit speaks for its states: they must say the same pass and rounds (both are edited only by hand).
    if (why.empty() && (s.pass != commit["pass"].get<int>() || s.rounds_done != commit["rounds_done"].get<int64_t>() ||
                        commit["ranks"].get<int>() != comm_.size()))
      why = "inconsistent with " + commit_path(seq) + " (state: pass " + std::to_string(s.pass) + ", " +
            std::to_string(s.rounds_done) + " rounds; commit: pass " + commit["pass"].dump() + ", " +
            commit["rounds_done"].dump() + " rounds, " + commit["ranks"].dump() + " ranks)";
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
                 i + 1 < commits.size() ? "falling back to the previous one" : "starting over");
  }
  return std::nullopt;
}

void CheckpointStore::save(const PassState& s, const LiveSums* live) {
  CROSSKV_ASSERT(!s.deferred, "a state with deferred sums is saved only after they were read");
  const int64_t seq = seq_ + 1;
  bool ok = true;
  std::string error;
  try {
    fs::create_directories(dir_);
    std::vector<Part> vectors = {memory_part(s.pass1_f.data(), s.pass1_f.size() * 4),
                                 memory_part(s.pass1_d.data(), s.pass1_d.size() * 8),
                                 memory_part(s.pass2_f.data(), s.pass2_f.size() * 4),
                                 memory_part(s.pass2_d.data(), s.pass2_d.size() * 8)};
    if (live) {
      CROSSKV_ASSERT(s.pass == 1 || s.pass == 2, "a state's pass is 1 or 2");
      vectors[2 * (s.pass - 1)] = live_part(*live->backend, live->f);
      vectors[2 * (s.pass - 1) + 1] = live_part(*live->backend, live->d);
    }
    fault_point("fail_state_write", seq, comm_.rank());
    const bool kill_half = fault("kill_in_state_write", seq, comm_.rank());  // pass 1's sums, unsealed, then SIGKILL
    SealedWriter f(state_path(seq, comm_.rank()), state_seal(seq, comm_.rank()));
    const int64_t pass = s.pass;
    f.write(&pass, sizeof pass);
    f.write(&s.rounds_done, sizeof s.rounds_done);
    for (size_t i = 0; i < vectors.size(); ++i) {
      const uint64_t count = vectors[i].bytes / (i % 2 == 0 ? 4 : 8);
      f.write(&count, sizeof count);
      f.write_from(vectors[i].bytes, vectors[i].fill);
      if (kill_half && i == 1) {
        f.flush();
        fault_kill();
      }
    }
    f.commit();
  } catch (const std::exception& e) {
    ok = false;
    error = e.what();
    spdlog::warn("checkpoint {}: writing {} failed: {}", seq, state_path(seq, comm_.rank()), error);
  }
  fault_point("kill_before_commit", seq, comm_.rank());
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
  fault_point("pause_after_commit", seq, comm_.rank(), [this] { return stop_.requested(); });
}

}  // namespace crosskv
