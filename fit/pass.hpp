#pragma once
// Stages 3 and 5: the streaming passes over the calibration data, in checkpointed rounds (fit/stream.cpp reads,
// fit/round.cpp reduces, fit/checkpoint.cpp commits). Pass 1 accumulates every block (one pass) or the probe's
// (two passes); pass 2 the blocks the selections need.
#include <memory>
#include <string>
#include <vector>

#include "fit/moments.hpp"
#include "fit/checkpoint.hpp"
#include "fit/plan.hpp"
#include "fit/stream.hpp"

namespace crosskv {

struct Grid;

// The fit's moments: RoPE-stripped keys, values, and raw keys (for the probe's k_rope matrix only; freed after it).
struct FitMoments {
  Moments k, v;
  std::unique_ptr<Moments> k_rope;
  PassMoments with_raw_keys() { return {k, k_rope.get(), v}; }
  PassMoments mapped() { return {k, nullptr, v}; }
};

// What pass 1 leaves: the moments (Gram blocks exchanged between layer groups), and for a second pass the job's
// checkpoint store and state.
struct FirstPass {
  FitMoments m;
  PassStats stats;
  std::unique_ptr<CheckpointStore> store;
  PassState state;
};

// Pass 1. Single-pass fits without max_tokens keep complete moments per calibration domain (<ckpt_dir>/domain-<name>)
// and weight them (calibration.weights), so a later fit over other domains reads only the new ones; other fits
// checkpoint the job as a whole. `fresh` removes committed checkpoints first.
FirstPass first_pass(const Calibration& cal, const FitPlan& plan, Context& ctx, const std::string& ckpt_dir,
                     bool fresh);

// Pass 2 (two-pass fits): the blocks of `selected` added to the moments and accumulated, checkpointed in pass 1's
// store; the Gram blocks exchanged afterwards.
PassStats second_pass(const Calibration& cal, const MomentPlan& selected, Context& ctx, FirstPass& p1);

// The moment plan of the probe: same-head blocks per head, or (all_heads) each source layer's Gram and its cross
// blocks with every target layer.
MomentPlan probe_plan(const PairDims& d, ProbeMode mode);

// Every rank's memory, logged by rank 0: the moments it holds, plus `extra` bytes.
void log_rank_memory(Context& ctx, const std::string& label, const PassMoments& ms, double extra = 0);

}  // namespace crosskv
