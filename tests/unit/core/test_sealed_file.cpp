#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "core/sealed_file.hpp"
#include "helpers.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

const SealId kId{"crosskv-test", 2, {{"job", "a"}, {"rank", 1}}};

void flip_byte(const std::string& path, std::streamoff at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(at);
  f.write(&c, 1);
}

}  // namespace

TEST(SealedFile, RoundTripsAndNamesItsIdentity) {
  TempDir tmp;
  const std::string path = tmp.str("f");
  write_sealed(path, kId, "payload bytes");
  std::string why = "?";
  EXPECT_EQ(read_sealed(path, kId, &why).value_or("absent"), "payload bytes");
  EXPECT_EQ(why, "");
  const nlohmann::json head = read_seal(path);
  EXPECT_EQ(head["format"], "crosskv-test");
  EXPECT_EQ(head["identity"], kId.identity);
  // The first line is padded so that the payload starts 8-byte aligned.
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ((line.size() + 1) % 8, 0u);
  write_sealed(tmp.str("empty"), kId, "");
  EXPECT_EQ(read_sealed(tmp.str("empty"), kId).value_or("absent"), "");
}

// Each way a file can be wrong reads as absent, with the reason; none of them is mistaken for the payload.
TEST(SealedFile, RefusesAnotherFormatIdentityAndEveryDamage) {
  TempDir tmp;
  const std::string path = tmp.str("f");
  write_sealed(path, kId, std::string(1000, 'x'));
  auto why_of = [&](const std::string& p, const SealId& id) {
    std::string why;
    EXPECT_FALSE(read_sealed(p, id, &why).has_value());
    return why;
  };
  EXPECT_EQ(why_of(tmp.str("none"), kId), "missing");
  EXPECT_EQ(why_of(path, {"crosskv-test", 3, kId.identity}), "a \"crosskv-test\" file of version 2, not crosskv-test version 3");
  EXPECT_EQ(why_of(path, {"crosskv-other", 2, kId.identity}).rfind("a \"crosskv-test\" file", 0), 0u);
  EXPECT_EQ(why_of(path, {"crosskv-test", 2, {{"job", "b"}, {"rank", 1}}}), "of another identity");
  const auto size = fs::file_size(path);
  fs::copy_file(path, tmp.str("payload"));
  flip_byte(tmp.str("payload"), static_cast<std::streamoff>(size / 2));
  EXPECT_EQ(why_of(tmp.str("payload"), kId), "checksum mismatch");
  fs::copy_file(path, tmp.str("digest"));
  flip_byte(tmp.str("digest"), static_cast<std::streamoff>(size - 1));
  EXPECT_EQ(why_of(tmp.str("digest"), kId), "checksum mismatch");
  fs::copy_file(path, tmp.str("short"));
  fs::resize_file(tmp.str("short"), size - 100);
  EXPECT_EQ(why_of(tmp.str("short"), kId), "checksum mismatch");  // its last 64 bytes are payload, not the digest
  fs::resize_file(tmp.str("short"), 20);
  EXPECT_EQ(why_of(tmp.str("short"), kId), "truncated");
  std::ofstream(tmp.str("text")) << "not a sealed file\n" << std::string(100, 'y');
  EXPECT_EQ(why_of(tmp.str("text"), kId), "not a sealed file");
}

// A payload over one 64 MiB chunk, written in pieces that straddle the chunk boundary (write_from), reads back
// whole: the chunks hash the same way both ways. A flipped byte in the second chunk is caught.
TEST(SealedFile, PayloadsOverAChunkHashTheSameBothWays) {
  TempDir tmp;
  const std::string path = tmp.str("big");
  const size_t n = (size_t{64} << 20) + 12345;
  std::string payload(n, '\0');
  std::mt19937_64 rng(5);
  for (auto& c : payload) c = static_cast<char>(rng());
  {
    SealedWriter w(path, kId);
    w.write(payload.data(), 1000);
    w.write_from(n - 1000, [&](size_t off, size_t len, char* dst) { std::memcpy(dst, payload.data() + 1000 + off, len); });
    w.commit();
  }
  SealedReader r(path, kId);
  ASSERT_TRUE(r.ok()) << r.why();
  std::string got(n, '\0');
  ASSERT_TRUE(r.read(got.data(), n));
  EXPECT_EQ(r.finish(), "");
  EXPECT_TRUE(got == payload);
  flip_byte(path, static_cast<std::streamoff>(fs::file_size(path) - 1000));
  std::string why;
  EXPECT_FALSE(read_sealed(path, kId, &why).has_value());
  EXPECT_EQ(why, "checksum mismatch");
}

// An unfinished write leaves only its temporary (flushed bytes, no digest), never a file under the final name.
TEST(SealedFile, AnUncommittedWriteLeavesNothingUnderItsName) {
  TempDir tmp;
  const std::string path = tmp.str("f");
  {
    SealedWriter w(path, kId);
    w.write("abc", 3);
    w.flush();
  }
  EXPECT_FALSE(fs::exists(path));
}
