#!/usr/bin/env bash
# The GPU measurements issues 44-46 still wait for, in one device call of at most 600 s
# (the device is lent rarely and briefly: every part has its own time limit, writes its JSON
# as it goes, and a part that runs out of time leaves what it measured).
#
#   bash bench/h200_round.sh            # on the device machine, in the repository root; $OUT: where results go
#   bash bench/h200_round.sh 2          # the second call: what the first leaves, the larger shapes
#
# What the two H100 rounds of 2026-12-05 left open (bench/RESULTS.md), most needed first:
#
# 1. host: the one cell over 1.02x in every run, 1.5B untied at 1,024 tokens (1.046-1.061x wall
#    with 0.96x of stock's device time), with each step's host CPU time and the collector's pauses
#    beside its wall time (bench/step.py records both now), then again with --gc-freeze: whether
#    the ~11-17 ms a step are host work, collections, or waiting;
# 2. pairs: TRL's pair (1.04x TRL's device time at 4,096 tokens, the one pair over), NeMo-RL's
#    (not in the second round) and SkyRL's (its own fused path, never measured) at 1,024 and 4,096
#    tokens, 24 steps a way, with the same columns;
# 3. the CUDA tests (tests/gpu), stopping at nothing;
# 4. big: 7B untied at 1,024 and 16,384 tokens (only 4,096 ran), stock against fp32patch.
#
# The second call (argument 2): 3B tied at 1,024 tokens with --gc-freeze (the cell that measured
# 1.117x and 1.005x in two runs of the same code), 1.5B untied at 4,096 (1.051x, interval
# 0.91-1.13) over 24 steps, and the head's host cost at 16 and 128 tokens.
set -u
ROUND=${1:-1}
# the device brings back at most 8 files: the parts write under $WORK, and everything is packed
# into $OUT/round$ROUND.tar.gz after every part (a part cut off by the call's limit loses nothing earlier)
OUT=${OUT:-bench/out}
WORK=${WORK:-/tmp/fp32patch-round$ROUND}
mkdir -p "$OUT" "$WORK"
pack() { tar czf "$OUT/round$ROUND.tar.gz.tmp" -C "$WORK" . && mv "$OUT/round$ROUND.tar.gz.tmp" "$OUT/round$ROUND.tar.gz"; }
python - <<'EOF' | tee "$WORK/machine.txt"
import torch, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print("device", name)
# the card names the JSON files (the lent machine may be an H100: results say which card gave them)
print("card tag:", next((c for c in ("h200", "h100", "b200", "a100") if c in name.lower()), "gpu"))
EOF
TAG=$(sed -n 's/^card tag: //p' "$WORK/machine.txt")
part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit)" | tee -a "$WORK/parts.txt"
    tail -n 25 "$WORK/$name.log"
    pack
}
if [ "$ROUND" = 2 ]; then
    part mid 200 python bench/step.py --models 3B-tied --tokens 1024 --entropy off --rounds 6 --gc-freeze \
        --ways stock fp32patch fp32patch-recompute --out "$WORK/step-3b-1k-gcfreeze-$TAG.json"
    part mid4k 200 python bench/step.py --models 1.5B-untied --tokens 4096 --entropy off --rounds 6 \
        --ways stock fp32patch fp32patch-recompute --out "$WORK/step-1.5b-4k-$TAG.json"
    part host 30 python bench/step.py --head --models 0.5B-tied --tokens 16 128 --out "$WORK/step-head-host-$TAG.json"
    exit 0
fi
part host 100 python bench/step.py --models 1.5B-untied --tokens 1024 --entropy off --rounds 6 \
    --ways stock fp32patch fp32patch-recompute --out "$WORK/step-1.5b-1k-$TAG.json"
part host-frozen 100 python bench/step.py --models 1.5B-untied --tokens 1024 --entropy off --rounds 6 --gc-freeze \
    --ways stock fp32patch fp32patch-recompute --out "$WORK/step-1.5b-1k-gcfreeze-$TAG.json"
part pairs 190 python bench/step.py --models 0.5B-tied --tokens 1024 4096 --entropy off --rounds 6 \
    --ways stock trl-chunked fp32patch-trl nemo-fused skyrl-fused fp32patch-recompute --out "$WORK/step-pairs-$TAG.json"
part gpu-tests 110 python -m pytest -q -p no:cacheprovider tests/gpu
part big 90 python bench/step.py --models 7B-untied --tokens 1024 16384 --entropy off \
    --ways stock fp32patch --out "$WORK/step-7b-$TAG.json"
