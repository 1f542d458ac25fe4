#!/usr/bin/env bash
# Five changes to Jittor 1.3.11 (four to its C++ sources, one to its cache's key), run by setup.sh on every machine
# (CUDA 13's: scripts/jittor_cuda13.sh).
# Usage: bash scripts/jittor_patches.sh <site-packages dir holding jittor/>. Idempotent; Jittor rebuilds the changed
# files of its core on the next import.
#
# The interpreter's lock. An op whose source holds `@python.module.function(...)` (jt.isfinite, jt.isnan,
# searchsorted, ...) is expanded by calling Python (src/pyjt/py_caller.cc) from whichever thread compiles it: with
# the threaded op compiler on (Jittor's default, 16 threads), a thread that holds no Python thread state. Python 3.11
# lends it the main thread's state (undefined, and it happens to work); from Python 3.12 the state is per thread and
# the call dereferences a null one: "Caught segfault at address 0x10, thread_name: 'C10'" at Math.py's first
# optimizer step on a GPU machine (docs/gpu.md), where the finite check is Jittor's isfinite. The fix is Python's
# rule for foreign threads: py_caller takes the lock with PyGILState_Ensure, and the main thread releases it while
# it waits for the compiler threads (it only sleeps there), taking it back before it reads their results.
#
# The compile time. Every CPU op's compile ran g++ through a Python wrapper (utils/asm_tuner.py: a second
# compile to assembly with debug information, then the assembler) to apply the assembly rewrites that an op
# source asks for with "@begin" (a few broadcast fills); now only those sources take it, and the others compile
# straight to their library, as the wrapper's last step did. And each op read Jittor's common headers through
# a precompiled header built once per cache folder (scripts/jittor_patches/jit_prelude.h, copied into src/).
# Measured on this project's test suite's kernels (2-core EPYC, g++ 12): a fused op 0.9 s -> 0.24 s, one of
# ours 2.0 s -> 1.0 s; the code generated is the same (assembly equal but for label numbers).
#
# The compile lock. Jittor held one lock over its whole cache folder while a process compiled (or loaded) a batch of
# kernels, so the test suite's workers, sharing a cache, compiled one kernel at a time between them; on Linux each
# kernel now takes a lock of its own (scripts/jittor_patches/kernel_lock.h, copied into src/).
#
# The cache's key. Jittor names its cache folder after the OS, compiler, Python, CPU model and the host's name; the
# name now comes from the environment variable jittor_cache_host where it is set (Utils/jittor_env.py sets the CPU's
# model and instruction sets there), so the nodes of a cluster that share a home share one cache, compiled once.
#
# The compile progress. When compiling takes over two seconds, src/parallel_compiler.cc writes "\n" to stderr, then
# its progress ("Compiling Operators(i/n) ... \r", each over the last), then a newline. The first "\n" keeps the
# progress off a line in progress, but after a finished line (nearly always: our tools print whole lines) it leaves
# an empty one per burst of compiling. In a terminal the progress now starts by clearing the current line instead
# (carriage return, erase to its end: a progress bar there is redrawn by its next update); a file or a pipe still
# gets the "\n", since it cannot erase.
set -euo pipefail
J="${1:?usage: jittor_patches.sh SITE_PACKAGES}/jittor"
[ -f "$J/src/parallel_compiler.cc" ] || { echo "no Jittor sources under $J" >&2; exit 2; }
python3 - "$J/src" "$(dirname "${BASH_SOURCE[0]}")/jittor_patches" <<'PY'
import os, sys
src, additions = sys.argv[1], sys.argv[2]

def patch(name, mark, edits):
    """Apply `edits` (anchor, replacement) to src/`name` unless `mark` is there already."""
    path = os.path.join(src, name)
    text = open(path).read()
    if mark in text:
        return
    for anchor, replacement in edits:
        if text.count(anchor) != 1:
            sys.exit(f"{path}: the line to patch was not found once (not Jittor 1.3.11?): {anchor.strip()[:60]}")
        text = text.replace(anchor, replacement)
    open(path, "w").write(text)
    print(f"[jittor_patches] {mark.lstrip('/# ')}: patched {os.path.normpath(path)}")

GIL = "// moa-jittor: GIL"
patch("pyjt/py_caller.cc", GIL, [(
    "string py_caller(const string& mod_func, const vector<string>& args, const map<string,string>& kw) {\n",
    "string py_caller(const string& mod_func, const vector<string>& args, const map<string,string>& kw) {\n"
    f"    {GIL}: a compiler thread calls this without the interpreter's lock\n"
    "    struct GilHold { PyGILState_STATE s = PyGILState_Ensure(); ~GilHold() { PyGILState_Release(s); } } gil;\n")])
patch("parallel_compiler.cc", GIL, [
    ('#include "mem/mem_info.h"\n', '#include "mem/mem_info.h"\n#include <Python.h>\n'),
    ("    threads.launch_all(active_threads, func);\n",
     f"    {GIL}: the compiler threads may call Python (py_caller.cc); this thread only waits for them\n"
     "    PyThreadState* gil_saved = PyGILState_Check() ? PyEval_SaveThread() : nullptr;\n"
     "    threads.launch_all(active_threads, func);\n"),
    ("    if (change_line)\n        std::cerr << std::endl;\n",
     "    if (gil_saved) PyEval_RestoreThread(gil_saved);\n"
     "    if (change_line)\n        std::cerr << std::endl;\n")])

PROGRESS = "// moa-jittor: progress"
patch("parallel_compiler.cc", PROGRESS, [
    ('#include "mem/mem_info.h"\n', '#include "mem/mem_info.h"\n#include <unistd.h>\n'),
    ('                std::cerr << "\\n";\n                change_line = true;\n',
     f'                {PROGRESS}: a terminal clears its line, where "\\n" left an empty one\n'
     '                std::cerr << (isatty(2) ? "\\r\\033[K" : "\\n");\n                change_line = true;\n')])

COMPILE = "// moa-jittor: compile time"
for header in ("jit_prelude.h", "kernel_lock.h"):
    text, installed = open(os.path.join(additions, header)).read(), os.path.join(src, header)
    if not os.path.exists(installed) or open(installed).read() != text:
        open(installed, "w").write(text)  # Jittor rebuilds jit_compiler.cc when a header it includes changes
patch("jit_compiler.cc", COMPILE, [
    ('#include "utils/str_utils.h"\n', '#include "utils/str_utils.h"\n#include "jit_prelude.h"\n'),
    ('            + " \\"" + jit_src_path + "\\"" + other_src\n'
     '            + fix_cl_flags(cc_flags + extra_flags, is_cuda_op)\n',
     '            + " \\"" + jit_src_path + "\\"" + other_src\n'
     f'            + jit_prelude_flag(cc_path, cc_type, cc_flags, cache_path, jittor_path)  {COMPILE}\n'
     '            + fix_cl_flags(cc_flags + extra_flags, is_cuda_op)\n'),
    ('#ifdef __linux__\n        cmd = python_path',
     f'#ifdef __linux__\n        if (src.find("@begin") != string::npos)  {COMPILE}: only the sources that ask\n'
     '        cmd = python_path')])

LOCKS = "// moa-jittor: kernel locks"
patch("jit_compiler.cc", LOCKS, [
    ('#include "jit_prelude.h"\n', '#include "jit_prelude.h"\n#include "kernel_lock.h"\n'),
    ("    if (rewrite_op || !file_exist(jit_src_path2))\n",
     f"#ifdef __linux__\n    kernel_lock hold(cache_path, kernel_byte(jit_src_path));  {LOCKS}: this kernel's files\n"
     "#endif\n    if (rewrite_op || !file_exist(jit_src_path2))\n")])
for name, anchor in (("op_compiler.cc", "    if (do_compile_hook)"),
                     ("parallel_compiler.cc", "    auto func = [&](int tid) {")):
    patch(name, LOCKS, [(f"    jittor::lock_guard lg;\n{anchor}",
                         f"#ifndef __linux__  {LOCKS}: on Linux jit_compiler.cc locks each kernel\n"
                         f"    jittor::lock_guard lg;\n#endif\n{anchor}")])

HOST = "# moa-jittor: cache host"
patch("../../jittor_utils/__init__.py", HOST, [(
    "    osv = platform.platform() + platform.node()\n",
    f"    {HOST}: what stands for this host in the key (Utils/jittor_env.py sets the CPU's identity)\n"
    '    osv = platform.platform() + os.environ.get("jittor_cache_host", platform.node())\n')])
PY
