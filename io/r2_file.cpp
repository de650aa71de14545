#include "io/r2_file.hpp"

#include "core/error.hpp"
#include "core/atomic_file.hpp"
#include "io/h5.hpp"

namespace crosskv {

void write_r2_file(const std::string& path, const std::map<Kind, ProbeR2>& probes,
                   const std::map<std::string, std::string>& attrs) {
  const std::string tmp = temp_name_for(path);
  {
    h5::Handle f = h5::create_file(tmp);
    for (const auto& [k, v] : attrs) h5::write_string_attr(f, k, v);
    h5::Handle g(h5::check(H5Gcreate2(f, "per_head", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "H5Gcreate2", tmp),
                 H5Gclose);
    for (const auto& [kind, p] : probes) {
      const char* name = kind_name(kind);
      h5::write_f64(f, name, {hsize_t(p.Ls), hsize_t(p.Lt)}, p.mean.data());
      h5::write_f64(g, name, {hsize_t(p.Ls), hsize_t(p.Lt), hsize_t(p.H)}, p.per_head.data());
    }
    h5::check(H5Fflush(f, H5F_SCOPE_GLOBAL), "H5Fflush", tmp);
  }
  commit_file(tmp, path);
}

std::map<Kind, ProbeR2> read_r2_file(const std::string& path) {
  h5::Handle f = h5::open_file_ro(path);
  std::map<Kind, ProbeR2> out;
  for (Kind kind : kAllKinds) {
    const char* name = kind_name(kind);
    if (!h5::has_object(f, name)) continue;
    ProbeR2 p;
    h5::Handle d = h5::open_dataset(f, name, path);
    auto s = h5::dataset_shape(d, path);
    h5::Handle dh = h5::open_dataset(f, std::string("per_head/") + name, path);
    auto sh = h5::dataset_shape(dh, path);
    if (s.size() != 2 || sh.size() != 3) throw InputError(path + ": dataset '" + name + "' has the wrong rank");
    p.Ls = static_cast<int>(s[0]);
    p.Lt = static_cast<int>(s[1]);
    p.H = static_cast<int>(sh[2]);
    p.mean.resize(s[0] * s[1]);
    p.per_head.resize(sh[0] * sh[1] * sh[2]);
    h5::check(H5Dread(d, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, p.mean.data()), "H5Dread", path);
    h5::check(H5Dread(dh, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, p.per_head.data()), "H5Dread", path);
    out.emplace(kind, std::move(p));
  }
  return out;
}

}  // namespace crosskv
