#pragma once
// Sealed files (docs/FORMATS.md, Sealed files): how crosskv keeps state of its own on disk (checkpoint states, the
// provisional shifts, residual-MLP checkpoints, an export's layer records). A sealed file is one line of JSON that
// names its format, version and identity, then its payload, then 64 hex digits: the SHA-256 of the SHA-256 digests
// of the 64 MiB chunks of every byte before them (chunks hash in parallel: a state is as large as the moments).
// Written atomically; read back only when it is of the format, version and identity asked for, whole, and verified.
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/atomic_file.hpp"
#include "core/memory.hpp"

namespace crosskv {

struct SealId {
  std::string format;
  int version = 1;
  nlohmann::json identity = nlohmann::json::object();
};

class SealedWriter {
 public:
  SealedWriter(const std::string& path, const SealId& id);
  void write(const void* data, size_t n);
  // n bytes that `fill` writes straight into the writer's buffer, at most a chunk at a time (no copy in between).
  void write_from(size_t n, const std::function<void(size_t off, size_t len, char* dst)>& fill);
  // The bytes so far to the temporary file, unsealed (for tests that stop a write half way).
  void flush();
  // Seals the file and renames it into place.
  void commit();
  uint64_t bytes() const { return written_ + len_; }  // so far, the first line included

 private:
  void drain();
  AtomicFile file_;
  BigVector<char> buf_;
  size_t len_ = 0, on_disk_ = 0;  // bytes in the buffer; of those, already written to the file
  uint64_t written_ = 0;          // bytes drained before the buffer's
  std::vector<std::string> digests_;
};

class SealedReader {
 public:
  // Opens `path` and reads its first line; ok() when it is a sealed file of `id`, else why() says what it is.
  SealedReader(const std::string& path, const SealId& id);
  bool ok() const { return why_.empty(); }
  const std::string& why() const { return why_; }
  // The next n bytes of the payload to dst (null: skipped, still hashed). False when the payload ends first.
  bool read(void* dst, uint64_t n);
  uint64_t offset() const;     // of the next payload byte, in the file
  uint64_t remaining() const;  // payload bytes not read yet
  // After the whole payload was read: "" when the digest holds, else why not.
  std::string finish();

 private:
  bool refill();
  std::ifstream in_;
  std::string why_;
  uint64_t left_ = 0, total_ = 0;  // bytes before the digest not yet in the buffer; all of them
  BigVector<char> buf_;
  size_t len_ = 0, pos_ = 0;
  std::vector<std::string> digests_;
};

// The first line of a sealed file (format, version, identity), or null when it is not one.
nlohmann::json read_seal(const std::string& path);

// Whole small files.
void write_sealed(const std::string& path, const SealId& id, const std::string& payload);
// The payload when `path` is a sealed file of `id` that verifies; else nullopt, and why not in `why`.
std::optional<std::string> read_sealed(const std::string& path, const SealId& id, std::string* why = nullptr);

}  // namespace crosskv
