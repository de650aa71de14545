#include "io/output_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>

#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"

namespace crosskv {

void OutputLock::acquire(const std::string& dir) {
  path_ = (std::filesystem::path(dir) / ".crosskv-fit.lock").string();
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw InputError("output.dir: cannot create " + path_);
  held_ = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
  if (held_) {
    const std::string who = "pid " + std::to_string(::getpid()) + " on " + host_name();
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) < 0)
      spdlog::warn("cannot record the holder in {}", path_);
  } else {
    char buf[128] = {0};
    if (::pread(fd_, buf, sizeof buf - 1, 0) > 0) holder_ = buf;
    while (!holder_.empty() && std::isspace(static_cast<unsigned char>(holder_.back()))) holder_.pop_back();
  }
}

std::string OutputLock::holder() const { return holder_.empty() ? "see " + path_ : holder_; }

OutputLock::~OutputLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace crosskv
