#ifndef PLSH_DETAIL_SCRATCH_HPP
#define PLSH_DETAIL_SCRATCH_HPP

/// \file scratch.hpp
/// The per-thread scratch of the kernels: one workspace per thread and workspace type, handed out
/// for the duration of a scope by a ScratchLease, so that a tile allocates nothing once its
/// thread has seen a tile of the same size.
///
/// A workspace is created on its thread's first lease and keeps its largest size until
/// release_thread_scratch (plsh::release_scratch, scratch.hpp) or the thread's end frees it. A
/// lease of a workspace that its thread already leases throws std::logic_error: the outer user
/// would find its buffers overwritten. Within plsh no code leases a type it already holds; the
/// nested lease comes from user code that the library calls while it holds a lease, a regular
/// kernel passed to plsh_attention (which runs inside the pass kernel's lease).
///
/// Cost of a lease: one thread-local look-up and a flag set and cleared; the first lease of a type
/// on a thread allocates its workspace.
///
/// Tested in tests/test_scratch.cpp.

#include <cstddef>
#include <memory>
#include <stdexcept>

namespace plsh {
namespace detail {

/// A thread's slot of one workspace type, linked into the thread's list of slots so that
/// release_thread_scratch reaches every type the thread has used.
class ScratchSlotBase {
 public:
  ScratchSlotBase(const ScratchSlotBase&) = delete;
  ScratchSlotBase& operator=(const ScratchSlotBase&) = delete;

  /// Frees the workspace unless a lease holds it.
  virtual void release() = 0;
  /// Whether the slot holds a workspace (leased or not).
  virtual bool holds() const = 0;

  /// The first slot of the calling thread's list (null when it has used none).
  static ScratchSlotBase*& first() {
    static thread_local ScratchSlotBase* head = nullptr;
    return head;
  }
  ScratchSlotBase* next() const { return next_; }

 protected:
  ScratchSlotBase() : next_(first()) { first() = this; }
  // Slots are destroyed at the thread's end, in the reverse order of their creation: the newest
  // is the head of the list.
  ~ScratchSlotBase() {
    for (ScratchSlotBase** link = &first(); *link != nullptr; link = &(*link)->next_) {
      if (*link == this) {
        *link = next_;
        break;
      }
    }
  }

 private:
  ScratchSlotBase* next_;
};

/// The message of a nested lease.
inline const char* nested_scratch_message() {
  return "plsh: a regular kernel called back into plsh while the outer call uses this thread's "
         "scratch of the same kind (the pass kernel's block buffers): the inner call would "
         "overwrite them. A regular kernel passed to plsh_attention may call regular_attention and "
         "the fused kernel; call plsh_attention with Kernel::Passes, fixed_block_attention or a "
         "KvCache in Passes mode outside the kernel, or from another thread";
}

template <class Workspace>
class ScratchSlot final : public ScratchSlotBase {
 public:
  ScratchSlot() = default;
  ~ScratchSlot() = default;

  Workspace& acquire() {
    if (in_use_) throw std::logic_error(nested_scratch_message());
    if (!workspace_) workspace_ = std::make_unique<Workspace>();
    in_use_ = true;
    return *workspace_;
  }
  void give_back() { in_use_ = false; }

  void release() override {
    if (!in_use_) workspace_.reset();
  }
  bool holds() const override { return workspace_ != nullptr; }

  /// The calling thread's slot of this type.
  static ScratchSlot& local() {
    static thread_local ScratchSlot slot;
    return slot;
  }

 private:
  std::unique_ptr<Workspace> workspace_;
  bool in_use_ = false;
};

/// The calling thread's workspace of type `Workspace` for the lease's lifetime:
/// `const ScratchLease<W> lease; W& workspace = *lease;`. Its contents are whatever the last
/// lease left (the kernels size and fill what they read). Throws std::logic_error
/// (nested_scratch_message) when the thread already leases that type.
template <class Workspace>
class ScratchLease {
 public:
  ScratchLease() : slot_(ScratchSlot<Workspace>::local()), workspace_(slot_.acquire()) {}
  ~ScratchLease() { slot_.give_back(); }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  Workspace& operator*() const { return workspace_; }
  Workspace* operator->() const { return &workspace_; }

 private:
  ScratchSlot<Workspace>& slot_;
  Workspace& workspace_;
};

/// Frees the calling thread's workspaces that no lease holds.
inline void release_thread_scratch() {
  for (ScratchSlotBase* slot = ScratchSlotBase::first(); slot != nullptr; slot = slot->next()) {
    slot->release();
  }
}

/// The number of workspaces the calling thread holds.
inline std::size_t thread_scratch_workspaces() {
  std::size_t count = 0;
  for (ScratchSlotBase* slot = ScratchSlotBase::first(); slot != nullptr; slot = slot->next()) {
    count += slot->holds() ? 1 : 0;
  }
  return count;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_SCRATCH_HPP
