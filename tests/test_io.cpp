#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include <spdlog/sinks/ostream_sink.h>

#include "backends/backends.hpp"
#include "core/comm.hpp"
#include "core/half.hpp"
#include "helpers.hpp"
#include "core/atomic_file.hpp"
#include "io/h5.hpp"
#include "io/r2_file.hpp"
#include "artifact/safetensors.hpp"
#include "io/shard.hpp"
#include "stages/checkpoint.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

KvSpec tiny_spec() {
  KvSpec s;
  s.n_layers = 2;
  s.n_kv_heads = 2;
  s.head_dim = 4;
  s.n_q_heads = 2;
  s.rope.rotary_dim = 4;
  return s;
}

void write_shard(const std::string& path, Dtype dt, const std::vector<float>& keys, int64_t T) {
  ShardWriter w(path, "m", "web", tiny_spec(), T, dt, false, 3);
  std::vector<int32_t> ids(T), pos(T);
  for (int64_t t = 0; t < T; ++t) ids[t] = pos[t] = static_cast<int32_t>(t);
  w.write_token_ids(ids);
  w.write_positions(pos);
  w.write_seq_offsets({0, T});
  w.write_rows("keys", 0, T, keys.data());
  w.write_rows("values", 0, T, keys.data());
  w.close();
}

}  // namespace

class ShardDtypes : public ::testing::TestWithParam<Dtype> {};

TEST_P(ShardDtypes, RoundTripWithStrideAndOffsets) {
  TempDir tmp;
  const int64_t T = 10, row = 2 * 2 * 4;
  std::vector<float> keys(T * row);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = 0.37f * static_cast<float>(i) - 5.0f;
  const std::string path = tmp.str("s.h5");
  write_shard(path, GetParam(), keys, T);
  ShardReader r(path);
  EXPECT_EQ(r.header().tokens, T);
  EXPECT_EQ(r.header().key_dtype, GetParam());
  EXPECT_EQ(r.header().spec, tiny_spec());
  std::vector<float> out(3 * row);
  std::vector<uint16_t> scratch;
  r.read_rows("keys", 1, 3, 3, out.data(), scratch);  // tokens 1, 4, 7
  auto stored = [&](float x) {
    switch (GetParam()) {
      case Dtype::f16: return fp16_to_float(float_to_fp16(x));
      case Dtype::bf16: return bf16_to_float(float_to_bf16(x));
      default: return x;
    }
  };
  for (int j = 0; j < 3; ++j)
    for (int64_t c = 0; c < row; ++c) EXPECT_EQ(out[j * row + c], stored(keys[(1 + 3 * j) * row + c]));
  std::vector<int32_t> pos(3);
  r.read_positions(1, 3, 3, pos.data());
  EXPECT_EQ(pos, (std::vector<int32_t>{1, 4, 7}));
}

INSTANTIATE_TEST_SUITE_P(All, ShardDtypes, ::testing::Values(Dtype::f32, Dtype::f16, Dtype::bf16));

TEST(Shard, ReadsVariableLengthStringAttributesAsH5pyWritesThem) {
  TempDir tmp;
  const std::string path = tmp.str("s.h5");
  std::vector<float> keys(4 * 16, 1.0f);
  write_shard(path, Dtype::f32, keys, 4);
  {  // Replace the fixed-length string attributes with variable-length UTF-8 ones (h5py's default for str).
    h5::Handle f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
    for (const char* name : {"crosskv_format", "model", "domain", "kv_spec"}) {
      std::string value = h5::read_string_attr(f, name, path);
      H5Adelete(f, name);
      h5::Handle t(H5Tcopy(H5T_C_S1), H5Tclose);
      H5Tset_size(t, H5T_VARIABLE);
      H5Tset_cset(t, H5T_CSET_UTF8);
      h5::Handle s(H5Screate(H5S_SCALAR), H5Sclose);
      h5::Handle a(H5Acreate2(f, name, t, s, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
      const char* p = value.c_str();
      ASSERT_GE(H5Awrite(a, t, &p), 0);
    }
  }
  ShardReader r(path);
  EXPECT_EQ(r.header().model, "m");
  EXPECT_EQ(r.header().spec, tiny_spec());
}

TEST(Half, Bf16AndFp16RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(float_to_bf16(3.140625f)), 3.140625f);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // halfway between 0x3f80 and 0x3f81: even
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // halfway between 0x3f81 and 0x3f82: even
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(0.5f)), 0.5f);
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
}

TEST(Safetensors, RoundTripAllDtypes) {
  TempDir tmp;
  std::vector<float> w = {1.5f, -2.25f, 3.0f, 0.125f, 7.0f, -1.0f};
  std::vector<uint16_t> b16(w.size()), f16(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    b16[i] = float_to_bf16(w[i]);
    f16[i] = float_to_fp16(w[i]);
  }
  const std::string path = tmp.str("t.safetensors");
  write_safetensors(path,
                    {{"a", "F32", {2, 3}, w.data(), w.size() * 4},
                     {"b", "BF16", {3, 2}, b16.data(), b16.size() * 2},
                     {"c", "F16", {6}, f16.data(), f16.size() * 2}},
                    {{"format", "test"}});
  auto t = read_safetensors(path);
  EXPECT_EQ(t["a"].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t["a"].values, w);
  EXPECT_EQ(t["b"].values, w);
  EXPECT_EQ(t["c"].values, w);
  EXPECT_FALSE(fs::exists(temp_name_for(path)));
}

TEST(AtomicFile, UncommittedWriteLeavesNothing) {
  TempDir tmp;
  const std::string path = tmp.str("x.json");
  {
    AtomicFile f(path);
    f.write("partial", 7);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(tmp.path()));
  write_file_atomic(path, "done");
  std::ifstream in(path);
  std::string s;
  in >> s;
  EXPECT_EQ(s, "done");
}

TEST(R2File, RoundTrip) {
  TempDir tmp;
  ProbeR2 p{2, 3, 2, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}};
  write_r2_file(tmp.str("r2.h5"), {{"k", p}, {"v", p}, {"k_rope", p}}, {{"probe", "same_head"}});
  auto r = read_r2_file(tmp.str("r2.h5"));
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r["k"].mean, p.mean);
  EXPECT_EQ(r["v"].per_head, p.per_head);
  EXPECT_EQ(r["k_rope"].H, 2);
}

namespace {

// A safetensors file from a header text and a data size (the data bytes are zeros).
std::string st_bytes(const std::string& header, size_t data_bytes, int64_t len_override = -1) {
  const uint64_t len = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return b + header + std::string(data_bytes, '\0');
}

void expect_bad_st(const std::string& bytes, const std::string& what) {
  expect_error<InputError>([&] { parse_safetensors(bytes, "m/layer-000.safetensors"); },
                           {"m/layer-000.safetensors", what});
}

}  // namespace

TEST(Safetensors, HostileFilesAreRejectedWithTheReason) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_NO_THROW(parse_safetensors(st_bytes(ok, 8), "x"));
  expect_bad_st("abc", "header length missing");
  expect_bad_st(st_bytes(ok, 8, 1ll << 40), "over the 100 MB limit");
  expect_bad_st(st_bytes(ok, 8, 5000), "runs past the end of the file");
  expect_bad_st(st_bytes("{\"a\xff\":1}", 0), "not UTF-8");
  expect_bad_st(st_bytes("[1, 2]", 0), "does not start with '{'");
  expect_bad_st(st_bytes("{\"a\": ", 0), "not valid JSON");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                "names tensor 'a' twice");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 12),
                "overlaps");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
                "gap of 4 bytes before tensor 'b'");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8), "run past the end");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
                "element count overflows");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                "shape holds 3 F32 elements (12 bytes) but data_offsets span 8 bytes");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})", 8), "unknown or unsupported dtype 'I8'");
  expect_bad_st(st_bytes(ok, 12), "4 trailing bytes");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "negative dimension");
  expect_bad_st(st_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", 8), "needs dtype, shape and data_offsets");
  expect_bad_st(st_bytes(R"({"__metadata__":{"x":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
                "__metadata__ value 'x' is not a string");
}

TEST(Half, Fp16MatchesTheHardwareFormatOnEveryHalfAndOnRoundingCases) {
  // Every fp16 bit pattern round-trips (NaNs stay NaN).
  for (uint32_t u = 0; u < 65536; ++u) {
    const float f = fp16_to_float(static_cast<uint16_t>(u));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(f))));
      continue;
    }
    ASSERT_EQ(float_to_fp16(f), u) << "pattern " << u;
  }
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65519.0f), 0x7bff);  // below the rounding boundary
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);  // rounds to inf
  EXPECT_EQ(float_to_fp16(1.0f + 1.0f / 2048), 0x3c00);            // halfway, even stays
  EXPECT_EQ(float_to_fp16(1.0f + 3.0f / 2048), 0x3c02);            // halfway, odd rounds up
  EXPECT_EQ(float_to_fp16(5.9604645e-8f), 0x0001);                 // smallest subnormal
  EXPECT_EQ(float_to_fp16(2.9802322e-8f), 0x0000);                 // half of it: ties to even (0)
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
  EXPECT_EQ(fp16_to_float(0xfc00), -INFINITY);
}

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
  auto whole = CheckpointStore(dir.str("ck"), identity, *comm).load(false);
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
  auto deferred = CheckpointStore(dir.str("ck"), identity, *comm).load(false, false, /*defer=*/true);
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
    ASSERT_FALSE(store.load(false).has_value());
    store.save(s);
  }
  {
    CheckpointStore store(dir.str("ck"), identity, *comm);
    auto got = store.load(false);
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
  EXPECT_FALSE(store.load(false).has_value());  // the only checkpoint does not verify: start over
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
  EXPECT_FALSE(bad.load(false).has_value());
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
    auto got = CheckpointStore(dir.str("ck"), identity, *comm).load(false);
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
  auto got = CheckpointStore(dir.str("ck"), identity, *comm).load(false);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->rounds_done, 1) << "the edited commit is passed over for the previous one";
  commit = nlohmann::json::parse(read_all(dir.str("ck/commit-1.json")));
  commit["pass"] = 2;
  write_text(dir.str("ck/commit-1.json"), commit.dump());
  EXPECT_FALSE(CheckpointStore(dir.str("ck"), identity, *comm).load(false).has_value()) << "neither verifies";
}

// Temporaries of interrupted writes are removed when the store is loaded (this rank's states, rank 0's commits).
TEST(Checkpoint, StrayTemporariesAreRemovedOnLoad) {
  auto comm = make_single_comm();
  const nlohmann::json identity = {{"job", "tmp"}};
  TempDir dir;
  two_commits(dir, identity, *comm);
  for (const char* name : {"state-3-rank0.bin.tmp-4242", "commit-3.json.tmp-4242", "notes.txt"})
    write_text(dir.str(std::string("ck/") + name), "x");
  ASSERT_TRUE(CheckpointStore(dir.str("ck"), identity, *comm).load(false).has_value());
  EXPECT_FALSE(fs::exists(dir.str("ck/state-3-rank0.bin.tmp-4242")));
  EXPECT_FALSE(fs::exists(dir.str("ck/commit-3.json.tmp-4242")));
  EXPECT_TRUE(fs::exists(dir.str("ck/notes.txt"))) << "only temporaries of crosskv's own files are removed";
}
