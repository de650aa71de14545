#include <filesystem>
#include <fstream>
#include <string>

#include "core/atomic_file.hpp"
#include "helpers.hpp"

using namespace crosskv;
using namespace crosskv::test;

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
