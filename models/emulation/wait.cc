// The emulated accelerator's compute: a wait that holds no core and no GIL.
//
// An XLA FFI handler for the CPU platform. It passes its first operand through
// (aliased to its result, so normally no byte is copied) and sleeps until the
// requested number of milliseconds, read from its second operand (a float32
// scalar computed inside the step), has passed since it started. The pass-through
// puts the wait in the data path, so XLA orders it with the layer's other work.
#include <chrono>
#include <cstring>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error EmulatedWait(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> ms,
                               ffi::Result<ffi::AnyBuffer> out) {
  const auto start = std::chrono::steady_clock::now();
  if (out->untyped_data() != x.untyped_data()) {
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  const float wait_ms = ms.typed_data()[0];
  if (wait_ms > 0.0f) {
    const auto until = start + std::chrono::microseconds(
                                   static_cast<long long>(wait_ms * 1000.0f));
    std::this_thread::sleep_until(until);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CapricornEmulatedWait, EmulatedWait,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());
