#!/usr/bin/env bash
# On the lent GPU machine (shared/GPU.md): the component rows a change may move, before and after, in one
# call: the build in .before/ (`git archive REV | tar -x -C .before`) and this checkout, each installed into a
# folder of its own (kept from tools/gpu_ab.sh where it ran first on this machine). Rows: ONLY (default:
# monitor, startup, scaler, optim); JSON files and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/hotloop-benches}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
only=()
for row in ${ONLY:-monitor startup scaler optim}; do only+=(--only "$row"); done
for name in before after; do
    src=.; [[ $name == before ]] && src=.before
    if [[ ! -d /tmp/site-$name/hotloop ]] && ! (cd "$src" && python3 -m pip install --no-deps \
            --no-build-isolation --target "/tmp/site-$name" .) >"$OUT/build-$name.log" 2>&1; then
        tail -30 "$OUT/build-$name.log"
        exit 1
    fi
done
for name in ${ORDER:-before after}; do
    echo "== $name"
    (cd /tmp && PYTHONPATH=/tmp/site-$name HOTLOOP_CACHE_DIR=/tmp/site-$name/.kernel-cache \
        python3 -m hotloop bench components "${only[@]}" --json "$OUT/bench-$name.json") 2>&1 \
        | tee "$OUT/bench-$name.log"
done
