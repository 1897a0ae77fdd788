// The one kernel-launch helper of csrc/cuda/*.cu: `kernel<<<grid, block, smem, stream>>>`
// under nvcc, the SIMT emulator (csrc/cuda/emu/) when compiled as host C++ with
// -DWIOLA_CUDA_EMU. Arguments convert to the kernel's parameter types as in a launch.
// Launch errors are read with cudaGetLastError(), as after <<<...>>>.
#pragma once

#include <utility>

#ifdef WIOLA_CUDA_EMU
#include "../../cuda/emu/cuda_emu.h"
#else
#include <cuda_runtime.h>
#endif

namespace wiola::cuda {

template <typename... KArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  static_assert(sizeof...(KArgs) == sizeof...(Args), "wrong number of kernel arguments");
#ifdef WIOLA_CUDA_EMU
  wiola_emu::launch_typed(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(static_cast<KArgs>(std::forward<Args>(args))...);
#endif
}

}  // namespace wiola::cuda
