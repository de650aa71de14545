#include "artifact/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <limits>
#include <set>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/atomic_file.hpp"

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

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    const unsigned char c = p[i];
    int n = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(n) >= s.size()) return false;
    for (int k = 1; k <= n; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

size_t dtype_size(const std::string& d) {
  if (d == "F32") return 4;
  if (d == "BF16" || d == "F16") return 2;
  return 0;
}

// An input error that names the file.
struct Refusal {
  const std::string& path;
  InputError operator()(const std::string& what) const { return InputError(path + ": " + what); }
};

// A tensor's place in the data section.
struct Span {
  std::string name;
  uint64_t begin, end;
};

// The JSON header, after its length (set in len); duplicate tensor names are caught while parsing, since a JSON
// object would merge them silently.
nlohmann::json read_header(const std::string& bytes, const Refusal& bad, uint64_t& len) {
  if (bytes.size() < 8) throw bad("not a safetensors file (" + std::to_string(bytes.size()) + " bytes, header length missing)");
  len = 0;
  for (int i = 0; i < 8; ++i) len |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  if (len > kMaxHeaderBytes) throw bad("safetensors header length " + std::to_string(len) + " is over the 100 MB limit");
  if (len > bytes.size() - 8)
    throw bad("safetensors header length " + std::to_string(len) + " runs past the end of the file (" +
              std::to_string(bytes.size()) + " bytes)");
  const std::string h = bytes.substr(8, len);
  if (!valid_utf8(h)) throw bad("safetensors header is not UTF-8");
  if (h.empty() || h[0] != '{') throw bad("safetensors header does not start with '{'");
  std::string duplicate;
  std::set<std::string> top_keys;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(h, [&](int depth, nlohmann::json::parse_event_t ev, nlohmann::json& j) {
      if (ev == nlohmann::json::parse_event_t::key && depth == 1 && !top_keys.insert(j.get<std::string>()).second &&
          duplicate.empty())
        duplicate = j.get<std::string>();
      return true;
    });
  } catch (const nlohmann::json::exception& e) {
    throw bad(std::string("safetensors header is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) throw bad("safetensors header names tensor '" + duplicate + "' twice");
  if (!header.is_object()) throw bad("safetensors header is not a JSON object");
  return header;
}

void check_metadata(const nlohmann::json& v, const Refusal& bad) {
  if (!v.is_object()) throw bad("__metadata__ is not an object");
  for (auto m = v.begin(); m != v.end(); ++m)
    if (!m.value().is_string()) throw bad("__metadata__ value '" + m.key() + "' is not a string");
}

// One tensor's entry: its dtype and shape into t, its span checked against the data section.
Span read_entry(const std::string& name, const nlohmann::json& v, uint64_t data_bytes, const Refusal& bad,
                TensorIn& t) {
  const std::string where = "tensor '" + name + "'";
  if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
    throw bad(where + " needs dtype, shape and data_offsets");
  if (!v["dtype"].is_string()) throw bad(where + ": dtype is not a string");
  t.dtype = v["dtype"].get<std::string>();
  const size_t esize = dtype_size(t.dtype);
  if (esize == 0) throw bad(where + " has unknown or unsupported dtype '" + t.dtype + "' (expected F32, BF16 or F16)");
  if (!v["shape"].is_array()) throw bad(where + ": shape is not an array");
  uint64_t count = 1;
  for (const auto& d : v["shape"]) {
    if (!d.is_number_unsigned()) throw bad(where + ": shape has a non-integer or negative dimension");
    const uint64_t n = d.get<uint64_t>();
    if (n != 0 && count > std::numeric_limits<uint64_t>::max() / esize / n)
      throw bad(where + ": shape's element count overflows");
    count *= n;
    t.shape.push_back(static_cast<int64_t>(n));
  }
  const auto& off = v["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
    throw bad(where + ": data_offsets must be two non-negative integers");
  const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
  if (b > e) throw bad(where + ": data_offsets begin after they end");
  if (e > data_bytes)
    throw bad(where + ": data_offsets run past the end of the file (" + std::to_string(e) + " > " +
              std::to_string(data_bytes) + " data bytes)");
  if (count * esize != e - b)
    throw bad(where + ": shape holds " + std::to_string(count) + " " + t.dtype + " elements (" +
              std::to_string(count * esize) + " bytes) but data_offsets span " + std::to_string(e - b) + " bytes");
  return {name, b, e};
}

// The spans, sorted by begin, must tile the data section: no overlap, no gap, nothing after the last.
void check_tiling(const std::vector<Span>& spans, uint64_t data_bytes, const Refusal& bad) {
  uint64_t at = 0;
  for (const auto& e : spans) {
    if (e.begin < at) throw bad("tensor '" + e.name + "' overlaps the previous tensor's data");
    if (e.begin > at) throw bad("gap of " + std::to_string(e.begin - at) + " bytes before tensor '" + e.name + "'");
    at = e.end;
  }
  if (at != data_bytes) throw bad(std::to_string(data_bytes - at) + " trailing bytes after the last tensor");
}

// A tensor's bytes to fp32 values.
void decode(const char* raw, uint64_t bytes, TensorIn& t) {
  if (t.dtype == "F32") {
    t.values.resize(bytes / 4);
    std::memcpy(t.values.data(), raw, bytes);
    return;
  }
  t.values.resize(bytes / 2);
  for (size_t i = 0; i < t.values.size(); ++i) {
    uint16_t u;
    std::memcpy(&u, raw + 2 * i, 2);
    t.values[i] = t.dtype == "BF16" ? bf16_to_float(u) : fp16_to_float(u);
  }
}

}  // namespace

std::map<std::string, TensorIn> parse_safetensors(const std::string& bytes, const std::string& path) {
  const Refusal bad{path};
  uint64_t len = 0;
  const nlohmann::json header = read_header(bytes, bad, len);
  const uint64_t data_bytes = bytes.size() - 8 - len;
  std::vector<Span> spans;
  std::map<std::string, TensorIn> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      check_metadata(it.value(), bad);
      continue;
    }
    TensorIn t;
    spans.push_back(read_entry(it.key(), it.value(), data_bytes, bad, t));
    out.emplace(it.key(), std::move(t));
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  check_tiling(spans, data_bytes, bad);
  const char* data = bytes.data() + 8 + len;
  for (const auto& e : spans) decode(data + e.begin, e.end - e.begin, out[e.name]);
  return out;
}

std::map<std::string, TensorIn> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open safetensors file");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw InputError(path + ": read error");
  return parse_safetensors(bytes, path);
}

}  // namespace crosskv
