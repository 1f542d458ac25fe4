#!/usr/bin/env bash
# Jittor 1.3.11's op compiler threads call Python without the interpreter's lock (run by setup.sh on every machine).
# Usage: bash scripts/jittor_gil.sh <site-packages dir holding jittor/>. Idempotent; Jittor rebuilds its core on the
# next import.
#
# Why: an op whose source holds `@python.module.function(...)` (jt.isfinite, jt.isnan, searchsorted, ...) is expanded
# by calling Python (src/pyjt/py_caller.cc) from whichever thread compiles it: with the threaded op compiler on
# (Jittor's default, 16 threads), a compiler thread that holds no Python thread state. Python 3.11 lends it the main
# thread's state (undefined, and it happens to work); from Python 3.12 the state is per thread, and the call
# dereferences a null state: "Caught segfault at address 0x10, thread_name: 'C10'" at Math.py's first optimizer step
# on a GPU machine (docs/gpu.md), where the finite check is Jittor's isfinite. The fix is Python's own rule for
# foreign threads: py_caller takes the lock with PyGILState_Ensure, and the main thread releases it while it waits
# for the compiler threads (it only sleeps there), taking it back before it reads their results.
set -euo pipefail
J="${1:?usage: jittor_gil.sh SITE_PACKAGES}/jittor"
[ -f "$J/src/parallel_compiler.cc" ] || { echo "no Jittor sources under $J" >&2; exit 2; }
python3 - "$J/src" <<'PY'
import os, sys
src = sys.argv[1]
MARK = "// moa-jittor: GIL"

def patch(name, edits):
    path = os.path.join(src, name)
    text = open(path).read()
    if MARK in text:
        return
    for anchor, replacement in edits:
        if text.count(anchor) != 1:
            sys.exit(f"{path}: the line to patch was not found once (not Jittor 1.3.11?): {anchor.strip()[:60]}")
        text = text.replace(anchor, replacement)
    open(path, "w").write(text)

patch("pyjt/py_caller.cc", [(
    "string py_caller(const string& mod_func, const vector<string>& args, const map<string,string>& kw) {\n",
    "string py_caller(const string& mod_func, const vector<string>& args, const map<string,string>& kw) {\n"
    f"    {MARK}: a compiler thread calls this without the interpreter's lock\n"
    "    struct GilHold { PyGILState_STATE s = PyGILState_Ensure(); ~GilHold() { PyGILState_Release(s); } } gil;\n")])

patch("parallel_compiler.cc", [
    ('#include "mem/mem_info.h"\n',
     '#include "mem/mem_info.h"\n#include <Python.h>\n'),
    ("    threads.launch_all(active_threads, func);\n",
     f"    {MARK}: the compiler threads may call Python (py_caller.cc); this thread only waits for them\n"
     "    PyThreadState* gil_saved = PyGILState_Check() ? PyEval_SaveThread() : nullptr;\n"
     "    threads.launch_all(active_threads, func);\n"),
    ("    if (change_line)\n        std::cerr << std::endl;\n",
     "    if (gil_saved) PyEval_RestoreThread(gil_saved);\n"
     "    if (change_line)\n        std::cerr << std::endl;\n"),
])
print(f"[jittor_gil] patched {src}")
PY
