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

// The functions loaded so far: per table entry, per device (null until loaded).
struct Loaded {
  std::unique_ptr<std::atomic<CUfunction>[]> functions;
  std::unordered_map<std::string, size_t> index;  // "arch:key" -> entry
  std::mutex mutex;                                // taken to load
  std::unordered_map<size_t, std::string> failures;  // why a module did not load (entry * devices + device)

  Loaded() {
    const Table& t = table();
    functions.reset(new std::atomic<CUfunction>[t.size * kMaxDevices]);
    for (size_t i = 0; i < t.size * kMaxDevices; ++i) functions[i].store(nullptr);
    for (size_t i = 0; i < t.size; ++i) index.emplace(std::to_string(t.variants[i].arch) + ":" + t.variants[i].key, i);
  }
};

Loaded& loaded() {
  static Loaded l;
  return l;
}

// Marks a function whose module failed to load on a device (the reason in Loaded::failures).
const CUfunction kFailed = reinterpret_cast<CUfunction>(uintptr_t{1});

// The variant's function on `device`, its module loaded on first use; nullptr (the reason in
// `why`) where the driver refuses the cubin (e.g. a driver older than the Triton that built
// it), which the caller treats as a missing variant.
CUfunction load(size_t entry, int device, cudaStream_t stream, std::string& why) {
  Loaded& l = loaded();
  std::atomic<CUfunction>& slot = l.functions[entry * kMaxDevices + device];
  CUfunction f = slot.load(std::memory_order_acquire);
  if (f != nullptr && f != kFailed) return f;
  if (f == kFailed) {
    std::lock_guard<std::mutex> lock(l.mutex);
    why = l.failures[entry * kMaxDevices + device];
    return nullptr;
  }
  const Variant& v = table().variants[entry];
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone, "wiola: the Triton kernel ", v.key,
              " is launched for the first time on cuda:", device,
              " while the stream is being captured into a CUDA graph, and loading its module is not allowed "
              "during capture: run the op once (eager) before capturing");
  std::lock_guard<std::mutex> lock(l.mutex);
  f = slot.load(std::memory_order_acquire);
  if (f == kFailed) why = l.failures[entry * kMaxDevices + device];
  if (f != nullptr) return f == kFailed ? nullptr : f;
  const Driver& d = driver();
  CUmodule module = nullptr;
  std::string error;
  CUresult rc = d.module_load_data(&module, v.cubin);
  if (rc != CUDA_SUCCESS) {
    error = "the driver refuses the cubin of " + std::string(v.key) + " (built by Triton " +
            table().triton_version + "): " + driver_error(rc);
  } else if ((rc = d.module_get_function(&f, module, v.function)) != CUDA_SUCCESS) {
    error = std::string(v.function) + " not found in its cubin: " + driver_error(rc);
  } else if (v.shared > 48 * 1024 &&
             (rc = d.func_set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, v.shared)) !=
                 CUDA_SUCCESS) {
    error = std::string(v.key) + " needs " + std::to_string(v.shared) + " bytes of shared memory: " + driver_error(rc);
  }
  if (!error.empty()) {
    l.failures[entry * kMaxDevices + device] = error;
    slot.store(kFailed, std::memory_order_release);
    why = error;
    return nullptr;
  }
  slot.store(f, std::memory_order_release);
  return f;
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
    default: return "unsupported";
  }
}

int64_t sm_count(int device) { return device_info(device).sms; }

int arch(int device) { return device_info(device).arch; }

const Variant* lookup(const Launch& l, int device, std::string& why) {
  const Table& t = table();
  if (t.missing_reason != nullptr) {
    why = std::string("this build has no cubin table (") + t.missing_reason + ")";
    return nullptr;
  }
  DeviceInfo& info = device_info(device);
  if (!info.error.empty()) {
    why = info.error;
    return nullptr;
  }
  Loaded& lo = loaded();
  const std::string k = key(l);
  const auto it = lo.index.find(std::to_string(info.arch) + ":" + k);
  if (it == lo.index.end()) {
    why = "the cubin table (Triton " + std::string(t.triton_version) + ") has no variant " + k + " for sm_" +
          std::to_string(info.arch);
    return nullptr;
  }
  return &t.variants[it->second];
}

bool launch(const Variant& v, const Launch& l, int device, std::string& why) {
  DeviceInfo& info = device_info(device);
  Packed packed;
  pack(v, l.args, packed);
  TORCH_CHECK(packed.error == nullptr, "wiola: packing the arguments of ", v.key, ": ", packed.error);
  TORCH_CHECK(v.num_ctas == 1 && !v.cooperative, "wiola: ", v.key, " needs a cluster or cooperative launch");
  TORCH_CHECK(l.grid > 0 && l.grid <= INT32_MAX, "wiola: grid of ", l.grid, " programs for ", v.key);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const Driver& d = driver();
  CUcontext current = nullptr;
  d.ctx_get_current(&current);
  if (current != info.ctx) {
    const CUresult rc = d.ctx_set_current(info.ctx);
    TORCH_CHECK(rc == CUDA_SUCCESS, "wiola: cuCtxSetCurrent: ", driver_error(rc));
  }
  const CUfunction f = load(static_cast<size_t>(&v - table().variants), device, stream, why);
  if (f == nullptr) return false;
  const CUresult rc = d.launch_kernel(f, static_cast<unsigned>(l.grid), 1, 1, 32 * v.num_warps, 1, 1, v.shared,
                                      reinterpret_cast<CUstream>(stream), packed.params, nullptr);
  TORCH_CHECK(rc == CUDA_SUCCESS, "wiola: launching ", v.key, " failed: ", driver_error(rc));
  return true;
}

bool launch(const Launch& l, int device, std::string& why) {
  const Variant* v = lookup(l, device, why);
  return v != nullptr && launch(*v, l, device, why);
}

}  // namespace wiola::triton
