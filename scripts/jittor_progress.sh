#!/usr/bin/env bash
# Jittor 1.3.11's compile progress leaves a blank line in a terminal (run by setup.sh on every machine).
# Usage: bash scripts/jittor_progress.sh <site-packages dir holding jittor/>. Idempotent; Jittor rebuilds the one
# changed file of its core on the next import.
#
# Why: when compiling takes over two seconds, src/parallel_compiler.cc writes "\n" to stderr, then its progress
# ("Compiling Operators(i/n) ... \r", each over the last), then a newline. The first "\n" is there so that the
# progress does not overwrite a line in progress, but after a finished line (nearly always: our tools print
# whole lines) it leaves an empty one, one per burst of compiling. In a terminal the progress now starts by
# clearing the current line instead (carriage return, erase to its end: a progress bar there is redrawn by its
# next update); a file or a pipe still gets the "\n", since it cannot erase.
set -euo pipefail
J="${1:?usage: jittor_progress.sh SITE_PACKAGES}/jittor"
[ -f "$J/src/parallel_compiler.cc" ] || { echo "no Jittor sources under $J" >&2; exit 2; }
python3 - "$J/src/parallel_compiler.cc" <<'PY'
import sys
path = sys.argv[1]
MARK = "// moa-jittor: progress"
text = open(path).read()
if MARK in text:
    sys.exit(0)
edits = [('#include "mem/mem_info.h"\n', '#include "mem/mem_info.h"\n#include <unistd.h>\n'),
         ('                std::cerr << "\\n";\n                change_line = true;\n',
          f'                {MARK}: a terminal clears its line, where "\\n" left an empty one\n'
          '                std::cerr << (isatty(2) ? "\\r\\033[K" : "\\n");\n                change_line = true;\n')]
for anchor, replacement in edits:
    if text.count(anchor) != 1:
        sys.exit(f"{path}: the line to patch was not found once (not Jittor 1.3.11?): {anchor.strip()[:60]}")
    text = text.replace(anchor, replacement)
open(path, "w").write(text)
print(f"[jittor_progress] patched {path}")
PY
