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

// The live state of moments (this pass's blocks, and in the first pass the token statistics), flat in a fixed
// order: the layout of round reductions and checkpoints.
struct LiveState {
  static size_t floats(const Moments& m);
  static size_t doubles(const Moments& m);
  // The live state as pieces in that order, appended to f and d after the pieces already there (so the pieces of
  // several Moments, in turn, are their flat states back to back): for a reduction that reads the sums where they
  // are current (ComputeBackend::copy_sums), and for gathering them back in place (place_sums, then
  // unpack_doubles). Pieces name held copies only while they are held: make them again after Moments::hold_sums()
  // or release_sums().
  static void pieces(Moments& m, std::vector<ComputeBackend::SumPiece<float>>& f,
                     std::vector<ComputeBackend::SumPiece<double>>& d);
  // The live doubles (token statistics), after the floats were written through pieces().
  static void unpack_doubles(Moments& m, const double* d);
  // Zeroes the live state where it is current: held copies where they are held (they stay held), else the host's.
  static void zero(Moments& m);
};

// A round's end with several readers: the live sums of `ms` (in order) are reduced over `readers` into this rank's
// share of the pass (base_f, base_d: empty before the first round, then the running sums), and zeroed where they
// are. The sums are read where they are held, a segment at a time (Residency::copy_sums): a device backend's
// stay on the device (zeroed there) and their host copies are never written; with a device comm only this rank's
// share crosses to the host. After a pass's last round the caller drops the held copies (Moments::release_sums)
// before overwriting the moments. (One reader has nothing to reduce: its share is its moments.)
void reduce_round(const PassMoments& ms, Residency& be, Comm& readers, std::vector<float>& base_f,
                    std::vector<double>& base_d);

}  // namespace crosskv
