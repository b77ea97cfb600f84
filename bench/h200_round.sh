#!/usr/bin/env bash
# The GPU measurements issues 44-46 still wait for, in one device call of at most 600 s
# (the device is lent rarely and briefly: every part has its own time limit, writes its JSON
# as it goes, and a part that runs out of time leaves what it measured).
#
#   bash bench/h200_round.sh            # on the device machine, in the repository root; $OUT: where results go
#   bash bench/h200_round.sh 2          # the second call: the larger shapes and longer contexts
#
# In the order of what the open issues need most (a call cut short keeps the parts before):
# 3, 1, 4, 2, 5, 2b.
#
# 1. the CUDA tests (tests/gpu), stopping at nothing (-x would hide the tests after a failure);
# 2. the log-prob head alone per tile with the one-tile kept logits (bench/step.py --head) at the
#    0.5B and 1.5B hidden sizes, 1k-16k tokens (about 160 s; the 3B and 7B sizes, which the last
#    sweep had, are the next call's), then the rule and KEEP_LOGITS_BYTES that sweep asks for
#    (--rule);
# 2b. the head at 16 and 128 tokens, where its kernels take microseconds: each way's time is then
#    its host cost (launches, Python), what a host-bound short step pays (on the CPU path the
#    chunked head dispatches 321 aten ops a call against stock's 78, mostly the CPU emulation of
#    fp32out's backward; the CUDA path is another, and this measures it);
# 3. the whole step at short context where the issue found the worst ratio (0.5B tied, 4k tokens;
#    1k and 4k ran on an H100 on 2026-12-05: bench/RESULTS.md; this call measures what changed
#    after it, TRL's and Prime-RL's tile budgets and the backward's host work per block, with
#    twice the rounds for narrower wall intervals), stock against fp32patch and the stacks' fused
#    paths against what replaces each
#    (verl's and NeMo-RL's: the recomputing way, with choose_tiles' wider short blocks; TRL's: its
#    own tile shape; Prime-RL's), with the
#    device's busy time per step beside the wall time (such a step is host-bound); the JSON is
#    written after every cell, and the next call takes 1.5B and 3B;
# 4. Prime-RL's bf16 FusedOutputLinear shape against fp32patch's head (bench/prime_rl_head.py),
#    its 8192-token shape (the 32768 one is the next call's: 80 s did not finish both, 2026-12-05);
# 5. where a host-bound step's time goes (torch.profiler, 0.5B tied at 4k): the H100 round of
#    2026-12-05 found the recomputing way ~4% slower in wall time than stock with less device
#    time, and each vocabulary block costing ~0.7 ms of host time at 16 tokens.
#
# The second call (argument 2): the whole step, stock against fp32patch, over the larger shapes
# and longer contexts issue 44 asks for: 1.5B untied and 3B tied at 1k, 4k and 16k tokens
# (entropy off and on), 0.5B tied at 16k and 64k, 7B untied at 4k (entropy off).
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
    part mid 330 python bench/step.py --models 1.5B-untied 3B-tied --tokens 1024 4096 16384 \
        --ways stock fp32patch --out "$WORK/step-grid-mid-$TAG.json"
    part long 150 python bench/step.py --models 0.5B-tied --tokens 16384 65536 \
        --ways stock fp32patch --out "$WORK/step-grid-long-$TAG.json"
    part big 100 python bench/step.py --models 7B-untied --tokens 4096 --entropy off \
        --ways stock fp32patch --out "$WORK/step-grid-7b-$TAG.json"
    exit 0
fi
part step 160 python bench/step.py --models 0.5B-tied --tokens 4096 --entropy off --rounds 6 \
    --ways stock fp32patch fp32patch-recompute verl-fused trl-chunked fp32patch-trl prime-rl-fused fp32patch-prime-rl \
    --out "$WORK/step-grid-$TAG.json"
part gpu-tests 110 python -m pytest -q -p no:cacheprovider tests/gpu
part prime-rl-head 80 python bench/prime_rl_head.py --tokens 8192 --out "$WORK/prime-rl-head-$TAG.json"
part head 190 python bench/step.py --head --models 0.5B-tied 1.5B-untied --tokens 1024 2048 4096 8192 16384 \
    --out "$WORK/step-head-$TAG.json"
part rule 15 python bench/step.py --rule "$WORK/step-head-$TAG.json"
part profile 45 python bench/step.py --models 0.5B-tied --tokens 4096 --entropy off \
    --ways stock fp32patch fp32patch-recompute verl-fused --profile --profile-dir "$WORK/profiles"
part host 30 python bench/step.py --head --models 0.5B-tied --tokens 16 128 --out "$WORK/step-head-host-$TAG.json"
