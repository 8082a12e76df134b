// The helper threads every native kernel of this library shares (one per core besides the
// caller's), in place of XLA's intra-op pool.
//
// Why: handing work to a sleeping thread of XLA's pool (ThreadPool::Schedule) wakes it with a
// futex, and on the VMs this project runs on that call blocks the caller ~30 us and the helper
// starts ~35 us later (measured inside decoder_layer.cc): a decode step makes 30-180 such
// calls, each only 10-200 us of work. These helpers instead spin for a while after a job
// before they sleep, so calls that come back to back (a step's layers, its head) reach an
// awake helper and pay no wake-up; a process that stops calling gives its core back soon.
// How long is the job's to say: the packed matmuls and the one-call layer, which are most of
// a step when they run, ask for kLinger; the decode attention called between XLA's own
// matmuls (float weights) asks for kBrief, since a helper spinning beside XLA's threads slowed
// the f32 model's throughput by 7%. All kernels share the one team (the library is one shared
// object), so they never spin against one another.
//
// post(job, n, spin) hands job to up to n helpers and returns at once; the caller works too,
// and the job's own counters say when its work is done (each kernel splits its work into
// chunks taken from an atomic counter, so a helper that starts late finds nothing left and
// only returns).
// A child process forked from one with a team has none (its threads were not forked): there
// post() does nothing and the caller does all of the work.

#ifndef PAGED_JAX_THREAD_TEAM_H_
#define PAGED_JAX_THREAD_TEAM_H_

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace paged_jax {

class ThreadTeam {
 public:
  // How long a helper spins after a job before it sleeps.
  static constexpr int64_t kLinger = 1000;  // us
  static constexpr int64_t kBrief = 20;

  explicit ThreadTeam(int64_t num_helpers) : num_helpers_(num_helpers) {
    for (int64_t i = 0; i < num_helpers; ++i) std::thread([this] { loop(); }).detach();
    pthread_atfork(nullptr, nullptr, [] { forked() = true; });
  }

  // Helpers a call may use: one per core of this process's affinity besides the caller's.
  int64_t num_helpers() const { return forked() ? 0 : num_helpers_; }

  void post(const std::function<void()>& job, int64_t n, int64_t spin_micros) {
    if (n <= 0 || forked()) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n; ++i) jobs_.push_back({job, spin_micros});
    pending_.fetch_add(n, std::memory_order_release);
    if (sleeping_ > 0) cv_.notify_all();
  }

 private:
  void loop() {
    int64_t spin_micros = kBrief;  // the last job's
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_micros);
      for (int spins = 0; pending_.load(std::memory_order_acquire) == 0;) {
        _mm_pause();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (jobs_.empty()) {
          ++sleeping_;
          cv_.wait(lock, [this] { return !jobs_.empty(); });
          --sleeping_;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
        pending_.fetch_sub(1, std::memory_order_relaxed);
      }
      spin_micros = job.spin_micros;
      job.run();
    }
  }

  struct Job {
    std::function<void()> run;
    int64_t spin_micros;
  };

  static bool& forked() {
    static bool value = false;
    return value;
  }

  const int64_t num_helpers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::atomic<int64_t> pending_{0};
  int sleeping_ = 0;
};

// The process's team (never destroyed: its threads are detached and may be spinning at exit).
inline ThreadTeam& thread_team() {
  static ThreadTeam* team = [] {
    cpu_set_t set;
    const int64_t cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? int64_t(CPU_COUNT(&set)) : 1;
    return new ThreadTeam(cpus > 1 ? cpus - 1 : 0);
  }();
  return *team;
}

}  // namespace paged_jax

#endif  // PAGED_JAX_THREAD_TEAM_H_
