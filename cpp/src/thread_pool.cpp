// The persistent pool behind parallel_for (see thread_pool.hpp).
//
// One job at a time: a caller that wins try_lock on job_mutex publishes the job (function,
// item count, number of workers wanted) under state_mutex, bumps the generation and wakes the
// workers; workers 1..wanted take items from the shared counter, then report done. The caller
// takes items too, then waits until every wanted worker has reported. Workers that were not
// wanted for this job go back to sleep at once.
//
// Waiting (a worker for its next job, the caller for the workers' reports) first spins for up to
// kPoolSpinMicroseconds on an atomic copy of the generation / pending count, then sleeps on the
// condition variable; the mutex-guarded values stay the ones that decide.
#include "thread_pool.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "twinattn/constants.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace twinattn {
namespace {

class ThreadPool {
public:
    static ThreadPool& instance() {
        // Never destroyed: workers may still be parked when the process exits.
        static ThreadPool* pool = new ThreadPool();
        return *pool;
    }

    void run(int64_t items, int num_threads, const ItemFn& fn) {
        std::unique_lock<std::mutex> job_lock(job_mutex_, std::try_to_lock);
        if (!job_lock.owns_lock()) {  // busy: run on the caller's thread
            for (int64_t item = 0; item < items; ++item) fn(item, 0);
            return;
        }
        const int wanted = static_cast<int>(std::min<int64_t>(num_threads, items)) - 1;
        ensure_workers(wanted);
        {
            std::lock_guard<std::mutex> lock(state_mutex_);
            fn_ = &fn;
            items_ = items;
            wanted_ = wanted;
            pending_ = wanted;
            pending_atomic_.store(wanted, std::memory_order_relaxed);
            next_item_.store(0, std::memory_order_relaxed);
            error_ = nullptr;
            ++generation_;
            generation_atomic_.store(generation_, std::memory_order_release);
        }
        wake_.notify_all();
        take_items(0);
        spin_until([&] { return pending_atomic_.load(std::memory_order_acquire) == 0; });
        std::unique_lock<std::mutex> lock(state_mutex_);
        done_.wait(lock, [&] { return pending_ == 0; });
        fn_ = nullptr;
        if (error_) std::rethrow_exception(error_);
    }

private:
    ThreadPool() = default;

    void ensure_workers(int count) {
        while (static_cast<int>(workers_.size()) < count) {
            const int thread = static_cast<int>(workers_.size()) + 1;
            uint64_t seen;
            {
                std::lock_guard<std::mutex> lock(state_mutex_);
                seen = generation_;
            }
            workers_.emplace_back([this, thread, seen] { worker_loop(thread, seen); });
            workers_.back().detach();
        }
    }

    void take_items(int thread) {
        for (;;) {
            const int64_t item = next_item_.fetch_add(1, std::memory_order_relaxed);
            if (item >= items_) return;
            try {
                (*fn_)(item, thread);
            } catch (...) {
                std::lock_guard<std::mutex> lock(state_mutex_);
                if (!error_) error_ = std::current_exception();
                next_item_.store(items_, std::memory_order_relaxed);  // stop handing out items
            }
        }
    }

    void worker_loop(int thread, uint64_t seen) {
        for (;;) {
            spin_until([&] { return generation_atomic_.load(std::memory_order_acquire) != seen; });
            {
                std::unique_lock<std::mutex> lock(state_mutex_);
                wake_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                if (thread > wanted_) continue;  // not needed for this job
            }
            take_items(thread);
            std::lock_guard<std::mutex> lock(state_mutex_);
            pending_atomic_.fetch_sub(1, std::memory_order_release);
            if (--pending_ == 0) done_.notify_one();
        }
    }

    std::mutex job_mutex_;    // held by the caller that owns the pool for one job
    std::mutex state_mutex_;  // guards everything below except next_item_
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    uint64_t generation_ = 0;
    const ItemFn* fn_ = nullptr;
    int64_t items_ = 0;
    int wanted_ = 0;
    int pending_ = 0;
    std::exception_ptr error_;
    std::atomic<int64_t> next_item_{0};
    // Copies of generation_ and pending_ for spinning without the mutex.
    std::atomic<uint64_t> generation_atomic_{0};
    std::atomic<int> pending_atomic_{0};

    // Returns once done() holds or kPoolSpinMicroseconds have passed (the caller then sleeps).
    template <class Done>
    static void spin_until(Done done) {
        const auto stop = std::chrono::steady_clock::now() + std::chrono::microseconds(kPoolSpinMicroseconds);
        for (int i = 1;; ++i) {
            if (done()) return;
#if defined(__x86_64__) || defined(_M_X64)
            _mm_pause();
#endif
            if (i % 64 == 0 && std::chrono::steady_clock::now() >= stop) return;
        }
    }
};

}  // namespace

void parallel_for(int64_t items, int num_threads, const ItemFn& fn) {
    if (items <= 0) return;
    if (num_threads <= 1 || items == 1) {
        for (int64_t item = 0; item < items; ++item) fn(item, 0);
        return;
    }
    ThreadPool::instance().run(items, num_threads, fn);
}

}  // namespace twinattn
