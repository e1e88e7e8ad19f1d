#!/usr/bin/env bash
# On the lent GPU machine (shared/GPU.md): the loader's speed before and after a change, alternated in one
# call. Installs the tree in .before/ (an older commit: `git archive REV | tar -x -C .before`) and this
# checkout into folders of their own, then tools/ab_loader.py runs them in turns. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/hotloop-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for name in before after; do
    src=.; [[ $name == before ]] && src=.before
    if ! (cd "$src" && python3 -m pip install --no-deps --no-build-isolation --target "/tmp/site-$name" .) \
            >"$OUT/build-$name.log" 2>&1; then
        tail -30 "$OUT/build-$name.log"
        exit 1
    fi
done
python3 tools/ab_loader.py --build before=/tmp/site-before --build after=/tmp/site-after \
    --rounds "${ROUNDS:-3}" --json "$OUT/ab.json" 2>&1 | tee "$OUT/ab.log"
