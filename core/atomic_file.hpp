#pragma once
// Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder. An interrupted write
// leaves at most a stray "*.tmp-<pid>" file, never a partial file under the final name.
#include <cstddef>
#include <string>
#include <vector>

namespace crosskv {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();  // removes the temp file unless committed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t n);
  void commit();
  const std::string& temp_path() const { return tmp_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

void write_file_atomic(const std::string& path, const std::string& content);
// For files written by a library (HDF5): fsync `tmp`, rename it to `path`, fsync the folder.
void commit_file(const std::string& tmp, const std::string& path);
void fsync_dir(const std::string& dir);
std::string temp_name_for(const std::string& path);
// Removes the files in `dir` whose names match `pattern` (temporaries that killed writes left: "<name>.tmp-<pid>");
// returns their paths. A missing folder has none.
std::vector<std::string> remove_files_matching(const std::string& dir, const std::string& pattern);

}  // namespace crosskv
