#!/usr/bin/env bash
# The GPU checks in one run: CUDA tests, the Triton kernels compiled, codec speed next to a
# device copy, and the pipeline's throughput with GPU ranks beside data parallelism.
#
# Usage:  bash benchmarks/gpu_suite.sh OUT_DIR [STEP ...]
#   STEPs (default: all, in this order): env cuda_tests suite retry codec_speed codec_profile pipeline lm
#   (suite: every test but the CUDA modules, one line per test, so that a run cut short still names its
#   failures; retry: those failures again, one process, with their tracebacks)
#   GPU=cpu STEPS_MAX=2 bash benchmarks/gpu_suite.sh /tmp/dry pipeline   -- a dry run on CPU
#   GPU=cpu STEPS_MAX=2 LM_CONFIG=small-llama bash benchmarks/gpu_suite.sh /tmp/dry lm
# On an H100 (2026-11-25): env + cuda_tests + codec_speed took 6.5 min, codec_profile 26 s; pipeline's
# 14 runs need more than its 540 s at STEPS_MAX=15 (each run starts its processes and CUDA anew; the
# last one, MiniLM DDP, was cut): give pipeline a call of its own, with STEPS_MAX=10.
# On an H200 (2026-11-27): a machine's start ~35 s; codec_profile 17-32 s; lm at STEPS_MAX=10 135 s;
# cuda_tests with WORKERS=16 more than 80 s (94 of 98 done); suite with WORKERS=14 more than 270 s
# (about 97%), without the CUDA modules at WORKERS=16 more than 150 s (about 93%). With 15 device-minutes
# a session, a whole suite and the CUDA tests do not fit beside anything else: pick.
#
# For a machine without network: put in CARRY (default .gpu, git-ignored) what it lacks --
#   CARRY/whl/*.whl      wheels of the missing packages (installed with --no-deps into /tmp/site)
#   CARRY/data.tar.xz    data/glue/... and data/cifar10-images/{train,test}/... (unpacked as ../shared/data
#                        when that folder is absent: the tests and benchmarks read it there)
#   CARRY/minilm/        all-MiniLM-L6-v2 as a local model directory (read through $MINILM_DIR)
#   CARRY/so/_codes.so, _rows.so   the compiled CPU kernels built here (plain C libraries loaded with ctypes, so
#                        any Python finds them under these names), where the package's own were not built there
# Every step runs under its own time limit; a failing step is logged and the next one runs.
# OUT_DIR/summary.txt lists each step's exit status and seconds; OUT_DIR/logs.tar.gz holds
# every log (re-made after each step, so a run cut short still returns what it did).
set -u
OUT=${1:?usage: gpu_suite.sh OUT_DIR [STEP ...]}
shift
STEPS=${*:-env cuda_tests suite retry codec_speed codec_profile pipeline lm}
export GPU=${GPU:-cuda:0} STEPS_MAX=${STEPS_MAX:-20} LM_CONFIG=${LM_CONFIG:-benchmarks/configs/llama-768x12}
CARRY=${CARRY:-.gpu}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT/logs"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$CARRY"/whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ ! -d ../shared/data ] && [ -f "$CARRY/data.tar.xz" ]; then
    mkdir -p ../shared && tar -xJf "$CARRY/data.tar.xz" -C ../shared
fi
for f in "$CARRY"/so/*.so; do
    [ -f "$f" ] && ! ls dgpipe/compression/kernels/"$(basename "$f" .so)".*so >/dev/null 2>&1 &&
        cp "$f" dgpipe/compression/kernels/
done
[ -d "$CARRY/minilm" ] && export MINILM_DIR="$ROOT/$CARRY/minilm"
export MODEL=${MINILM_DIR:-sentence-transformers/all-MiniLM-L6-v2}

step() {  # step NAME SECONDS COMMAND...: run it, log it, keep going
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name: $*" | tee "$OUT/logs/$name.log"
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/logs/$name.log" 2>&1
    rc=$?
    printf '%-14s rc=%-4s %5ss\n' "$name" "$rc" "$(($(date +%s) - start))" | tee -a "$OUT/summary.txt"
    tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs
}

pipeline_runs() {  # samples/s of the main jobs, GPU ranks, one setting after another
    local logs=$OUT/logs/runs vision=(python3 test_vision_dgpipe.py --data-dir ../shared/data/cifar10-images
        --train-subset 4000 --eval-subset 500 --batch-size 128 --chunk 4 --epochs 1 --max-steps "$STEPS_MAX" --no-progress
        --num-workers 3 --timeout 120)
    local nlp=(python3 test_nlp_dgpipe.py --task sst2 --data-dir ../shared/data/glue --model "$MODEL"
        --train-subset 1280 --eval-subset 256 --batch-size 32 --chunk 4 --max-length 64 --epochs 1 --max-steps "$STEPS_MAX"
        --no-progress --timeout 120)
    local low_vision=(--sortquant --quant 3 --split 1)
    local low_nlp=(--codec codebook --codec-opt bits=2 --codec-opt group=token --codec-opt rotate=hadamard
        --grad-codec codebook --grad-codec-opt bits=4 --grad-codec-opt group=token --grad-codec-opt rotate=hadamard)
    mkdir -p "$logs"
    for devices in "cpu,$GPU" "$GPU,$GPU"; do
        local d=${devices//[:,]/_}
        "${vision[@]}" --devices "$devices" --log "$logs/vision_${d}_none.jsonl"
        "${vision[@]}" --devices "$devices" --quant 8 --log "$logs/vision_${d}_quant8.jsonl"
        "${vision[@]}" --devices "$devices" "${low_vision[@]}" --log "$logs/vision_${d}_sortquant3+1.jsonl"
        "${nlp[@]}" --devices "$devices" --log "$logs/nlp_${d}_none.jsonl"
        "${nlp[@]}" --devices "$devices" --quant 8 --log "$logs/nlp_${d}_quant8.jsonl"
        "${nlp[@]}" --devices "$devices" "${low_nlp[@]}" --log "$logs/nlp_${d}_codebook2+4.jsonl"
    done
    "${vision[@]}" --devices "$GPU,$GPU" --mode dataparallel --log "$logs/vision_ddp.jsonl"
    "${nlp[@]}" --devices "$GPU,$GPU" --mode dataparallel --log "$logs/nlp_ddp.jsonl"
    python3 - "$logs" <<'EOF'
import json, pathlib, sys
print(f"{'run':44} {'samples/s':>10} {'wire/raw':>9}")
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    s = next((r for r in rows if r.get("event") == "summary"), None)
    if s is None:
        print(f"{path.stem:44} {'(no summary)':>10}")
        continue
    ratio = s["wire_bytes"] / s["raw_bytes"] if s.get("raw_bytes") else float("nan")
    print(f"{path.stem:44} {s['samples_per_s']:10.1f} {ratio:9.3f}")
EOF
}

lm_runs() {  # the decoder LM job: none, quant 8 and codebook 4 in the same processes, per placement
    local logs=$OUT/logs/lm
    mkdir -p "$logs"
    for devices in "cpu,$GPU" "$GPU,$GPU"; do
        python3 test_lm_dgpipe.py --data-dir ../shared/data/text/wiki-excerpt --model-config "$LM_CONFIG" \
            --block-length 128 --batch-size 16 --chunk 4 --max-steps "$STEPS_MAX" --eval-subset 64 --no-progress \
            --timeout 120 --devices "$devices" --quant 8 --compare-to none,codebook4 \
            --log-file "$logs/lm_${devices//[:,]/_}.jsonl"
    done
}

for s in $STEPS; do
    case $s in
    env) step env 60 bash -c 'nvidia-smi; python3 -c "import sys, torch, transformers; print(sys.version); \
print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else \"\", \
transformers.__version__); import triton; print(\"triton\", triton.__version__)"; nproc' ;;
    cuda_tests) step cuda_tests ${CUDA_S:-280} python3 -m pytest -v -rfE -p no:cacheprovider --timeout 150 \
        -n ${WORKERS:-8} ${PYTEST_ARGS:-} tests/test_cuda.py tests/test_fused_triton.py ;;
    suite) step suite ${SUITE_S:-360} python3 -m pytest -v --tb=short -rfE -p no:cacheprovider -n ${WORKERS:-8} \
        --timeout 150 --ignore=tests/test_cuda.py --ignore=tests/test_fused_triton.py tests ;;
    retry) grep -hoE "(FAILED|ERROR) tests/[^ ]+" "$OUT"/logs/suite.log "$OUT"/logs/cuda_tests.log 2>/dev/null |
        awk '{print $2}' | sort -u | head -40 >"$OUT/failed.txt"
        if [ -s "$OUT/failed.txt" ]; then
            step retry ${RETRY_S:-120} bash -c "xargs -a '$OUT/failed.txt' python3 -m pytest -q --tb=short -p no:cacheprovider \
                --timeout 60"
        fi ;;
    codec_speed) step codec_speed 240 python3 benchmarks/codec_speed.py --device cuda --reps 5 --threads 0 --real --messages ;;
    codec_profile) step codec_profile ${PROFILE_S:-120} python3 benchmarks/codec_profile.py ;;
    pipeline) export -f pipeline_runs; step pipeline 540 bash -c pipeline_runs ;;
    lm) export -f lm_runs; step lm ${LM_S:-300} bash -c lm_runs ;;
    *) echo "unknown step: $s" >&2; exit 2 ;;
    esac
done
