#pragma once
// safetensors files: 8-byte little-endian header length, JSON header, raw little-endian tensor data.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace crosskv {

struct TensorOut {
  std::string name;
  std::string dtype;  // "F32", "BF16", "F16"
  std::vector<int64_t> shape;
  const void* data;
  size_t bytes;
};

// Writes atomically.
void write_safetensors(const std::string& path, const std::vector<TensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata);

struct TensorIn {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<float> values;  // converted to fp32
};
// Reads and validates a whole file: header length within the file and at most 100 MB, UTF-8 JSON object, no
// duplicate names, known dtypes, shapes whose byte size matches their offsets, tensors tiling the data exactly.
// Anything else is an InputError naming `path` and the problem.
std::map<std::string, TensorIn> read_safetensors(const std::string& path);
std::map<std::string, TensorIn> parse_safetensors(const std::string& bytes, const std::string& path);

}  // namespace crosskv
