#include "io/safetensors.hpp"

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/half.hpp"
#include "io/atomic_file.hpp"

namespace crosskv {

void write_safetensors(const std::string& path, const std::vector<TensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& t : tensors) {
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8 != 0) h += ' ';
  uint64_t len = h.size();
  unsigned char len_le[8];
  for (int i = 0; i < 8; ++i) len_le[i] = static_cast<unsigned char>(len >> (8 * i));
  AtomicFile f(path);
  f.write(len_le, 8);
  f.write(h.data(), h.size());
  for (const auto& t : tensors) f.write(t.data, t.bytes);
  f.commit();
}

std::map<std::string, TensorIn> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open safetensors file");
  unsigned char len_le[8];
  if (!in.read(reinterpret_cast<char*>(len_le), 8)) throw InputError(path + ": truncated safetensors header");
  uint64_t len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(len_le[i]) << (8 * i);
  if (len > (uint64_t{1} << 30)) throw InputError(path + ": implausible safetensors header length");
  std::string h(len, '\0');
  if (!in.read(h.data(), static_cast<std::streamsize>(len))) throw InputError(path + ": truncated safetensors header");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(h);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": safetensors header is not JSON: " + e.what());
  }
  std::map<std::string, TensorIn> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    TensorIn t;
    t.dtype = it.value().at("dtype").get<std::string>();
    t.shape = it.value().at("shape").get<std::vector<int64_t>>();
    auto off = it.value().at("data_offsets").get<std::vector<uint64_t>>();
    const size_t bytes = off.at(1) - off.at(0);
    std::vector<char> raw(bytes);
    in.seekg(static_cast<std::streamoff>(8 + len + off[0]));
    if (!in.read(raw.data(), static_cast<std::streamsize>(bytes)))
      throw InputError(path + ": tensor '" + it.key() + "' is truncated");
    if (t.dtype == "F32") {
      t.values.resize(bytes / 4);
      std::memcpy(t.values.data(), raw.data(), bytes);
    } else if (t.dtype == "BF16" || t.dtype == "F16") {
      t.values.resize(bytes / 2);
      for (size_t i = 0; i < t.values.size(); ++i) {
        uint16_t u;
        std::memcpy(&u, raw.data() + 2 * i, 2);
        t.values[i] = t.dtype == "BF16" ? bf16_to_float(u) : fp16_to_float(u);
      }
    } else {
      throw InputError(path + ": tensor '" + it.key() + "' has unsupported dtype " + t.dtype);
    }
    out.emplace(it.key(), std::move(t));
  }
  return out;
}

}  // namespace crosskv
