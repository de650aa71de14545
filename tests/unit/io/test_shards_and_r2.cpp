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
#include "fit/checkpoint.hpp"

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

TEST(R2File, RoundTrip) {
  TempDir tmp;
  ProbeR2 p{2, 3, 2, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {}, {}};
  write_r2_file(tmp.str("r2.h5"), {{Kind::k, p}, {Kind::v, p}, {Kind::k_rope, p}}, {{"probe", "same_head"}});
  auto r = read_r2_file(tmp.str("r2.h5"));
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[Kind::k].mean, p.mean);
  EXPECT_EQ(r[Kind::v].per_head, p.per_head);
  EXPECT_EQ(r[Kind::k_rope].H, 2);
}
