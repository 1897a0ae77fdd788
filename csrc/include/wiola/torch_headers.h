// The torch headers nearly every C++ source of the extension includes. setup.py compiles this
// file once into a GCC precompiled header that every source reads first (-include), as do
// CMakeLists.txt's kernel library and scripts/check_device_headers.sh: parsing these headers
// was about half of each source's compile time. Sources still include what they use.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
