// The native kernels' own helper threads (one per core besides the caller's): the one-call
// decoder layer's, which the matmul and attention kernels borrow while one is awake.
//
// Why: handing work to a sleeping thread of XLA's pool (ThreadPool::Schedule) wakes it with a
// futex, and on the VMs this project runs on that call blocks the caller ~30 us and the helper
// starts ~35 us later (measured inside decoder_layer.cc). A decode step whose layers are each
// one native call (decoder_layer.cc) makes such calls back to back, each 100-200 us of work:
// there the team's helpers, which spin for kLinger after such a job before they sleep, are
// awake for the next one and pay no wake-up. Such a step runs all its layers in one program
// (paged_jax/runner.py LayerGroups), so the gaps between them are a few us of XLA thunks. The
// spin is 1 ms, longer than the step's head and the host's work before the next step (~0.3-0.5
// ms for a single stream), so the head's matmul and the next step's first layer find the helper
// awake too: against 50 us, single-stream decode of SmolLM2 int8 was 8-11% faster and a batch
// of 32 decoding sequences 4% (docs/BENCHMARKS.md section 18, ninth pass; the sixth pass had
// found 1 ms slower, when a head without a team helper woke every thread of XLA's pool).
//
// Where native calls sit between XLA's own work (prefill chunks, batched steps of XLA layers,
// a float model's attention), a spinning helper takes a core from XLA's threads: with every
// call on the team, a float model's throughput fell 4-7% and a batch of 32 packed sequences'
// 15%. There XLA's pool is the better helper (its threads are often awake for XLA's own ops),
// so the matmul and attention kernels use the team only while one of its helpers is awake
// (has_awake_helper: a one-call layer ran within kLinger), and XLA's pool otherwise, waking
// one pool thread per core besides the caller's (pool_helpers).
//
// post(job, n, spin) hands job to up to n helpers and returns at once; the caller works too,
// and the job's own counters say when its work is done (each kernel splits its work into
// chunks taken from an atomic counter, so a helper that starts late finds nothing left and
// only returns). A child process forked from one with a team has none (its threads were not
// forked): there post() does nothing and the caller does all of the work.

#ifndef PAGED_JAX_THREAD_TEAM_H_
#define PAGED_JAX_THREAD_TEAM_H_

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace paged_jax {

class ThreadTeam {
 public:
  // How long a helper spins after a job (by default) before it sleeps.
  static constexpr int64_t kLinger = 1000;  // us

  explicit ThreadTeam(int64_t num_helpers) : num_helpers_(num_helpers) {
    for (int64_t i = 0; i < num_helpers; ++i) std::thread([this] { loop(); }).detach();
    pthread_atfork(nullptr, nullptr, [] { forked() = true; });
  }

  // Helpers a call may use: one per core of this process's affinity besides the caller's.
  int64_t num_helpers() const { return forked() ? 0 : num_helpers_; }

  // Whether a helper is spinning now (a job ended less than its spin time ago): a kernel that
  // can use XLA's pool instead uses the team only then (ThreadTeam's header says why).
  bool has_awake_helper() const { return !forked() && spinning_.load(std::memory_order_relaxed) > 0; }

  void post(const std::function<void()>& job, int64_t n, int64_t spin_micros) {
    if (n <= 0 || forked()) return;
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t i = 0; i < n; ++i) jobs_.push_back({job, spin_micros});
    pending_.fetch_add(n, std::memory_order_release);
    if (sleeping_ > 0) cv_.notify_all();
  }

 private:
  void loop() {
    int64_t spin_micros = 0;  // the last job's
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_micros);
      spinning_.fetch_add(1, std::memory_order_relaxed);
      for (int spins = 0; pending_.load(std::memory_order_acquire) == 0;) {
        _mm_pause();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      spinning_.fetch_sub(1, std::memory_order_relaxed);
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
  std::atomic<int64_t> spinning_{0};
  int sleeping_ = 0;
};

// The cores of this process's affinity besides the calling thread's (read once).
inline int64_t other_cores() {
  static const int64_t n = [] {
    cpu_set_t set;
    const int64_t cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? int64_t(CPU_COUNT(&set)) : 1;
    return cpus > 1 ? cpus - 1 : 0;
  }();
  return n;
}

// The process's team (never destroyed: its threads are detached and may be spinning at exit).
inline ThreadTeam& thread_team() {
  static ThreadTeam* team = new ThreadTeam(other_cores());
  return *team;
}

// How many of XLA's pool threads a kernel that hands `wanted` extra pieces of work to the pool
// (not to the team) should wake: one per core besides the caller's, as the team has. The pool
// has a thread per core, and a call on a thread outside it (the Python thread that dispatched
// the program) waking all of them made one thread more than there are cores: the head's matmul
// of a decode step ran on three threads, and single-stream decode of SmolLM2 was 3.6-4.0%
// slower (docs/BENCHMARKS.md section 18, ninth pass).
inline int64_t pool_helpers(int64_t pool_threads, int64_t wanted) {
  return std::max<int64_t>(0, std::min<int64_t>({pool_threads, other_cores(), wanted}));
}

}  // namespace paged_jax

#endif  // PAGED_JAX_THREAD_TEAM_H_
