#include <cmath>

#include "core/half.hpp"
#include "helpers.hpp"

using namespace crosskv;
using namespace crosskv::test;

TEST(Half, Bf16AndFp16RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(float_to_bf16(3.140625f)), 3.140625f);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3f80);  // halfway between 0x3f80 and 0x3f81: even
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3f82);  // halfway between 0x3f81 and 0x3f82: even
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_EQ(fp16_to_float(float_to_fp16(0.5f)), 0.5f);
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
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
