#pragma once
// The fit's blocks of calibration rows: one shard pair's strided rows as stored, read with the target's token
// weights and, on a host backend, the moments' inputs prepared (RoPE-stripped, shifted). Used by the streaming pass
// and by the provisional shifts.
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/kind.hpp"
#include "core/rope.hpp"
#include "fit/calibration.hpp"
#include "io/shard.hpp"

namespace crosskv {

// One dataset of one block as stored: fp32 in f32, bf16/fp16 bits in u16.
struct Stored {
  Dtype dtype = Dtype::f32;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  int64_t cols = 0;
  ComputeBackend::StoredBlock block(int64_t rows) const {
    using S = Dtype;
    const S t = dtype == Dtype::f32 ? S::f32 : dtype == Dtype::f16 ? S::f16 : S::bf16;
    return {dtype == Dtype::f32 ? static_cast<const void*>(f32.data()) : u16.data(), t, rows, cols};
  }
  ComputeBackend::HostSpan span() const {
    return dtype == Dtype::f32 ? ComputeBackend::floats(f32.data(), static_cast<int64_t>(f32.size()))
                                     : ComputeBackend::HostSpan{u16.data(), static_cast<int64_t>(u16.size() * 2)};
  }
};

// A block of rows: stored keys and values of both sides and their positions; on a host backend also the moments'
// inputs of each kind (fp32, keys RoPE-stripped, shifted), prepared by the reader thread.
struct Block {
  int64_t rows = 0;
  Stored sk, sv, tk, tv;
  std::vector<int32_t> spos, tpos;
  std::array<std::vector<float>, kAllKinds.size()> x, y;  // by kind_index
  std::vector<float> sqrt_w;  // fit.weighting: dataset: sqrt of the target's per-token weights
  double weight_sum = 0;
  RowWeights weights() const { return sqrt_w.empty() ? RowWeights{} : RowWeights{sqrt_w.data(), weight_sum}; }
  const Stored& source(Kind k) const { return k == Kind::v ? sv : sk; }
  const Stored& target(Kind k) const { return k == Kind::v ? tv : tk; }
};

struct ShardPairReader {
  const ShardPair* pair;
  ShardReader source, target;
};

// The shifts each kind's inputs are prepared about (by kind_index); null: unshifted (the shifts' own read).
struct InputShifts {
  std::array<const float*, kAllKinds.size()> x{}, y{};
};

// Reads rows j0 .. j0+rows-1 of the strided token sequence of one shard pair as stored, and with `weighted` the
// target's token weights; with `host`, also prepares the inputs of `kinds` on the host.
void read_block(ShardPairReader& r, const Rope& rs, const Rope& rt, const Calibration& cal, int64_t j0, int64_t rows,
                const std::vector<Kind>& kinds, bool weighted, const InputShifts* host, Block& b);

}  // namespace crosskv
