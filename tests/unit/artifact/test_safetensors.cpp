#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "artifact/safetensors.hpp"
#include "core/atomic_file.hpp"
#include "core/half.hpp"
#include "helpers.hpp"

using namespace crosskv;
using namespace crosskv::test;

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
