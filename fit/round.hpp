#pragma once
// A round's end with several readers: the round's sums reduced into this rank's share of the pass.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fit/moments.hpp"

namespace crosskv {

class Comm;
class Residency;

// A round's end with several readers: the live sums of `ms` (in order) are reduced over `readers` into this rank's
// share of the pass (base_f, base_d: empty before the first round, then the running sums), and zeroed where they
// are. The sums are read where they are held, a segment at a time (Residency::copy_sums): a device backend's
// stay on the device (zeroed there) and their host copies are never written; with a device comm only this rank's
// share crosses to the host. After a pass's last round the caller drops the held copies (Moments::release_sums)
// before overwriting the moments. (One reader has nothing to reduce: its share is its moments.)
void reduce_round(const std::vector<Moments*>& ms, Residency& be, Comm& readers, std::vector<float>& base_f,
                    std::vector<double>& base_d);

}  // namespace crosskv
