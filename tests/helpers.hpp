#pragma once
// Shared test helpers: temporary folders, synthetic stores, configs, fits through the library.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <string>

#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "fit/config.hpp"
#include "core/error.hpp"
#include "io/h5.hpp"
#include "fit/fit_pipeline.hpp"
#include "fit/round.hpp"
#include "tools/synth.hpp"

namespace crosskv::test {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "crosskv";
    for (auto& c : name)
      if (c == '/') c = '_';
    path_ = fs::temp_directory_path() / ("crosskv-test-" + std::to_string(::getpid()) + "-" +
                                         std::to_string(counter++) + "-" + name);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string str(const std::string& sub = "") const { return sub.empty() ? path_.string() : (path_ / sub).string(); }

 private:
  fs::path path_;
};

inline SynthOptions small_synth(const std::string& out, uint64_t seed = 7) {
  SynthOptions o = default_synth_options();
  o.out = out;
  o.source.n_layers = 6;
  o.source.n_kv_heads = 2;
  o.source.head_dim = 16;
  o.source.rope.rotary_dim = 16;
  o.source.n_q_heads = 4;
  o.target.n_layers = 8;
  o.target.n_kv_heads = 2;
  o.target.head_dim = 16;
  o.target.rope.rotary_dim = 16;
  o.target.n_q_heads = 4;
  o.shards_per_domain = 2;
  o.sequences_per_shard = 4;
  o.seq_len = 128;
  o.seed = seed;
  o.chunk_tokens = 64;
  return o;
}

// Flips one bit of byte `at` in the first stored chunk of `dataset` in the HDF5 file `path` (its Fletcher-32 then
// fails when that chunk is read); with `keep_time` the file's modification time is put back, so that only a read
// of the chunk can tell.
inline void flip_chunk_byte(const std::string& path, const char* dataset, int64_t at, bool keep_time = false) {
  const auto when = fs::last_write_time(path);
  haddr_t addr = 0;
  {
    h5::quiet();
    h5::Handle f(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    h5::Handle d(H5Dopen2(f, dataset, H5P_DEFAULT), H5Dclose);
    h5::Handle space(H5Dget_space(d), H5Sclose);
    hsize_t offset[4];
    unsigned mask = 0;
    hsize_t size = 0;
    ASSERT_GE(H5Dget_chunk_info(d, space, 0, offset, &mask, &addr, &size), 0) << path << ": " << dataset;
    ASSERT_GT(static_cast<int64_t>(size), at);
  }
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(addr) + at);
  char b = 0;
  io.read(&b, 1);
  b ^= 0x04;  // a low mantissa bit: the value stays finite and plausible
  io.seekp(static_cast<std::streamoff>(addr) + at);
  io.write(&b, 1);
  io.close();
  if (keep_time) fs::last_write_time(path, when);
}

inline void write_text(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << text;
}

// A config over <dir>/source and <dir>/target writing to <dir>/<out>.
inline std::string config_yaml(const std::string& dir, const std::string& fit = "{k: [1, 2, all], lambda: 0.01}",
                               const std::string& out = "out", const std::string& extra = "") {
  return "source: {store: " + dir + "/source}\ntarget: {store: " + dir + "/target}\nfit: " + fit +
         "\noutput: {dir: " + dir + "/" + out + "}\nruntime: {block_tokens: 200}\n" + extra;
}

// Adds a per-token `weights` dataset (float32, w.size() rows) to a shard.
inline void add_weights(const std::string& path, const std::vector<float>& w) {
  h5::quiet();
  h5::Handle f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
  ASSERT_TRUE(f.valid()) << path;
  hsize_t n = w.size();
  h5::Handle s(H5Screate_simple(1, &n, nullptr), H5Sclose);
  h5::Handle d(H5Dcreate2(f, "weights", H5T_IEEE_F32LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
  ASSERT_TRUE(d.valid()) << path;
  ASSERT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, w.data()), 0);
}

// A file's bytes ("" when it cannot be read).
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline FitResult fit_with(const FitConfig& cfg) {
  static bool quiet = [] {
    spdlog::set_level(spdlog::level::warn);
    return true;
  }();
  (void)quiet;
  auto comm = make_single_comm();
  auto be = make_cpu_backend();
  Context ctx{*comm, *be};
  return run_fit(cfg, FitOptions{}, ctx);
}

inline FitResult fit_yaml(const std::string& yaml, const std::string& name = "cfg.yaml") {
  return fit_with(parse_fit_config(yaml, name));
}

// A Moments' live state flat, in the order reductions and checkpoints use (Moments::live_pieces), read on the host;
// and written back. Tests' oracle of the layout.
inline void pack_live(const Moments& m, std::vector<float>& f, std::vector<double>& d) {
  std::vector<ComputeBackend::SumPiece<float>> pf;
  std::vector<ComputeBackend::SumPiece<double>> pd;
  LiveState::pieces(const_cast<Moments&>(m), pf, pd);
  f.resize(static_cast<size_t>(flat_size(pf)));
  d.resize(static_cast<size_t>(flat_size(pd)));
  auto cpu = make_cpu_backend();
  cpu->copy_sums(pf, 0, flat_size(pf), f.data(), false);
  cpu->copy_sums(pd, 0, flat_size(pd), d.data(), false);
}
inline void unpack_live(Moments& m, const float* f, const double* d) {
  std::vector<ComputeBackend::SumPiece<float>> pf;
  std::vector<ComputeBackend::SumPiece<double>> pd;
  LiveState::pieces(m, pf, pd);
  place_sums(pf, 0, flat_size(pf), f);
  LiveState::unpack_doubles(m, d);
}

// Runs fn, expects an exception of type E whose message contains every one of `parts`.
template <class E>
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << (parts.empty() ? "" : parts[0]) << "'";
  } catch (const E& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_THAT(msg, ::testing::HasSubstr(p));
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "error message must be one line: " << msg;
  }
}

}  // namespace crosskv::test
