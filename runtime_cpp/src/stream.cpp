#include "moeplug/stream.h"

#include <chrono>
#include <map>
#include <utility>

namespace moeplug {

KernelError::KernelError(const std::string& stream, const std::string& kernel,
                         const std::string& what)
    : std::runtime_error("stream '" + stream + "': kernel '" + kernel + "' failed: " + what),
      kernel_(kernel) {}

void Event::synchronize() {
  if (std::exception_ptr error = wait_error()) std::rethrow_exception(error);
}

bool Event::query() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void Event::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

std::exception_ptr Event::wait_error() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  return error_;
}

Stream::Stream(std::string name) : name_(std::move(name)), worker_([this] { loop(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void Stream::push(Item item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(item));
  }
  cv_.notify_one();
}

void Stream::enqueue(std::string kernel, std::function<void()> fn) {
  push(Item{Kind::kKernel, std::move(kernel), std::move(fn), nullptr});
}

EventPtr Stream::record() {
  auto event = std::make_shared<Event>();
  push(Item{Kind::kRecord, "record", nullptr, event});
  return event;
}

void Stream::wait(EventPtr event) {
  if (!event) throw std::invalid_argument("Stream::wait: event is null; pass stream.record()");
  push(Item{Kind::kWait, "wait", nullptr, std::move(event)});
}

void Stream::synchronize() {
  if (std::this_thread::get_id() == worker_.get_id()) {
    // A kernel waiting for its own queue to drain would wait forever.
    throw std::logic_error("stream '" + name_ + "': synchronize() called from a kernel running "
                           "on this stream; it would wait for itself. Fix: record() an event "
                           "and synchronize it from another thread");
  }
  auto event = std::make_shared<Event>();
  push(Item{Kind::kRecord, "synchronize", nullptr, event, /*clear_error=*/true});
  event->synchronize();
}

void Stream::run(Item& item) {
  switch (item.kind) {
    case Kind::kKernel:
      if (error_) return;  // sticky: later kernels may read what the failed one never wrote
      try {
        item.fn();
      } catch (const std::exception& e) {
        error_ = std::make_exception_ptr(KernelError(name_, item.name, e.what()));
      } catch (...) {
        error_ = std::make_exception_ptr(KernelError(name_, item.name, "unknown exception"));
      }
      return;
    case Kind::kRecord:
      item.event->complete(error_);
      if (item.clear_error) error_ = nullptr;
      return;
    case Kind::kWait:
      // The worker blocks here, which is the point: nothing behind the wait may start early.
      if (std::exception_ptr error = item.event->wait_error(); error && !error_) error_ = error;
      return;
  }
}

void Stream::loop() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    run(item);
    // `item` (and whatever its fn captured, e.g. tensors kept alive) dies here, off the lock.
  }
}

namespace {
std::mutex g_streams_mu;
std::map<std::string, std::shared_ptr<Stream>> g_streams;
std::vector<std::string> g_stream_order;
}  // namespace

std::shared_ptr<Stream> get_stream(const std::string& name) {
  if (name.empty()) throw std::invalid_argument("get_stream: name is empty; pass e.g. \"comm\"");
  std::lock_guard<std::mutex> lock(g_streams_mu);
  auto& slot = g_streams[name];
  if (!slot) {
    slot = std::make_shared<Stream>(name);
    g_stream_order.push_back(name);
  }
  return slot;
}

std::vector<std::string> stream_names() {
  std::lock_guard<std::mutex> lock(g_streams_mu);
  return g_stream_order;
}

void sleep_kernel(int64_t microseconds) {
  if (microseconds < 0) {
    throw std::invalid_argument("sleep: microseconds must be >= 0, got " +
                                std::to_string(microseconds));
  }
  std::this_thread::sleep_for(std::chrono::microseconds(microseconds));
}

}  // namespace moeplug
