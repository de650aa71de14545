// core/bytes.hpp: a record's field list, written and read back by the same function, keeps every field, and its
// bytes are the layout a hand-written writer gave (so checkpoints written before it still read).
#include <cmath>
#include <optional>
#include <vector>

#include <gtest/gtest.h>

#include "core/bytes.hpp"

using namespace crosskv;

namespace {

enum class Colour { red, green, blue };

struct Record {
  int layer = 0;
  bool kept = false;
  Colour colour = Colour::red;
  double score = 0;
  std::vector<float> weights;
  std::vector<double> fixed;
  std::optional<std::vector<int>> extra;
};

template <class R, class IO>
void fields(R& r, IO& io) {
  io.template as<int32_t>(r.layer);
  io.template as<int32_t>(r.kept);
  io.map(r.colour, [](Colour c) { return uint8_t(c == Colour::blue ? 9 : 1); },
         [](uint8_t w) { return w == 9 ? Colour::blue : Colour::red; });
  io(r.score, r.weights);
  io.fixed(r.fixed, 2);
  io.optional(r.extra, [&](auto& e) { io(e); });
}

Record round_trip(const Record& in, std::string* bytes = nullptr) {
  ByteWriter w;
  fields(in, w);
  if (bytes) *bytes = w.bytes();
  Record out;
  ByteReader r(w.bytes(), "a test record");
  fields(out, r);
  EXPECT_TRUE(r.done());
  return out;
}

}  // namespace

TEST(ByteFields, EveryFieldComesBackAsItWasWritten) {
  Record a{7, true, Colour::blue, NAN, {1.5f, -2.0f}, {3.0, 4.0}, std::vector<int>{5, 6, 7}};
  const Record b = round_trip(a);
  EXPECT_EQ(b.layer, 7);
  EXPECT_TRUE(b.kept);
  EXPECT_EQ(b.colour, Colour::blue);
  EXPECT_TRUE(std::isnan(b.score));
  EXPECT_EQ(b.weights, a.weights);
  EXPECT_EQ(b.fixed, a.fixed);
  ASSERT_TRUE(b.extra.has_value());
  EXPECT_EQ(*b.extra, *a.extra);
  a.extra.reset(), a.colour = Colour::green;
  const Record c = round_trip(a);
  EXPECT_FALSE(c.extra.has_value());
  EXPECT_EQ(c.colour, Colour::red) << "through the map's own functions, not a cast";
}

TEST(ByteFields, TheBytesAreTheHandWrittenLayout) {
  const Record a{3, false, Colour::red, 0.25, {1.0f}, {2.0, 8.0}, std::nullopt};
  std::string got;
  round_trip(a, &got);
  ByteWriter want;  // what put() calls in the same order write
  const int32_t head[2] = {3, 0};
  const uint8_t colour = 1, none = 0;
  const double score = 0.25, fixed[2] = {2.0, 8.0};
  const uint64_t n = 1;
  const float w = 1.0f;
  want.put(head, sizeof head), want.put(&colour, 1), want.put(&score, 8), want.put(&n, 8), want.put(&w, 4);
  want.put(fixed, sizeof fixed), want.put(&none, 1);
  EXPECT_EQ(got, want.bytes());
}

TEST(ByteFields, AShortMessageIsABrokenInvariant) {
  ByteWriter w;
  w(int32_t{1});
  Record r;
  ByteReader in(w.bytes(), "a short record");
  EXPECT_DEATH(fields(r, in), "a short record ends early");
}
