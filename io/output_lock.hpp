#pragma once
// One job per output folder: an flock on "<dir>/.crosskv-fit.lock" (released by the kernel however the job ends),
// recording its holder ("pid N on HOST").
#include <string>

namespace crosskv {

class OutputLock {
 public:
  OutputLock() = default;
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;
  ~OutputLock();
  // Tries to take the lock (never waits); InputError if the lock file cannot be created.
  void acquire(const std::string& dir);
  bool held() const { return held_; }
  std::string holder() const;  // the holder's record, when the lock is someone else's

 private:
  std::string path_, holder_;
  int fd_ = -1;
  bool held_ = false;
};

}  // namespace crosskv
