// Runtime-owned CPU execution streams with events (the CPU twin of cudaStream_t/cudaEvent_t).
//
// A Stream is a FIFO of work items served by its own worker thread, so work on two streams
// runs at the same time and work on one stream runs in order. Items are
//   - kernels: a named std::function (a runtime kernel, or whatever the caller wraps);
//   - record: completes an Event once everything enqueued before it has run;
//   - wait: holds the stream until another stream's Event completes.
// Errors are sticky, as in CUDA: when a kernel throws, the stream keeps the error (as a
// KernelError naming the stream and the kernel), skips its later kernels, completes its later
// events with that error, and hands it to every stream that waits on one of those events.
// Stream::synchronize() rethrows it and clears it, so the stream is usable again.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace moeplug {

// What a failed kernel leaves behind: "stream 'comm': kernel 'permute' failed: <what()>".
class KernelError : public std::runtime_error {
 public:
  KernelError(const std::string& stream, const std::string& kernel, const std::string& what);
  const std::string& kernel() const { return kernel_; }

 private:
  std::string kernel_;
};

class Event {
 public:
  // Blocks until the event completes; rethrows the error of the kernel it follows, if any.
  void synchronize();
  // True once complete (without blocking or throwing).
  bool query() const;
  // Completes the event (called by the stream that recorded it).
  void complete(std::exception_ptr error);
  // Blocks until complete and returns the error (nullptr when none) instead of throwing.
  std::exception_ptr wait_error();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};
using EventPtr = std::shared_ptr<Event>;

class Stream {
 public:
  explicit Stream(std::string name);
  ~Stream();  // runs what is queued, then joins the worker
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }

  // Runs fn on the worker after everything enqueued before it. `kernel` names it in errors.
  // fn is destroyed on the worker right after it runs (or is skipped after an error).
  void enqueue(std::string kernel, std::function<void()> fn);
  // An event that completes once everything enqueued so far has run.
  EventPtr record();
  // Work enqueued after this call starts only once `event` has completed.
  void wait(EventPtr event);
  // Blocks until everything enqueued so far has run; rethrows and clears the stream's error.
  void synchronize();

 private:
  enum class Kind { kKernel, kRecord, kWait };
  struct Item {
    Kind kind;
    std::string name;
    std::function<void()> fn;
    EventPtr event;
    bool clear_error = false;  // a record made by synchronize(): reset the sticky error
  };
  void push(Item item);
  void loop();
  void run(Item& item);

  const std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::exception_ptr error_;  // touched only by the worker thread
  std::thread worker_;
};

// The process-wide stream called `name`, created on first use (same name -> same stream).
std::shared_ptr<Stream> get_stream(const std::string& name);
// Names of the streams created so far, in creation order.
std::vector<std::string> stream_names();

// A kernel that only takes time (sleeps `microseconds`): measures and tests overlap.
void sleep_kernel(int64_t microseconds);

}  // namespace moeplug
