#include "core/atomic_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <regex>

#include "core/error.hpp"

namespace crosskv {
namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

std::string temp_name_for(const std::string& path) { return path + ".tmp-" + std::to_string(::getpid()); }

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) throw SystemError("open(" + dir + ") for fsync: " + errno_text());
  ::fsync(fd);
  ::close(fd);
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)), tmp_(temp_name_for(path_)) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw InputError(tmp_ + ": cannot create file: " + errno_text());
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd_, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw SystemError("write(" + tmp_ + ", " + std::to_string(n) + " bytes): " + errno_text());
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) throw SystemError("fsync(" + tmp_ + "): " + errno_text());
  if (::close(fd_) != 0) throw SystemError("close(" + tmp_ + "): " + errno_text());
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw SystemError("rename(" + tmp_ + ", " + path_ + "): " + errno_text());
  committed_ = true;
  fsync_dir(std::filesystem::path(path_).parent_path().string());
}

void write_file_atomic(const std::string& path, const std::string& content) {
  AtomicFile f(path);
  f.write(content.data(), content.size());
  f.commit();
}

void commit_file(const std::string& tmp, const std::string& path) {
  int fd = ::open(tmp.c_str(), O_RDONLY);
  if (fd < 0) throw SystemError("open(" + tmp + "): " + errno_text());
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw SystemError("fsync(" + tmp + "): " + errno_text());
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw SystemError("rename(" + tmp + ", " + path + "): " + errno_text());
  fsync_dir(std::filesystem::path(path).parent_path().string());
}

std::vector<std::string> remove_files_matching(const std::string& dir, const std::string& pattern) {
  const std::regex re(pattern);
  std::error_code ec;
  std::vector<std::string> matched;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (std::regex_match(e.path().filename().string(), re)) matched.push_back(e.path().string());
  for (const auto& p : matched) std::filesystem::remove(p, ec);
  return matched;
}

}  // namespace crosskv
