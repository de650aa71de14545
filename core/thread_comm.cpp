#include "core/thread_comm.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/error.hpp"
#include "core/threads.hpp"

namespace crosskv {
namespace {

// What the ranks of one group share: a reusable barrier, and one posted pointer (and values) per rank. Every
// exchange is post, barrier, read the others' posts, barrier: a post stays valid until every rank has read it.
struct Group {
  explicit Group(int n, double timeout_s) : size(n), timeout(timeout_s), posts(n), values(n) {}
  const int size;
  const double timeout;
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  int64_t generation = 0;
  std::vector<const void*> posts;
  std::vector<std::vector<int64_t>> values;
  std::map<int, std::shared_ptr<Group>> children;  // split(): the new group of each color

  void barrier(int rank) {
    std::unique_lock<std::mutex> lk(m);
    const int64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lk, std::chrono::duration<double>(timeout), [&] { return generation != gen; }))
      throw SystemError("thread comm: rank " + std::to_string(rank) + " waited " + std::to_string(timeout) +
                        " s at a collective for the other ranks of " + std::to_string(size));
  }
};

class ThreadComm final : public FixedOrderComm {
 public:
  ThreadComm(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }
  std::string name() const override { return "threads"; }

  void broadcast(void* data, size_t bytes, int root) override {
    exchange(data, {}, [&] {
      if (rank_ != root) std::memcpy(data, g_->posts[root], bytes);
    });
  }
  void barrier() override { g_->barrier(rank_); }
  bool all_ok(bool ok) override {
    bool all = true;
    exchange(nullptr, {ok ? 1 : 0}, [&] {
      for (const auto& v : g_->values) all = all && v[0] != 0;
    });
    return all;
  }
  void alltoallv(const void* send, const int* send_counts, const int* send_displs, void* recv,
                 const int* recv_counts, const int* recv_displs, size_t bytes) override {
    std::vector<int64_t> layout;
    for (int q = 0; q < size(); ++q) layout.insert(layout.end(), {send_counts[q], send_displs[q]});
    exchange(send, layout, [&] {
      for (int q = 0; q < size(); ++q) {
        const auto& theirs = g_->values[q];
        const int64_t count = theirs[2 * rank_], at = theirs[2 * rank_ + 1];
        CROSSKV_ASSERT(count == recv_counts[q], "alltoallv: counts differ between sender and receiver");
        std::memcpy(static_cast<char*>(recv) + recv_displs[q] * bytes,
                    static_cast<const char*>(g_->posts[q]) + at * bytes, count * bytes);
      }
    });
  }
  void allgatherv(const void* mine, int count, void* out, const int* counts, const int* displs,
                  size_t bytes) override {
    exchange(mine, {count}, [&] {
      for (int q = 0; q < size(); ++q) {
        CROSSKV_ASSERT(g_->values[q][0] == counts[q], "allgatherv: counts differ between ranks");
        std::memcpy(static_cast<char*>(out) + displs[q] * bytes, g_->posts[q], counts[q] * bytes);
      }
    });
  }
  std::unique_ptr<Comm> split(int color, int key) override {
    std::shared_ptr<Group> mine;
    int new_rank = 0;
    exchange(nullptr, {color, key}, [&] {
      std::vector<std::pair<int64_t, int>> members;  // (key, old rank) of this color
      for (int q = 0; q < size(); ++q)
        if (g_->values[q][0] == color) members.emplace_back(g_->values[q][1], q);
      std::sort(members.begin(), members.end());
      for (size_t i = 0; i < members.size(); ++i)
        if (members[i].second == rank_) new_rank = static_cast<int>(i);
      std::lock_guard<std::mutex> lk(g_->m);
      auto& child = g_->children[color];
      if (!child) child = std::make_shared<Group>(static_cast<int>(members.size()), g_->timeout);
      mine = child;
    });
    barrier();  // every rank took its group: the next split starts afresh
    if (rank_ == 0) g_->children.clear();
    barrier();
    return std::make_unique<ThreadComm>(mine, new_rank);
  }

 private:
  // Posts `data` and `values`, waits for every rank's, runs `read`, waits until every rank has read.
  template <class Read>
  void exchange(const void* data, std::vector<int64_t> values, Read&& read) {
    g_->posts[rank_] = data;
    g_->values[rank_] = std::move(values);
    g_->barrier(rank_);
    read();
    g_->barrier(rank_);
  }
  std::shared_ptr<Group> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Comm>> make_thread_comms(int ranks, double timeout_s) {
  CROSSKV_ASSERT(ranks >= 1, "at least one rank");
  auto g = std::make_shared<Group>(ranks, timeout_s);
  std::vector<std::unique_ptr<Comm>> out;
  for (int r = 0; r < ranks; ++r) out.push_back(std::make_unique<ThreadComm>(g, r));
  return out;
}

void run_ranks(int ranks, const std::function<void(Comm&)>& body, double timeout_s) {
  auto comms = make_thread_comms(ranks, timeout_s);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  const int omp_per_rank = std::max(1, omp_get_max_threads() / std::max(1, ranks));
  std::optional<SingleThreadedBlas> one_blas_thread;
  if (ranks > 1) one_blas_thread.emplace();
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      omp_set_num_threads(omp_per_rank);
      try {
        body(*comms[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace crosskv
