#!/usr/bin/env bash
# What bench/authors_bench.py reads on a machine that has neither ../shared nor the authors' repository
# (a lent GPU machine): writes .gpu/ref/ (git-ignored) with copies of ../shared/ref's moa_ref_loader.py and
# ref_bench.py and authors.tar.gz, the llama/ and util/ folders of their LLaMA3_sparse_moa and
# LLaMA3_soft_moa as `git archive` exports them from the mirror (the commit id in the archive's header).
# Nothing of theirs enters the repository: the folder is carried with a run and read there at run time.
#   MOA_MIRROR=/work/.mirror/DCDmllm+MoA/repo bash scripts/carry_authors.sh
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="${MOA_SHARED:-$REPO/../shared}"
MIRROR="${MOA_MIRROR:-}"
OUT="$REPO/.gpu/ref"
if [ -z "$MIRROR" ] || ! git --git-dir "$MIRROR" rev-parse --verify -q "${MOA_REV:-HEAD}^{commit}" >/dev/null; then
  echo "error: MOA_MIRROR='$MIRROR' is not a bare git dir of DCDmllm/MoA (fetched as github:DCDmllm/MoA)" \
       "holding ${MOA_REV:-HEAD}" >&2
  exit 2
fi
for f in moa_ref_loader.py ref_bench.py; do
  if [ ! -f "$SHARED/ref/$f" ]; then
    echo "error: $SHARED/ref/$f is missing (set MOA_SHARED to the shared folder)" >&2
    exit 2
  fi
done
mkdir -p "$OUT"
# the folders the loader reads from (llama/llama.py, llama_adapter.py, utils.py, util/misc.py) with their
# neighbours: a path list of our own would have to follow the loader's
paths=()
for variant in LLaMA3_sparse_moa LLaMA3_soft_moa; do paths+=("$variant/llama" "$variant/util"); done
# git reports blobs the mirror lacks even outside the exported folders (its large data files): shown only on failure
if ! said="$(git --git-dir "$MIRROR" archive --format=tar.gz -o "$OUT/authors.tar.gz.part" "${MOA_REV:-HEAD}" \
             "${paths[@]}" 2>&1)"; then
  echo "$said" >&2
  exit 1
fi
mv "$OUT/authors.tar.gz.part" "$OUT/authors.tar.gz"
cp -f "$SHARED/ref/moa_ref_loader.py" "$SHARED/ref/ref_bench.py" "$OUT/"
chmod u+w "$OUT"/*.py
commit="$(git --git-dir "$MIRROR" rev-parse --short "${MOA_REV:-HEAD}")"
echo "carried: $OUT ($(du -sk "$OUT" | cut -f1) KB; DCDmllm/MoA $commit)"
