// moa-jittor's addition to Jittor's op compiler (src/jit_compiler.cc includes it; scripts/jittor_patches.sh copies it
// into Jittor's src/ folder). A CPU op's own source is a few dozen lines, and the compiler spent most of each op's
// compile parsing the ~75,000 lines of Jittor's headers and the C++ library before it: 0.5 s of a fused op's 0.7 s.
// Those headers, the ones Jittor's generated sources include, are compiled once per cache folder into a GCC
// precompiled header (<cache_path>/jit_prelude.h.gch) and read before every CPU op's source with `-include`.
// The op's code is unchanged: the prelude defines JIT and JIT_cpu as every op source does first, and each
// header it holds is guarded, so the op's own includes of them are skipped.
#pragma once
#include <mutex>
#include "utils/cache_compile.h"
#include "utils/str_utils.h"
#include "kernel_lock.h"

namespace jittor {

vector<string> shsplit(const string& s);  // src/jit_compiler.cc: split at spaces outside quotes

namespace jit_compiler {

static const char* jit_prelude_text = R"(// written by Jittor's op compiler (moa-jittor's jit_prelude.h)
#define JIT 1
#define JIT_cpu 1
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#include <assert.h>
#include <stdlib.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "var.h"
#include "executor.h"
#include "fused_op.h"
#include "misc/cpu_math.h"
#include "misc/cuda_flags.h"
#include "ops/op_register.h"
#include "ops/array_op.h"
#include "ops/binary_op.h"
#include "ops/broadcast_to_op.h"
#include "ops/code_op.h"
#include "ops/fuse_transpose_op.h"
#include "ops/getitem_op.h"
#include "ops/reduce_op.h"
#include "ops/setitem_op.h"
#include "ops/ternary_op.h"
#include "ops/transpose_op.h"
#include "ops/unary_op.h"
)";

// The flag that reads the prelude before an op's source: ` -include "<cache_path>/jit_prelude.h" ` once its
// precompiled form is built for `flags` (Jittor's cache_compile rebuilds it when the command or a header it reads
// changes), "" where the compiler is not GCC or the build failed: the op then compiles as it did before. A
// precompiled header that GCC finds unusable for an op (other options) is read as the text it was built from.
static string jit_prelude_flag(const string& compiler, const string& compiler_type, const string& flags,
                               const string& cache_folder, const string& jittor_folder) {
    static std::mutex building;
    static string built_for, flag;
    std::lock_guard<std::mutex> hold(building);
    if (compiler_type != "g++") return "";
    if (!built_for.empty() && built_for == flags) return flag;
    string header = join(cache_folder, "jit_prelude.h");
    string compile_flags;  // linking's flags name libraries as inputs, and GCC would link
    for (auto& option : shsplit(flags))
        if (option.size() && !startswith(option, "-l") && !startswith(option, "-L") && !startswith(option, "-Wl,")
            && option != "-shared")
            compile_flags += " " + option;
    try {
#ifdef __linux__
        kernel_lock hold(cache_folder, 0);  // processes sharing the cache build it once
#endif
        if (read_all(header) != jit_prelude_text) write(header, jit_prelude_text);
        cache_compile("\"" + compiler + "\" -x c++-header \"" + header + "\"" + compile_flags
                      + " -o \"" + header + ".gch\"", cache_folder, jittor_folder);
        flag = " -include \"" + header + "\" ";
    } catch (const std::exception& e) {
        LOGw << "Jittor's kernels compile without the precompiled prelude:" << e.what();
        flag = "";
    }
    built_for = flags;
    return flag;
}

} // jit_compiler
} // jittor
