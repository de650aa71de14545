#include "core/sealed_file.hpp"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "core/sha256.hpp"

namespace crosskv {
namespace {

constexpr size_t kDigestChunk = size_t{64} << 20;
constexpr size_t kHexDigest = 64;

// A few chunks: what the writer and the reader buffer, hashed in parallel.
size_t batch_bytes() { return kDigestChunk * static_cast<size_t>(std::clamp(omp_get_max_threads(), 1, 8)); }

// Hashes `bytes` at `data` (whole chunks, but for a file's last) in parallel, appending one digest per chunk.
void hash_chunks(const char* data, size_t bytes, std::vector<std::string>& digests) {
  const auto n = static_cast<int64_t>((bytes + kDigestChunk - 1) / kDigestChunk);
  const size_t first = digests.size();
  digests.resize(first + n);
  bool failed = false;
#pragma omp parallel for schedule(dynamic) if (n > 1)
  for (int64_t c = 0; c < n; ++c) {
    try {
      const size_t lo = c * kDigestChunk;
      Sha256 h;
      h.update(data + lo, std::min(kDigestChunk, bytes - lo));
      digests[first + c] = h.hex();
    } catch (...) {
#pragma omp atomic write
      failed = true;
    }
  }
  if (failed) throw SystemError("SHA-256 of a sealed file failed");
}

std::string digest_of(const std::vector<std::string>& digests) {
  Sha256 h;
  for (const std::string& d : digests) h.update(d.data(), d.size());
  return h.hex();
}

// Padded with spaces to a multiple of 8 bytes, so that a payload of 8-byte fields keeps its values aligned.
std::string first_line(const SealId& id) {
  std::string line = nlohmann::json{{"format", id.format}, {"version", id.version}, {"identity", id.identity}}.dump();
  line.append(7 - line.size() % 8, ' ');
  return line + "\n";
}

}  // namespace

SealedWriter::SealedWriter(const std::string& path, const SealId& id) : file_(path) {
  const std::string head = first_line(id);
  write(head.data(), head.size());
}

void SealedWriter::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  write_from(n, [p](size_t off, size_t len, char* dst) { std::memcpy(dst, p + off, len); });
}

void SealedWriter::write_from(size_t n, const std::function<void(size_t, size_t, char*)>& fill) {
  const size_t batch = batch_bytes();
  for (size_t done = 0; done < n;) {
    const size_t k = std::min({n - done, batch - len_, kDigestChunk});
    if (len_ + k > buf_.size()) buf_.resize(std::min(batch, std::max(2 * buf_.size(), len_ + k)));  // small files stay small
    fill(done, k, buf_.data() + len_);
    len_ += k;
    done += k;
    if (len_ == batch) drain();  // whole chunks: the next batch starts on a chunk boundary
  }
}

void SealedWriter::drain() {
  hash_chunks(buf_.data(), len_, digests_);
  file_.write(buf_.data() + on_disk_, len_ - on_disk_);
  written_ += len_;
  len_ = on_disk_ = 0;
}

void SealedWriter::flush() {
  file_.write(buf_.data() + on_disk_, len_ - on_disk_);
  on_disk_ = len_;
}

void SealedWriter::commit() {
  drain();
  const std::string hex = digest_of(digests_);
  file_.write(hex.data(), hex.size());
  file_.commit();
}

SealedReader::SealedReader(const std::string& path, const SealId& id) : in_(path, std::ios::binary) {
  if (!in_) {
    why_ = "missing";
    return;
  }
  in_.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in_.tellg());
  in_.seekg(0);
  std::string head;
  if (!std::getline(in_, head) || size < head.size() + 1 + kHexDigest) {
    why_ = "truncated";
    return;
  }
  const nlohmann::json h = nlohmann::json::parse(head, nullptr, /*allow_exceptions=*/false);
  if (!h.is_object() || !h.contains("format") || !h.contains("identity")) {
    why_ = "not a sealed file";
    return;
  }
  if (h["format"] != id.format || h.value("version", -1) != id.version) {
    why_ = "a " + h["format"].dump() + " file of version " + h.value("version", nlohmann::json()).dump() + ", not " +
           id.format + " version " + std::to_string(id.version);
    return;
  }
  if (h["identity"] != id.identity) {
    why_ = "of another identity";
    return;
  }
  // The first line is hashed with the payload: read everything before the digest through the buffer again.
  in_.seekg(0);
  total_ = left_ = size - kHexDigest;
  if (!read(nullptr, head.size() + 1)) why_ = "unreadable";
}

bool SealedReader::refill() {
  if (len_ > 0) hash_chunks(buf_.data(), len_, digests_);
  len_ = pos_ = 0;
  if (left_ == 0) return false;
  if (buf_.empty()) buf_.resize(static_cast<size_t>(std::min<uint64_t>(batch_bytes(), total_)));
  const size_t n = static_cast<size_t>(std::min<uint64_t>(buf_.size(), left_));
  if (!in_.read(buf_.data(), static_cast<std::streamsize>(n))) return false;
  left_ -= n;
  len_ = n;
  return true;
}

bool SealedReader::read(void* dst, uint64_t n) {
  auto* d = static_cast<char*>(dst);
  while (n > 0) {
    if (pos_ == len_ && !refill()) return false;
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n, len_ - pos_));
    if (d) {
      std::memcpy(d, buf_.data() + pos_, k);
      d += k;
    }
    pos_ += k;
    n -= k;
  }
  return true;
}

uint64_t SealedReader::offset() const { return total_ - left_ - (len_ - pos_); }
uint64_t SealedReader::remaining() const { return left_ + (len_ - pos_); }

std::string SealedReader::finish() {
  CROSSKV_ASSERT(ok(), "finish() of a sealed file that did not open");
  if (remaining() != 0) return "longer than its payload";
  if (len_ > 0) hash_chunks(buf_.data(), len_, digests_);
  len_ = pos_ = 0;
  std::string hex(kHexDigest, '\0');
  if (!in_.read(hex.data(), kHexDigest)) return "truncated";
  return digest_of(digests_) == hex ? "" : "checksum mismatch";
}

nlohmann::json read_seal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string head;
  if (!in || !std::getline(in, head)) return nullptr;
  nlohmann::json h = nlohmann::json::parse(head, nullptr, /*allow_exceptions=*/false);
  return h.is_object() && h.contains("format") && h.contains("identity") ? h : nullptr;
}

void write_sealed(const std::string& path, const SealId& id, const std::string& payload) {
  SealedWriter w(path, id);
  w.write(payload.data(), payload.size());
  w.commit();
}

std::optional<std::string> read_sealed(const std::string& path, const SealId& id, std::string* why) {
  SealedReader r(path, id);
  std::string payload, bad = r.why();
  if (r.ok()) {
    payload.resize(static_cast<size_t>(r.remaining()));
    bad = r.read(payload.data(), payload.size()) ? r.finish() : "truncated";
  }
  if (why) *why = bad;
  if (!bad.empty()) return std::nullopt;
  return payload;
}

}  // namespace crosskv
