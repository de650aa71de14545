#pragma once
// What every stage of a fit runs with: the job's comms, its compute backend, the rank grid and the stop flag.
#include "runtime/stop.hpp"

namespace crosskv {

class Comm;
class ComputeBackend;

struct Grid;

struct Context {
  Comm& comm;                 // every rank of the job
  ComputeBackend& backend;
  Grid* grid = nullptr;       // the rank grid (fit/grid.hpp); none: one layer group
  StopFlag stop = {};         // a stop request (by default the process's signals): ends the job at a safe point
  Comm& readers() const;      // the ranks that share this rank's moments and split the shards among them
};

}  // namespace crosskv
