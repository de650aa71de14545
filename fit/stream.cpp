#include "fit/stream.hpp"

#include <array>
#include <functional>
#include <optional>
#include <thread>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/rope.hpp"
#include "fit/block_queue.hpp"
#include "fit/block_reader.hpp"
#include "runtime/log.hpp"

namespace crosskv {
namespace {

// The kinds a pass accumulates, each into its moments, about their shifts.
struct KindTable {
  std::vector<Kind> kinds;
  std::array<Moments*, kAllKinds.size()> into{};
  InputShifts shifts;
  explicit KindTable(const PassMoments& m) {
    for (Kind kind : kAllKinds)
      if (Moments* mk = m.of(kind)) {
        kinds.push_back(kind);
        into[kind_index(kind)] = mk;
        shifts.x[kind_index(kind)] = mk->shift_x().data();
        shifts.y[kind_index(kind)] = mk->shift_y().data();
      }
  }
};

// Folds a block of every kind into its moments. A device backend converts, strips RoPE and shifts on the device
// (half the bytes to copy, no host arithmetic); otherwise the reader thread prepared the inputs.
void fold_block(ComputeBackend& be, const KindTable& t, const Rope& rs, const Rope& rt, const PairDims& d, Block& b) {
  const bool on_device = be.prepares_on_device();
  be.begin_inputs();
  const int64_t n = b.rows;
  const RowWeights w = b.weights();
  if (w.sqrt_w) be.stage_inputs({ComputeBackend::floats(w.sqrt_w, n)});
  if (on_device)
    be.stage_inputs({b.sk.span(), b.sv.span(), b.tk.span(), b.tv.span(), {b.spos.data(), n * 4},
                     {b.tpos.data(), n * 4}});
  const ComputeBackend::Strip ss{&rs, b.spos.data()}, tt{&rt, b.tpos.data()};
  for (Kind kind : t.kinds) {
    const size_t i = kind_index(kind);
    const float *x = b.x[i].data(), *y = b.y[i].data();
    if (on_device) {
      const bool strip = strips_rope(kind);
      x = be.prepare(b.source(kind).block(n), strip ? &ss : nullptr, t.shifts.x[i], w.sqrt_w, b.x[i]);
      y = be.prepare(b.target(kind).block(n), strip ? &tt : nullptr, t.shifts.y[i], w.sqrt_w, b.y[i]);
    } else {
      be.stage_inputs({ComputeBackend::floats(x, n * d.X()), ComputeBackend::floats(y, n * d.Y())});
    }
    t.into[i]->accumulate_staged(be, x, y, n, w);
  }
}

// One round: a producer thread reads the blocks of `shards` ahead (HDF5 is only ever called there), and `consume`
// folds each in on this thread. Returns false when a stop signal abandoned the round.
bool read_round(const Calibration& cal, const std::vector<const ShardPair*>& shards, const Rope& rs, const Rope& rt,
                const KindTable& t, const InputShifts* host_shifts, const StopFlag& stop, BlockQueue& queue,
                const std::function<void(Block&)>& consume) {
  const bool weighted = cal.cfg.fit.weighting == Weighting::dataset;
  const int64_t B = cal.cfg.runtime.block_tokens;
  queue.next_round();
  std::thread producer([&] {
    try {
      for (const ShardPair* p : shards) {
        ShardPairReader r{p, ShardReader(p->source_path), ShardReader(p->target_path)};
        for (int64_t j = 0; j < p->used; j += B) {
          std::optional<Block> b = queue.take_free();
          if (!b) return;
          read_block(r, rs, rt, cal, j, std::min(B, p->used - j), t.kinds, weighted, host_shifts, *b);
          queue.push(std::move(b));
        }
      }
      queue.push(std::nullopt);
    } catch (...) {
      queue.fail(std::current_exception());
    }
  });
  bool abandoned = false;
  try {
    while (auto b = queue.pop()) {
      consume(*b);
      queue.recycle(std::move(*b));
      if (stop.requested()) {
        abandoned = true;
        break;
      }
    }
  } catch (...) {
    queue.abandon();
    producer.join();
    throw;
  }
  if (abandoned) queue.abandon();
  producer.join();
  if (!abandoned)
    if (auto e = queue.error()) std::rethrow_exception(e);
  return !abandoned;
}

}  // namespace

PassStats stream_pass(const Calibration& cal, Context& ctx, const PassMoments& m, const std::string& label,
                      int64_t start_round, const RoundHook& on_round) {
  const ShardSchedule schedule(cal, ctx.readers().size(), ctx.readers().rank());
  const int64_t rounds = schedule.rounds(), todo = schedule.my_tokens(start_round),
                job_todo = schedule.job_tokens(start_round);
  const PairDims d = cal.dims();
  const double bytes_per_token = 2.0 * (d.X() * 4 + d.Y() * 4);  // fp32 equivalent of K and V, both sides
  Progress progress(label, job_todo, bytes_per_token);
  const Rope rs(cal.source, "source kv_spec"), rt(cal.target, "target kv_spec");
  const KindTable table(m);
  const InputShifts* host_shifts = ctx.backend.prepares_on_device() ? nullptr : &table.shifts;
  PassStats st;
  BlockQueue queue;
  for (int64_t round = start_round; round < rounds; ++round) {
    const bool whole = read_round(cal, schedule.shards(round), rs, rt, table, host_shifts, ctx.stop, queue,
                                  [&](Block& b) {
                                    fold_block(ctx.backend, table, rs, rt, d, b);
                                    // Job-wide progress, estimated from this rank's share.
                                    progress.add(todo > 0 ? b.rows * job_todo / todo : b.rows);
                                    st.tokens += b.rows;
                                  });
    if (on_round) on_round(round, rounds, !whole);
  }
  progress.finish();
  st.seconds = progress.seconds();
  st.bytes = st.tokens * bytes_per_token;
  return st;
}

}  // namespace crosskv
