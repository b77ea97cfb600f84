#!/usr/bin/env bash
# The second device call after bench/h200_round.sh: the whole step (stock against fp32patch) over
# the larger shapes and longer contexts issue 44 asks for, in one call of at most 600 s, packed
# into $OUT/round2.tar.gz after every part (the device brings back at most 8 files).
#
#   bash bench/h200_round2.sh           # on the device machine, in the repository root
#
# 1. 1.5B untied and 3B tied at 1k, 4k and 16k tokens, entropy off and on;
# 2. 0.5B tied at 16k and 64k tokens (the long-context side of the worst short-context shape);
# 3. 7B untied at 4k tokens, entropy off.
set -u
OUT=${OUT:-bench/out}
WORK=${WORK:-/tmp/fp32patch-round2}
mkdir -p "$OUT" "$WORK"
pack() { tar czf "$OUT/round2.tar.gz.tmp" -C "$WORK" . && mv "$OUT/round2.tar.gz.tmp" "$OUT/round2.tar.gz"; }
python - <<'PY' | tee "$WORK/machine.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("device", name)
print("card tag:", next((c for c in ("h200", "h100", "b200", "a100") if c in name.lower()), "gpu"))
PY
TAG=$(sed -n 's/^card tag: //p' "$WORK/machine.txt")
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$WORK/parts.txt"
    tail -n 30 "$WORK/$name.log"
    pack
}
part mid 330 python bench/step.py --models 1.5B-untied 3B-tied --tokens 1024 4096 16384 \
    --ways stock fp32patch --out "$WORK/step-grid-mid-$TAG.json"
part long 150 python bench/step.py --models 0.5B-tied --tokens 16384 65536 \
    --ways stock fp32patch --out "$WORK/step-grid-long-$TAG.json"
part big 100 python bench/step.py --models 7B-untied --tokens 4096 --entropy off \
    --ways stock fp32patch --out "$WORK/step-grid-7b-$TAG.json"
