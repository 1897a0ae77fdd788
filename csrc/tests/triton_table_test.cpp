// Test driver of the cubin table's C++ side, torch-free and without a GPU
// (tests/test_cubin_table.py compiles it with a generated table and feeds it every test and
// bench launch). Reads one launch per line from stdin, in the format of wiola/triton_plan.h,
// and prints its answer. With --drop-last, the packing leaves out the last kernel parameter
// (the planted mismatch the test must catch). With --runtime, checks the runtime table and the
// pending list instead (threads registering and looking up at once) and prints "ok".
#include <atomic>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "wiola/triton_plan.h"

namespace {

using namespace wiola::triton;

// 8 threads each register 200 variants over 100 keys (every key several times, from several
// threads) and look each up at once; then the table holds each key once, with its own cubin,
// and refuses variants the launcher cannot launch.
int runtime_checks() {
  static const Param params[] = {{ParamKind::kPtr, 0}, {ParamKind::kI32, 1}, {ParamKind::kF32, 2}};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&failures, t] {
      for (int i = 0; i < 200; ++i) {
        const int n = (i * 7 + t) % 100;
        const std::string key = "_k[*bf16/16,i32," + std::to_string(n) + ",w4,s3]";
        const std::string cubin = "cubin of " + std::to_string(n);
        const Variant v{key.c_str(), "_k", "fn", 90, cubin.data(), cubin.size(), 4, 1, 0, params, 3, 2, 0, 0, 0};
        std::string why;
        const RuntimeVariant* r = runtime_table().add(v, why);
        if (r == nullptr || r->key != key || std::string(r->variant.cubin, r->variant.cubin_size) != cubin ||
            r->variant.params == params || r->variant.num_params != 3) {
          ++failures;
          continue;
        }
        if (runtime_table().find(90, key) != r || runtime_table().find(80, key) != nullptr) ++failures;
        Packed packed;
        pack(r->variant, {Arg::pointer("p", "bf16", reinterpret_cast<const void*>(256)), Arg::integer("n", 7),
                          Arg::real("eps", 0.5)}, packed);
        if (packed.error != nullptr || packed.count != 5 || packed.sizes[0] != 8 || packed.sizes[1] != 4 ||
            packed.sizes[2] != 4 || packed.sizes[3] != 8 || packed.sizes[4] != 8) {
          ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  if (failures != 0) return std::cerr << failures << " failures\n", 1;
  if (runtime_table().entries().size() != 100) return std::cerr << runtime_table().entries().size() << " entries\n", 1;
  const std::string cubin = "c";
  std::string why;
  Variant scratch{"s", "_k", "fn", 90, cubin.data(), cubin.size(), 4, 1, 0, params, 3, 2, 64, 0, 0};
  if (runtime_table().add(scratch, why) != nullptr || why.empty()) return std::cerr << "scratch accepted\n", 1;
  Variant cluster{"c", "_k", "fn", 90, cubin.data(), cubin.size(), 4, 2, 0, params, 3, 2, 0, 0, 0};
  if (runtime_table().add(cluster, why) != nullptr) return std::cerr << "cluster accepted\n", 1;
  // Pending misses are scoped to an op call; a nested call keeps its own and restores the caller's.
  {
    const PendingScope outer;
    pending().push_back({"_a", "A", 90, 0});
    {
      const PendingScope inner;
      if (!pending().empty()) return std::cerr << "inner scope inherited\n", 1;
      pending().push_back({"_b", "B", 90, 0});
    }
    if (pending().size() != 1 || pending()[0].key != "A") return std::cerr << "outer scope lost\n", 1;
  }
  if (!pending().empty()) return std::cerr << "pending outlived its scope\n", 1;
  std::cout << "ok\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--runtime") == 0) return runtime_checks();
  const bool drop_last = argc > 1 && std::strcmp(argv[1], "--drop-last") == 0;
  std::string line;
  while (std::getline(std::cin, line)) {
    bool ok = true;
    const std::string out = wiola::triton::plan::answer(line, drop_last, ok);
    if (!ok) {
      std::cerr << "unknown command: " << line << "\n";
      return 2;
    }
    if (!out.empty()) std::cout << out << "\n";
  }
  return 0;
}
