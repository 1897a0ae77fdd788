// See triton_launch.h.
#include "triton_launch.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace wiola::triton {
namespace {

// The driver functions used, with cuda.h's types (no link against libcuda).
struct Driver {
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                            void**, void**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  std::string error;  // why the driver could not be reached (empty when it was)
};

template <typename F>
bool entry_point(const char* name, F& fn, std::string& error) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
  const cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
#else
  const cudaError_t rc = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &found);
#endif
  if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    if (error.empty()) error = std::string("the CUDA driver has no ") + name + " (" + cudaGetErrorString(rc) + ")";
    return false;
  }
  fn = reinterpret_cast<F>(p);
  return true;
}

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    bool ok = entry_point("cuModuleLoadData", r.module_load_data, r.error);
    ok = entry_point("cuModuleGetFunction", r.module_get_function, r.error) && ok;
    ok = entry_point("cuFuncSetAttribute", r.func_set_attribute, r.error) && ok;
    ok = entry_point("cuLaunchKernel", r.launch_kernel, r.error) && ok;
    ok = entry_point("cuCtxGetCurrent", r.ctx_get_current, r.error) && ok;
    ok = entry_point("cuCtxSetCurrent", r.ctx_set_current, r.error) && ok;
    ok = entry_point("cuDevicePrimaryCtxRetain", r.primary_ctx_retain, r.error) && ok;
    entry_point("cuGetErrorString", r.get_error_string, r.error);
    (void)ok;
    return r;
  }();
  return d;
}

std::string driver_error(CUresult rc) {
  const char* s = nullptr;
  if (driver().get_error_string != nullptr) driver().get_error_string(rc, &s);
  return s != nullptr ? std::string(s) : "CUresult " + std::to_string(static_cast<int>(rc));
}

constexpr int kMaxDevices = 64;

// Per device: its primary context, SM count and architecture (read once).
struct DeviceInfo {
  std::once_flag once;
  CUcontext ctx = nullptr;
  int64_t sms = 0;
  int arch = 0;
  std::string error;
};

DeviceInfo& device_info(int device) {
  static std::array<DeviceInfo, kMaxDevices> infos;
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "wiola: CUDA device index ", device, " out of range");
  DeviceInfo& info = infos[device];
  std::call_once(info.once, [&] {
    int sms = 0, major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    info.sms = sms;
    info.arch = major * 10 + minor;
    const Driver& d = driver();
    if (!d.error.empty()) {
      info.error = d.error;
      return;
    }
    const CUresult rc = d.primary_ctx_retain(&info.ctx, static_cast<CUdevice>(device));
    if (rc != CUDA_SUCCESS) info.error = "cuDevicePrimaryCtxRetain: " + driver_error(rc);
  });
  return info;
}

}  // namespace

// A variant (of the static or the runtime table) and its function on each device, loaded on the
// first launch there.
struct Kernel {
  const Variant* variant = nullptr;
  bool runtime = false;  // registered at run time by the Python launcher
  std::array<std::atomic<CUfunction>, kMaxDevices> functions{};
  std::unordered_map<int, std::string> failures;  // why a module did not load, per device (under load_mutex)
};

namespace {

std::mutex& load_mutex() {
  static std::mutex m;
  return m;
}

// The static table's kernels, indexed by "arch:key".
struct StaticKernels {
  std::unique_ptr<Kernel[]> kernels;
  std::unordered_map<std::string, const Kernel*> index;

  StaticKernels() {
    const Table& t = table();
    kernels.reset(new Kernel[t.size]);
    for (size_t i = 0; i < t.size; ++i) {
      kernels[i].variant = &t.variants[i];
      index.emplace(std::to_string(t.variants[i].arch) + ":" + t.variants[i].key, &kernels[i]);
    }
  }
};

const StaticKernels& static_kernels() {
  static const StaticKernels k;
  return k;
}

// The Kernel of a runtime-table variant (made once, kept for the process like the variant).
Kernel* runtime_kernel(const RuntimeVariant& r) {
  if (void* state = r.state.load(std::memory_order_acquire)) return static_cast<Kernel*>(state);
  auto k = std::make_unique<Kernel>();
  k->variant = &r.variant;
  k->runtime = true;
  void* state = RuntimeTable::attach(r, k.get());
  if (state == k.get()) return k.release();
  return static_cast<Kernel*>(state);
}

// Marks a function whose module failed to load on a device (the reason in Kernel::failures).
const CUfunction kFailed = reinterpret_cast<CUfunction>(uintptr_t{1});

// The kernel's function on `device`, its module loaded on first use; nullptr (the reason in
// `why`) where the driver refuses the cubin (e.g. a driver older than the Triton that built it),
// which the caller treats as a missing variant. A first use while `stream` is captured into a
// CUDA graph raises for a static variant (documented: run the op once before capturing) and
// answers nullptr for a runtime one (its Python launcher, which compiled it, runs instead).
CUfunction load(const Kernel& kernel, int device, cudaStream_t stream, std::string& why) {
  auto& slot = const_cast<Kernel&>(kernel).functions[device];
  CUfunction f = slot.load(std::memory_order_acquire);
  if (f != nullptr && f != kFailed) return f;
  std::lock_guard<std::mutex> lock(load_mutex());
  if (f == kFailed) {
    why = kernel.failures.at(device);
    return nullptr;
  }
  const Variant& v = *kernel.variant;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone && slot.load(std::memory_order_acquire) == nullptr) {
    if (kernel.runtime) {
      why = "the Triton kernel " + std::string(v.key) + ", compiled at run time, is not loaded on cuda:" +
            std::to_string(device) + " and the stream is being captured into a CUDA graph (no module loads then)";
      return nullptr;
    }
    TORCH_CHECK(false, "wiola: the Triton kernel ", v.key, " is launched for the first time on cuda:", device,
                " while the stream is being captured into a CUDA graph, and loading its module is not allowed "
                "during capture: run the op once (eager) before capturing");
  }
  f = slot.load(std::memory_order_acquire);
  if (f == kFailed) why = kernel.failures.at(device);
  if (f != nullptr) return f == kFailed ? nullptr : f;
  const Driver& d = driver();
  CUmodule module = nullptr;
  std::string error;
  CUresult rc = d.module_load_data(&module, v.cubin);
  if (rc != CUDA_SUCCESS) {
    error = "the driver refuses the cubin of " + std::string(v.key) + " (built by Triton " +
            (kernel.runtime ? "at run time" : std::string(table().triton_version)) + "): " + driver_error(rc);
  } else if ((rc = d.module_get_function(&f, module, v.function)) != CUDA_SUCCESS) {
    error = std::string(v.function) + " not found in its cubin: " + driver_error(rc);
  } else if (v.shared > 48 * 1024 &&
             (rc = d.func_set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, v.shared)) !=
                 CUDA_SUCCESS) {
    error = std::string(v.key) + " needs " + std::to_string(v.shared) + " bytes of shared memory: " + driver_error(rc);
  }
  if (!error.empty()) {
    const_cast<Kernel&>(kernel).failures[device] = error;
    slot.store(kFailed, std::memory_order_release);
    why = error;
    return nullptr;
  }
  slot.store(f, std::memory_order_release);
  return f;
}

// Makes the device's primary context current (the Python launcher may leave another).
void set_context(const Driver& d, const DeviceInfo& info) {
  CUcontext current = nullptr;
  d.ctx_get_current(&current);
  if (current != info.ctx) {
    const CUresult rc = d.ctx_set_current(info.ctx);
    TORCH_CHECK(rc == CUDA_SUCCESS, "wiola: cuCtxSetCurrent: ", driver_error(rc));
  }
}

}  // namespace

const char* dtype_name(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return "fp32";
    case at::kDouble: return "fp64";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kLong: return "i64";
    case at::kInt: return "i32";
    case at::kShort: return "i16";
    case at::kChar: return "i8";
    case at::kByte: return "u8";
    default: return "unsupported";
  }
}

int64_t sm_count(int device) { return device_info(device).sms; }

int arch(int device) { return device_info(device).arch; }

const Kernel* lookup(const Launch& l, int device, std::string& why) {
  const Table& t = table();
  DeviceInfo& info = device_info(device);
  if (!info.error.empty()) {
    why = info.error;
    return nullptr;
  }
  const std::string k = key(l);
  const std::string id = std::to_string(info.arch) + ":" + k;
  const StaticKernels& s = static_kernels();
  if (const auto it = s.index.find(id); it != s.index.end()) return it->second;
  if (const RuntimeVariant* r = runtime_table().find(info.arch, k)) return runtime_kernel(*r);
  // Missed: the Python launcher that runs instead registers what its JIT compiles under this key.
  pending().push_back({l.kernel, k, info.arch, device});
  why = t.missing_reason != nullptr
            ? std::string("this build has no cubin table (") + t.missing_reason + ")"
            : "the cubin table (Triton " + std::string(t.triton_version) + ") has no variant " + k + " for sm_" +
                  std::to_string(info.arch);
  return nullptr;
}

bool launch(const Kernel& kernel, const Launch& l, int device, std::string& why) {
  const Variant& v = *kernel.variant;
  DeviceInfo& info = device_info(device);
  Packed packed;
  pack(v, l.args, packed);
  TORCH_CHECK(packed.error == nullptr, "wiola: packing the arguments of ", v.key, ": ", packed.error);
  TORCH_CHECK(v.num_ctas == 1 && !v.cooperative, "wiola: ", v.key, " needs a cluster or cooperative launch");
  TORCH_CHECK(l.grid > 0 && l.grid <= INT32_MAX && l.grid_y > 0 && l.grid_y <= 65535, "wiola: grid of (", l.grid,
              ", ", l.grid_y, ") programs for ", v.key);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const Driver& d = driver();
  set_context(d, info);
  const CUfunction f = load(kernel, device, stream, why);
  if (f == nullptr) return false;
  const CUresult rc = d.launch_kernel(f, static_cast<unsigned>(l.grid), static_cast<unsigned>(l.grid_y), 1, 32 * v.num_warps, 1, 1, v.shared,
                                      reinterpret_cast<CUstream>(stream), packed.params, nullptr);
  TORCH_CHECK(rc == CUDA_SUCCESS, "wiola: launching ", v.key, " failed: ", driver_error(rc));
  return true;
}

bool launch(const Launch& l, int device, std::string& why) {
  const Kernel* k = lookup(l, device, why);
  return k != nullptr && launch(*k, l, device, why);
}

void warn_fallback(std::once_flag& once, const char* op, const std::string& why) {
  // A miss the Python launcher registers (pending) is silent: the launcher warns if it cannot.
  if (!pending().empty()) return;
  std::call_once(once, [&] {
    TORCH_WARN("wiola::", op, " on CUDA runs the Python Triton launcher instead of the precompiled kernel: ", why);
  });
}

void preload(const RuntimeVariant& r, int device) {
  if (device < 0 || device >= kMaxDevices) return;
  DeviceInfo& info = device_info(device);
  if (!info.error.empty()) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;  // loaded on its first launch outside a capture
  set_context(driver(), info);
  std::string why;
  load(*runtime_kernel(r), device, stream, why);  // a refusal is kept: its launches run Python
}

}  // namespace wiola::triton
