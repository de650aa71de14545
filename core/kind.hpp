#pragma once
// Keys or values: what a moment, an R² matrix, a mapper's tensor, a residual MLP or a layer file's entry is of
// (docs/METHOD.md, RoPE and content space).
#include <array>
#include <cstddef>

#include "core/error.hpp"

namespace crosskv {

// k: keys in content space (RoPE stripped); k_rope: keys as the cache holds them (RoPE left in: the probe's
// comparison only, never mapped); v: values.
enum class Kind { k, k_rope, v };

// Every kind, in the order of the fit's moments and of shifts.bin; the two a mapper maps, in the order files hold them.
inline constexpr std::array<Kind, 3> kAllKinds{Kind::k, Kind::k_rope, Kind::v};
inline constexpr std::array<Kind, 2> kMappedKinds{Kind::k, Kind::v};

// "k", "k_rope", "v": the kind's name in files (tensor names, R² datasets, manifests, checkpoints) and logs.
constexpr const char* kind_name(Kind k) { return k == Kind::k ? "k" : k == Kind::k_rope ? "k_rope" : "v"; }
// "keys" or "values": the shard dataset the kind is read from.
constexpr const char* kind_dataset(Kind k) { return k == Kind::v ? "values" : "keys"; }
// Keys in content space are RoPE-stripped; raw keys and values are taken as they are.
constexpr bool strips_rope(Kind k) { return k == Kind::k; }
constexpr size_t kind_index(Kind k) { return static_cast<size_t>(k); }  // in kAllKinds
constexpr int mapped_index(Kind k) { return k == Kind::v ? 1 : 0; }         // in kMappedKinds

// One value per mapped kind (k, v), indexed by Kind.
template <class T>
struct ByKind {
  T k{}, v{};
  T& operator[](Kind x) {
    CROSSKV_ASSERT(x != Kind::k_rope, "raw keys are never mapped");
    return x == Kind::v ? v : k;
  }
  const T& operator[](Kind x) const { return const_cast<ByKind&>(*this)[x]; }
};

}  // namespace crosskv
