#include "moeplug/stash.h"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>

namespace moeplug {

namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

int64_t pages_for(int64_t n_bytes, int64_t page_bytes) {
  return std::max<int64_t>(1, (n_bytes + page_bytes - 1) / page_bytes);
}

}  // namespace

PagePool::PagePool(int64_t page_bytes, int64_t num_pages, bool own_memory)
    : page_bytes_(page_bytes), num_pages_(num_pages) {
  require(page_bytes > 0 && page_bytes % 64 == 0,
          "PagePool: page_bytes = " + std::to_string(page_bytes) +
              " must be a positive multiple of 64 (every dtype stays aligned)");
  require(num_pages > 0, "PagePool: num_pages = " + std::to_string(num_pages) + " must be >= 1");
  if (own_memory) {
    // One allocation for the pool's life: steady-state steps never ask the OS for memory.
    const int64_t bytes = page_bytes * num_pages;
    const int64_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
    data_ = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, static_cast<size_t>(rounded)));
    if (data_ == nullptr) throw std::bad_alloc();
  }
  used_.assign(static_cast<size_t>(num_pages), 0);
  stats_.page_bytes = page_bytes;
  stats_.num_pages = num_pages;
}

PagePool::~PagePool() { std::free(data_); }

PageRun PagePool::alloc(int64_t n_bytes) {
  require(n_bytes >= 0, "PagePool.alloc: n_bytes = " + std::to_string(n_bytes) + " < 0");
  const int64_t want = pages_for(n_bytes, page_bytes_);
  std::lock_guard<std::mutex> lock(mu_);
  // First fit from the lowest page that may be free. Backward frees in roughly the reverse
  // order of forward's allocations, so the pool empties every step and runs rarely fragment.
  int64_t run = 0;
  for (int64_t p = search_from_; p < num_pages_; ++p) {
    run = used_[p] ? 0 : run + 1;
    if (run == want) {
      const int64_t first = p - want + 1;
      std::fill(used_.begin() + first, used_.begin() + p + 1, uint8_t{1});
      if (first == search_from_) search_from_ = p + 1;
      stats_.pages_in_use += want;
      stats_.high_water = std::max(stats_.high_water, stats_.pages_in_use);
      ++stats_.allocs;
      return {first, want};
    }
  }
  ++stats_.overflows;
  return {};
}

void PagePool::free(PageRun run) {
  std::lock_guard<std::mutex> lock(mu_);
  require(run.first >= 0 && run.count > 0 && run.first + run.count <= num_pages_,
          "PagePool.free: run {" + std::to_string(run.first) + ", " +
              std::to_string(run.count) + "} is outside the pool's " +
              std::to_string(num_pages_) + " pages");
  for (int64_t p = run.first; p < run.first + run.count; ++p) {
    require(used_[p], "PagePool.free: page " + std::to_string(p) + " is not allocated "
                      "(freed twice?)");
  }
  std::fill(used_.begin() + run.first, used_.begin() + run.first + run.count, uint8_t{0});
  search_from_ = std::min(search_from_, run.first);
  stats_.pages_in_use -= run.count;
}

PoolStats PagePool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void PagePool::reset_high_water() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.high_water = stats_.pages_in_use;
}

Registry::Registry(int64_t page_bytes) : page_bytes_(page_bytes) {
  require(page_bytes > 0, "Registry: page_bytes = " + std::to_string(page_bytes) + " must be > 0");
}

LayerGrant Registry::register_layer(const LayerSpec& spec) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const LayerSpec& l : layers_) {
    require(l.index != spec.index, "Registry.register_layer: MoE layer index " +
                                       std::to_string(spec.index) + " is already registered");
  }
  require(spec.stash_bytes >= 0, "Registry.register_layer: layer " + std::to_string(spec.index) +
                                     " stash_bytes = " + std::to_string(spec.stash_bytes) + " < 0");
  LayerGrant g;
  g.handle = static_cast<int64_t>(layers_.size());
  g.stash_pages = spec.stash_bytes ? (spec.stash_bytes + page_bytes_ - 1) / page_bytes_ : 0;
  layers_.push_back(spec);
  grants_.push_back(g);
  return g;
}

const LayerSpec& Registry::layer(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  require(handle >= 0 && handle < static_cast<int64_t>(layers_.size()),
          "Registry: no layer with handle " + std::to_string(handle));
  return layers_[handle];
}

const LayerGrant& Registry::grant(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  require(handle >= 0 && handle < static_cast<int64_t>(grants_.size()),
          "Registry: no layer with handle " + std::to_string(handle));
  return grants_[handle];
}

int64_t Registry::num_layers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(layers_.size());
}

int64_t Registry::reserved_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const LayerGrant& g : grants_) total += g.stash_pages;
  return total;
}

}  // namespace moeplug
