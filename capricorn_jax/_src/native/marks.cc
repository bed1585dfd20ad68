// The threaded sender's window marks: an XLA FFI handler for the CPU platform
// that stamps a (table, site, device) slot with CLOCK_MONOTONIC and wakes the
// sender through an eventfd, with no Python and no GIL (a host callback costs
// ~0.5 ms of the step's CPU per device and mark; this costs two system calls).
//
// Python owns the tables (numpy int64 arrays) and binds them here by address:
// stamps[site * devices + device] (ns) and queued[...] (the chunk channel's
// unacknowledged bytes at the mark, SIOCOUTQ on the bound socket; -1 unknown).
// A mark of an unbound table, or outside its bounds, stamps nothing; a bind
// with null tables or negative extents is refused (``marks.py`` checks the
// arrays' dtype, layout and shape before their addresses come here).
#include <atomic>
#include <cstdint>
#include <ctime>
#include <sys/ioctl.h>
#include <linux/sockios.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {
constexpr int kTables = 64;
struct Table {
  std::atomic<int64_t*> stamps{nullptr};
  std::atomic<int64_t*> queued{nullptr};
  std::atomic<int64_t> sites{0};
  std::atomic<int64_t> devices{0};
  std::atomic<int> eventfd{-1};
  std::atomic<int> socket{-1};
};
Table g_tables[kTables];
}  // namespace

extern "C" int CapricornMarksBind(int table, int64_t* stamps, int64_t* queued, int64_t sites,
                                  int64_t devices, int eventfd) {
  if (table < 0 || table >= kTables || stamps == nullptr || queued == nullptr || sites < 0 ||
      devices < 0 || (devices > 0 && sites > INT64_MAX / devices))
    return -1;
  Table& t = g_tables[table];
  t.stamps.store(nullptr, std::memory_order_release);
  t.queued.store(queued, std::memory_order_relaxed);
  t.sites.store(sites, std::memory_order_relaxed);
  t.devices.store(devices, std::memory_order_relaxed);
  t.eventfd.store(eventfd, std::memory_order_relaxed);
  t.stamps.store(stamps, std::memory_order_release);
  return 0;
}

extern "C" int CapricornMarksSocket(int table, int fd) {
  if (table < 0 || table >= kTables) return -1;
  g_tables[table].socket.store(fd, std::memory_order_relaxed);
  return 0;
}

extern "C" int CapricornMarksUnbind(int table) {
  if (table < 0 || table >= kTables) return -1;
  g_tables[table].stamps.store(nullptr, std::memory_order_release);
  g_tables[table].socket.store(-1, std::memory_order_relaxed);
  g_tables[table].eventfd.store(-1, std::memory_order_relaxed);
  return 0;
}

static ffi::Error WindowMark(ffi::Buffer<ffi::F32> tag, ffi::Result<ffi::Buffer<ffi::F32>> out,
                             int64_t table, int64_t site) {
  if (out->element_count() < 1) return ffi::Error::InvalidArgument("a mark returns a scalar");
  out->typed_data()[0] = 0.0f;
  if (tag.element_count() < 1) return ffi::Error::Success();
  if (table < 0 || table >= kTables) return ffi::Error::Success();
  Table& t = g_tables[table];
  int64_t* stamps = t.stamps.load(std::memory_order_acquire);
  if (stamps == nullptr) return ffi::Error::Success();
  const int64_t device = static_cast<int64_t>(tag.typed_data()[0]);
  const int64_t devices = t.devices.load(std::memory_order_relaxed);
  if (site < 0 || site >= t.sites.load(std::memory_order_relaxed) || device < 0 ||
      device >= devices) {
    return ffi::Error::Success();
  }
  int64_t queued = -1;
  const int fd = t.socket.load(std::memory_order_relaxed);
  if (fd >= 0) {
    int value = 0;
    if (ioctl(fd, SIOCOUTQ, &value) == 0) queued = value;
  }
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  const int64_t slot = site * devices + device;
  t.queued.load(std::memory_order_relaxed)[slot] = queued;
  __atomic_store_n(&stamps[slot], static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec,
                   __ATOMIC_RELEASE);
  const int efd = t.eventfd.load(std::memory_order_relaxed);
  if (efd >= 0) {
    const uint64_t one = 1;
    ssize_t written = write(efd, &one, sizeof(one));
    (void)written;
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CapricornWindowMark, WindowMark,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("table")
                                  .Attr<int64_t>("site"));
