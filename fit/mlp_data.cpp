#include "fit/mlp_data.hpp"

#include <algorithm>

#include "core/rope.hpp"
#include "io/shard.hpp"

namespace crosskv {
namespace {

uint64_t splitmix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

bool validation_sequence(const std::string& rel, int64_t s, const MlpSettings& c) {
  const uint64_t z = splitmix(fnv1a(rel) ^ splitmix(static_cast<uint64_t>(s) * 0x100000001b3ull + c.seed));
  return static_cast<double>(z >> 11) / static_cast<double>(uint64_t{1} << 53) < c.val_fraction;
}

std::vector<ShardRows> plan_rows(const Calibration& cal, int T, int token_group) {
  std::vector<ShardRows> out;
  const int64_t stride = cal.cfg.calibration.token_stride;
  size_t i = 0;
  for (const ShardPair& sh : cal.shards) {
    if (static_cast<int>(i++ % T) != token_group) continue;
    const ShardReader src(sh.source_path);
    const auto offs = src.seq_offsets();
    ShardRows r{&sh, {}, {}, src.positions(), ShardReader(sh.target_path).positions()};
    for (int64_t u = 0; u < sh.used; ++u) {
      const int64_t t = u * stride;
      const auto s = std::upper_bound(offs.begin(), offs.end(), t) - offs.begin() - 1;
      r.rows.push_back(t);
      r.validation.push_back(validation_sequence(sh.rel, s, cal.cfg.fit.mlp) ? 1 : 0);
    }
    out.push_back(std::move(r));
  }
  for (const ShardPair& sh : cal.eval_shards) {
    if (static_cast<int>(i++ % T) != token_group) continue;
    const ShardReader src(sh.source_path);
    const int64_t tokens = src.header().tokens;
    ShardRows r{&sh, {}, {}, src.positions(), ShardReader(sh.target_path).positions()};
    for (int64_t t = 0; t < tokens; t += stride) r.rows.push_back(t), r.validation.push_back(1);
    out.push_back(std::move(r));
  }
  return out;
}

LayerData load_layer_data(const Calibration& cal, const std::vector<ShardRows>& share,
                          const std::vector<int>& sources, int l, Kind kind) {
  const Rope rs(cal.source), rt(cal.target);
  const int64_t F = cal.source.features_per_layer(), G = cal.target.features_per_layer();
  const int64_t K = static_cast<int64_t>(sources.size()) * F;
  const char* dataset = kind_dataset(kind);
  LayerData d;
  std::vector<uint16_t> raw;
  for (const ShardRows& sr : share) {
    const ShardReader src(sr.pair->source_path), tgt(sr.pair->target_path);
    const int64_t T = src.header().tokens;
    std::vector<float> xs(T * K), ys(T * G), layer(T * F);
    for (size_t j = 0; j < sources.size(); ++j) {
      src.read_layer(dataset, sources[j], layer.data(), raw);
      if (strips_rope(kind)) rs.strip_block(layer.data(), T, rs.one(sources[j]), sr.source_positions.data());
      for (int64_t t = 0; t < T; ++t)
        std::copy_n(layer.data() + t * F, F, xs.data() + t * K + static_cast<int64_t>(j) * F);
    }
    tgt.read_layer(dataset, l, ys.data(), raw);
    if (strips_rope(kind)) rt.strip_block(ys.data(), T, rt.one(l), sr.target_positions.data());
    for (size_t i = 0; i < sr.rows.size(); ++i) {
      const int64_t t = sr.rows[i];
      const int split = sr.validation[i];
      d.x[split].insert(d.x[split].end(), xs.begin() + t * K, xs.begin() + (t + 1) * K);
      d.y[split].insert(d.y[split].end(), ys.begin() + t * G, ys.begin() + (t + 1) * G);
      ++d.rows[split];
    }
  }
  return d;
}

}  // namespace crosskv
