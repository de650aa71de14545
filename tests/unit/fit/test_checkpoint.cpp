#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <spdlog/sinks/ostream_sink.h>

#include "core/atomic_file.hpp"
#include "helpers.hpp"
#include "fit/checkpoint.hpp"

using namespace crosskv;
using namespace crosskv::test;

// Sums saved where they are (strided pieces read through a backend, as one reader's checkpoints are) and read back,
// whole or deferred straight into other strided memory: the same values, over several checksum chunks and more than
// one buffer of them, with the doubles at an offset that is not a multiple of 8.
TEST(Checkpoint, LiveSumsRoundTripWholeAndDeferred) {
  TempDir dir;
  auto comm = make_single_comm();
  auto cpu = make_cpu_backend();
  const nlohmann::json identity = {{"job", "live"}};
  const int64_t rows = 20001, cols = 2001, ld = 2003;  // 40,022,001 floats (odd): 153 MiB
  std::vector<float> host(rows * ld), back(rows * ld, -1.0f);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 1000003) * 0.25f;
  std::vector<double> stats = {1.5, 2.5, 3.5};
  LiveSums live{cpu.get(), {{host.data(), rows, cols, ld, 0}}, {{stats.data(), 1, 3, 3, 0}}};
  PassState s;
  s.pass = 2;
  s.rounds_done = 5;
  s.pass1_f = {1.0f, 2.0f, 3.0f};  // a complete pass 1, kept as vectors
  s.pass1_d = {4.0};
  CheckpointStore(dir.str("ck"), identity, *comm).save(s, &live);
  auto whole = CheckpointStore(dir.str("ck"), identity, *comm).load();
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->pass, 2);
  EXPECT_EQ(whole->rounds_done, 5);
  EXPECT_EQ(whole->pass1_f, s.pass1_f);
  EXPECT_EQ(whole->pass1_d, s.pass1_d);
  EXPECT_EQ(whole->pass2_d, stats);
  ASSERT_EQ(whole->pass2_f.size(), static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(whole->pass2_f[r * cols + c], host[r * ld + c]) << r << "," << c;
  whole.reset();
  auto deferred = CheckpointStore(dir.str("ck"), identity, *comm).load({.defer_latest_sums = true});
  ASSERT_TRUE(deferred.has_value() && deferred->deferred.has_value());
  EXPECT_TRUE(deferred->pass2_f.empty() && deferred->pass2_d.empty()) << "the latest pass's sums stay in the file";
  EXPECT_EQ(deferred->pass1_f, s.pass1_f) << "an earlier pass is read";
  const std::vector<ComputeBackend::SumPiece<float>> into = {{back.data(), rows, cols, ld, 0}};
  EXPECT_EQ(read_deferred(*deferred->deferred, into), stats);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(back[r * ld + c], host[r * ld + c]) << r << "," << c;
    ASSERT_EQ(back[r * ld + cols], -1.0f) << "the padding between rows is left alone";
  }
}

// A state larger than one checksum chunk (64 MiB) round-trips, and a flipped byte in a later chunk is caught.
TEST(Checkpoint, LargeStateRoundTripsAndCorruptionInAnyChunkIsCaught) {
  TempDir dir;
  auto comm = make_single_comm();
  const nlohmann::json identity = {{"job", "test"}};
  PassState s;
  s.pass = 1;
  s.rounds_done = 3;
  s.pass1_f.resize(40u << 20);  // 160 MiB: three chunks, pieces spanning chunk boundaries
  for (size_t i = 0; i < s.pass1_f.size(); ++i) s.pass1_f[i] = static_cast<float>(i % 1000003) * 0.5f;
  s.pass1_d = {1.0, 2.0, 3.0};
  {
    CheckpointStore store(dir.str("ck"), identity, *comm);
    ASSERT_FALSE(store.load().has_value());
    store.save(s);
  }
  {
    CheckpointStore store(dir.str("ck"), identity, *comm);
    auto got = store.load();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->rounds_done, 3);
    EXPECT_EQ(got->pass1_f, s.pass1_f);
    EXPECT_EQ(got->pass1_d, s.pass1_d);
  }
  std::string state;
  for (const auto& e : std::filesystem::directory_iterator(dir.str("ck")))
    if (e.path().filename().string().rfind("state-", 0) == 0) state = e.path().string();
  ASSERT_FALSE(state.empty());
  {
    std::fstream f(state, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(130u << 20);  // in the third chunk
    f.put('\x7f');
  }
  CheckpointStore store(dir.str("ck"), identity, *comm);
  EXPECT_FALSE(store.load().has_value());  // the only checkpoint does not verify: start over
  // A count that claims more values than the file holds is refused before anything is allocated for it.
  {
    CheckpointStore again(dir.str("ck2"), identity, *comm);
    again.save(s);
  }
  for (const auto& e : std::filesystem::directory_iterator(dir.str("ck2")))
    if (e.path().filename().string().rfind("state-", 0) == 0) {
      std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(36 + 7);  // the top byte of pass 1's float count
      f.put('\x40');
    }
  CheckpointStore bad(dir.str("ck2"), identity, *comm);
  EXPECT_FALSE(bad.load().has_value());
}

namespace {

// Two committed checkpoints (rounds 1 and 2) in dir/ck.
void two_commits(const TempDir& dir, const nlohmann::json& identity, Comm& comm) {
  CheckpointStore store(dir.str("ck"), identity, comm);
  for (int64_t rounds : {1, 2}) {
    PassState s;
    s.rounds_done = rounds;
    s.pass1_f = {static_cast<float>(rounds)};
    s.pass1_d = {0.5};
    store.save(s);
  }
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

// A damaged commit record is treated like a damaged state: named in the log, the previous commit used.
TEST(Checkpoint, ADamagedCommitFallsBackToThePreviousOne) {
  auto comm = make_single_comm();
  const nlohmann::json identity = {{"job", "commits"}};
  for (const std::string garbage : {"{\"seq\": 2, \"pass\": ", "\x01\x02 not json", "[1, 2]", "{\"seq\": 2}",
                                    "{\"seq\": 7, \"pass\": 1, \"rounds_done\": 2, \"ranks\": 1, \"identity\": {}}"}) {
    SCOPED_TRACE(garbage);
    TempDir dir;
    two_commits(dir, identity, *comm);
    write_text(dir.str("ck/commit-2.json"), garbage);
    std::ostringstream log;
    auto previous = spdlog::default_logger();
    spdlog::set_default_logger(
        std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(log)));
    auto got = CheckpointStore(dir.str("ck"), identity, *comm).load();
    spdlog::set_default_logger(previous);
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->rounds_done, 1);
    EXPECT_EQ(got->pass1_f, std::vector<float>{1.0f});
    EXPECT_THAT(log.str(), ::testing::HasSubstr(dir.str("ck/commit-2.json") + " is damaged"));
    EXPECT_THAT(log.str(), ::testing::HasSubstr("falling back to the previous commit"));
  }
}

// A commit must say what its states say: an edited rounds_done (or pass) does not verify.
TEST(Checkpoint, ACommitInconsistentWithItsStatesIsNotUsed) {
  auto comm = make_single_comm();
  const nlohmann::json identity = {{"job", "consistent"}};
  TempDir dir;
  two_commits(dir, identity, *comm);
  auto commit = nlohmann::json::parse(read_all(dir.str("ck/commit-2.json")));
  commit["rounds_done"] = 5;
  write_text(dir.str("ck/commit-2.json"), commit.dump());
  auto got = CheckpointStore(dir.str("ck"), identity, *comm).load();
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->rounds_done, 1) << "the edited commit is passed over for the previous one";
  commit = nlohmann::json::parse(read_all(dir.str("ck/commit-1.json")));
  commit["pass"] = 2;
  write_text(dir.str("ck/commit-1.json"), commit.dump());
  EXPECT_FALSE(CheckpointStore(dir.str("ck"), identity, *comm).load().has_value()) << "neither verifies";
}

// Temporaries of interrupted writes are removed when the store is loaded (this rank's states, rank 0's commits).
TEST(Checkpoint, StrayTemporariesAreRemovedOnLoad) {
  auto comm = make_single_comm();
  const nlohmann::json identity = {{"job", "tmp"}};
  TempDir dir;
  two_commits(dir, identity, *comm);
  for (const char* name : {"state-3-rank0.bin.tmp-4242", "commit-3.json.tmp-4242", "notes.txt"})
    write_text(dir.str(std::string("ck/") + name), "x");
  ASSERT_TRUE(CheckpointStore(dir.str("ck"), identity, *comm).load().has_value());
  EXPECT_FALSE(fs::exists(dir.str("ck/state-3-rank0.bin.tmp-4242")));
  EXPECT_FALSE(fs::exists(dir.str("ck/commit-3.json.tmp-4242")));
  EXPECT_TRUE(fs::exists(dir.str("ck/notes.txt"))) << "only temporaries of crosskv's own files are removed";
}
