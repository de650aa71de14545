// The distributed logic in one process: ranks as threads over the in-process communicator (core/thread_comm), with
// data whose expected result every rank can compute (as nccl-tests does). The mpiexec tests (tests/cli/mpi_*.sh) run
// the same code over MPI.
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>

#include "core/thread_comm.hpp"
#include "helpers.hpp"
#include "reference_mapper.hpp"
#include "artifact/mapper.hpp"
#include "fit/checkpoint.hpp"
#include "fit/grid.hpp"

using namespace crosskv;
using namespace crosskv::test;

TEST(Grid, RanksFormLayerGroupsTimesTokenGroups) {
  run_ranks(6, [](Comm& comm) {
    Grid g = make_grid(comm, 3);
    EXPECT_EQ(g.layer_groups, 3);
    EXPECT_EQ(g.token_groups, 2);
    EXPECT_EQ(g.layer_group, comm.rank() / 2);
    EXPECT_EQ(g.token_group, comm.rank() % 2);
    EXPECT_EQ(g.readers->size(), 2);
    EXPECT_EQ(g.readers->rank(), g.token_group);
    EXPECT_EQ(g.peers->size(), 3);
    EXPECT_EQ(g.peers->rank(), g.layer_group);
    EXPECT_TRUE(g.owns_target(g.layer_group + 3));
    EXPECT_FALSE(g.owns_target(g.layer_group + 1));
  });
}

// A newest checkpoint that does not verify on one rank makes every rank fall back to the previous one.
TEST(Checkpoint, EveryRankFallsBackWhenOneRanksNewestStateIsBad) {
  TempDir dir;
  const nlohmann::json identity = {{"job", "vote"}};
  run_ranks(3, [&](Comm& comm) {
    CheckpointStore store(dir.str("ck"), identity, comm);
    for (int64_t rounds : {1, 2}) {
      PassState s;
      s.rounds_done = rounds;
      s.pass1_f = {static_cast<float>(comm.rank() + rounds)};
      store.save(s);
    }
  });
  {
    std::fstream f(dir.str("ck/state-2-rank2.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  run_ranks(3, [&](Comm& comm) {
    auto got = CheckpointStore(dir.str("ck"), identity, comm).load();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->rounds_done, 1) << "rank " << comm.rank();
    EXPECT_EQ(got->pass1_f, std::vector<float>{static_cast<float>(comm.rank() + 1)});
  });
}

// Whole fits with ranks as threads: grids of one and several layer groups (Gram exchange, solve pairs, a reader
// alone), one and two passes. The same job twice gives the same bytes; any grid agrees with one rank to fp32
// accumulation tolerance.
TEST(DistributedFit, ThreadRanksMatchOneRankAndRepeatByteForByte) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1, 2, all]}", "one"));
  struct Job {
    int ranks;
    std::string runtime;
  };
  for (const Job& job : {Job{2, "{block_tokens: 200}"}, Job{3, "{block_tokens: 200, layer_groups: 1}"},
                         Job{4, "{block_tokens: 200, layer_groups: 2}"},
                         Job{2, "{block_tokens: 200, max_moment_gib: 0.0001}"}}) {
    SCOPED_TRACE(std::to_string(job.ranks) + " ranks, " + job.runtime);
    for (const char* out : {"a", "b"}) {
      const std::string yaml = "source: {store: " + tmp.str("source") + "}\ntarget: {store: " + tmp.str("target") +
                               "}\nfit: {k: [1, 2, all]}\noutput: {dir: " + tmp.str(out) + "}\nruntime: " +
                               job.runtime + "\n";
      fs::remove_all(tmp.str(out));
      run_ranks(job.ranks, [&](Comm& comm) {
        auto be = make_cpu_backend();
        Context ctx{comm, *be};
        run_fit(parse_fit_config(yaml, "cfg.yaml"), FitOptions{}, ctx);
      });
    }
    const auto manifest = nlohmann::json::parse(file_bytes(tmp.str("a/kall/manifest.json")));
    EXPECT_EQ(manifest["grid"]["ranks"], job.ranks);
    EXPECT_EQ(manifest["grid"]["collectives"], "threads");
    EXPECT_EQ(manifest["passes"], job.runtime.find("max_moment_gib") == std::string::npos ? 1 : 2);
    for (const char* k : {"k1", "k2", "kall"}) {
      for (const auto& e : fs::directory_iterator(tmp.str(std::string("a/") + k))) {
        const std::string name = e.path().filename().string();
        if (name == "manifest.json") continue;  // it holds the stage times
        EXPECT_TRUE(file_bytes(e.path().string()) == file_bytes(tmp.str("b/") + k + "/" + name)) << e.path();
      }
      MapperWeights a = load_mapper(tmp.str(std::string("a/") + k)), one = load_mapper(tmp.str(std::string("one/") + k));
      for (size_t l = 0; l < a.layers.size(); ++l) {
        EXPECT_EQ(a.layers[l].source_layers, one.layers[l].source_layers);
        for (size_t i = 0; i < a.layers[l].wk.size(); ++i)
          ASSERT_NEAR(a.layers[l].wk[i], one.layers[l].wk[i], 2e-3 * (1.0 + std::abs(one.layers[l].wk[i])))
              << k << " layer " << l << " element " << i;
      }
    }
  }
}

// A stop request (the context's flag, as a signal sets the process's) ends every rank of a fit at the round's end
// with Interrupted and no artifact; the same job again resumes to the bytes of an uninterrupted one.
TEST(DistributedFit, AStopRequestEndsEveryRankAndTheJobResumes) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  auto yaml = [&](const std::string& out) {
    return "source: {store: " + tmp.str("source") + "}\ntarget: {store: " + tmp.str("target") +
           "}\nfit: {k: [1, all]}\noutput: {dir: " + tmp.str(out) +
           "}\nruntime: {block_tokens: 200, checkpoint: {every_shards: 1}}\n";
  };
  auto fit = [&](const std::string& out, volatile std::sig_atomic_t& stop) {
    run_ranks(2, [&](Comm& comm) {
      auto be = make_cpu_backend();
      Context ctx{comm, *be, nullptr, StopFlag(stop)};
      run_fit(parse_fit_config(yaml(out), "cfg.yaml"), FitOptions{}, ctx);
    });
  };
  volatile std::sig_atomic_t go = 0, stop = 1;
  fit("ref", go);
  expect_error<Interrupted>([&] { fit("stopped", stop); }, {"stopped by a signal in round 1 of pass 1"});
  EXPECT_FALSE(fs::exists(tmp.str("stopped/k1"))) << "an interrupted fit leaves no complete-looking artifact";
  fit("stopped", go);
  for (const char* k : {"k1", "kall"})
    for (const auto& e : fs::directory_iterator(tmp.str(std::string("ref/") + k)))
      if (e.path().filename() != "manifest.json") {
        EXPECT_TRUE(file_bytes(e.path().string()) ==
                    file_bytes(tmp.str(std::string("stopped/") + k + "/" + e.path().filename().string())))
            << e.path();
      }
}
