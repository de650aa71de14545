#pragma once
// The one element type of stored tensors: shards' keys, values and queries, the backend's staged blocks, and the
// artifacts' weights. Its names: "float32" / "float16" / "bfloat16" in shards (docs/FORMATS.md, Calibration shards), "fp32" / "fp16" / "bf16" in
// configs and manifests (docs/FORMATS.md, Mapper artifact).
#include <cstddef>
#include <optional>
#include <string_view>

namespace crosskv {

enum class Dtype : int { f32 = 0, f16 = 1, bf16 = 2 };  // the values are the CUDA kernels' too

inline size_t dtype_bytes(Dtype d) { return d == Dtype::f32 ? 4 : 2; }
// The shard name: float32, float16, bfloat16.
inline const char* to_string(Dtype d) { return d == Dtype::f32 ? "float32" : d == Dtype::f16 ? "float16" : "bfloat16"; }
// The dtype of a shard name, or none for another string.
inline std::optional<Dtype> dtype_from_string(std::string_view s) {
  for (Dtype d : {Dtype::f32, Dtype::f16, Dtype::bf16})
    if (s == to_string(d)) return d;
  return std::nullopt;
}
// The config and manifest name: fp32, fp16, bf16.
inline const char* weight_dtype_name(Dtype d) { return d == Dtype::f32 ? "fp32" : d == Dtype::f16 ? "fp16" : "bf16"; }

}  // namespace crosskv
