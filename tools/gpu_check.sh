#!/usr/bin/env bash
# The one-command device check: on a bare, offline GPU machine (python3 with torch,
# torchvision, timm, pluggy, pytest, tqdm, matplotlib; no omegaconf, no kornia) it
#   1. checks its prerequisites and says in one line what is missing (exit 2),
#   2. installs the carried wheels (`make gpu-wheels`, folder .gpu-wheels) and this
#      checkout's engine and plugins into a temporary target, with no network,
#   3. runs the tests marked `cuda`,
#   4. trains ResNet-50 (bf16, channels-last, 176 px crops) from JPEG shards against the
#      same steps on a batch already on the device, data.decode=cpu and gpu (issue 41),
#   5. only with GPU_CHECK_PAIR=1: the time-to-accuracy pair scaled for a GPU, the
#      CIFAR-stem ResNet-18 at full width, batch 512, 25k synthetic images;
#      resnet18_baseline (fp32) against resnet18_fast + bf16 + channels-last + torch.compile,
#   6. times the pair's network in a hand-written loop and through the Trainer (MFU's reference),
#   7. times data.decode=gpu (nvJPEG) against cpu on 176 px crops of photo-sized JPEGs,
#   8. writes gpu_check.json and gpu_check.txt (and the logs) to $OUT.
# Every step has a time limit; 540 s together without the pair, which adds 220 s (run it
# apart: GPU_CHECK_PAIR=1 GPU_CHECK_SKIP="cuda_tests pipeline decode").
#
#   bash tools/gpu_check.sh             on the GPU machine (python3, or $PYTHON)
#   bash tools/gpu_check.sh --dry-run   here: the same steps at toy size on the CPU
#                                            (.venv/bin/python; the CUDA tests skip)
# docs/gpu.md says how to prepare, run and read it.
set -u
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg'; allowed: --dry-run, --help" >&2; exit 2 ;;
    esac
done

WHEELS=${GPU_WHEELS:-.gpu-wheels}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ $DRY == 1 && -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null 2>&1 || { echo "gpu_check: missing: $PYTHON (set PYTHON)" >&2; exit 2; }
DRYFLAG=(); [[ $DRY == 1 ]] && DRYFLAG=(--dry-run)

# GPU_CHECK_SKIP="cuda_tests fast": steps to leave out (the test suite's dry run leaves
# out the CUDA tests, which the suite itself collects and skips).
SKIP=" ${GPU_CHECK_SKIP:-} "

# step NAME SECONDS COMMAND...: run with a time limit (SIGTERM: a training run ends
# after its batch with a summary), log to WORK/NAME.log, record exit and seconds.
step() {
    local name=$1 limit=$2; shift 2
    local started=$SECONDS rc
    if [[ "$SKIP" == *" $name "* ]]; then
        echo "gpu_check: $name left out (GPU_CHECK_SKIP, or the pair without GPU_CHECK_PAIR=1)"
        printf '%s\t%s\t%s\n' "$name" skipped 0 >>"$WORK/steps.tsv"
        return 0
    fi
    echo "gpu_check: $name (limit ${limit} s)"
    # Each line of the log led by its second: where a step's time goes shows there.
    timeout --signal=TERM --kill-after=10 "$limit" "$@" 2>&1 | "$PYTHON" -u tools/gpu_check.py stamp >"$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >>"$WORK/steps.tsv"
    if [[ $rc != 0 ]]; then
        echo "gpu_check: $name exited $rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (time limit)'); its last lines:"
        tail -n 15 "$WORK/$name.log" | sed 's/^/    /'
    fi
    return $rc
}

# 1. Prerequisites, one line either way.
"$PYTHON" tools/gpu_check.py prereq --wheels "$WHEELS" "${DRYFLAG[@]}" || exit 2

WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
if [[ -z "${OUT:-}" ]]; then OUT="$WORK/out"; fi
mkdir -p "$OUT"
SITE="$WORK/site"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME="$WORK/cache" MPLBACKEND=Agg
# Inductor's and Triton's caches in the work folder: a fresh machine has none anyway.
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton"

# 2. Install, offline: the carried wheels, then the engine and plugins (no dependencies).
install() {
    local wheels=()
    if [[ -d "$WHEELS" ]]; then
        if [[ $DRY == 1 ]]; then
            # This machine's Python may not be the device's 3.12: only the pure wheels fit.
            mapfile -t wheels < <(ls "$WHEELS"/*-none-any.whl 2>/dev/null)
        else
            mapfile -t wheels < <(ls "$WHEELS"/*.whl 2>/dev/null)
        fi
    fi
    if ((${#wheels[@]})); then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
            --target "$SITE" "${wheels[@]}" || return 1
        echo "installed ${#wheels[@]} wheels from $WHEELS"
    else
        echo "no wheels to install (this Python has what they carry)"
    fi
    "$PYTHON" tools/gpu_check.py site "$SITE" || return 1
    # Here every algorithm is imported; the dry run only finds their modules (seconds).
    PYTHONPATH="$SITE" "$PYTHON" tools/gpu_check.py verify "$SITE" $([[ $DRY == 1 ]] && echo --no-load)
}
export -f install
export WHEELS DRY PYTHON SITE
step install 40 bash -c install || { echo "gpu_check: the installation failed; see $WORK/install.log" >&2; cp "$WORK/install.log" "$OUT/" 2>/dev/null; exit 1; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# 3. The CUDA tests (skipped, with the reason, on a machine without CUDA). Quick files
# first, and the ones that start processes or compile last: if the limit cuts the step
# short, the log still holds every test that ran.
# GPU_CHECK_TESTS="EXPR": only the CUDA tests that pytest's -k EXPR selects (a rerun).
SELECT=(); [[ -n "${GPU_CHECK_TESTS:-}" ]] && SELECT=(-k "$GPU_CHECK_TESTS")
step cuda_tests 150 "$PYTHON" -m pytest -v -m cuda -rs -p no:cacheprovider --junitxml="$WORK/cuda_tests.xml" "${SELECT[@]}" \
    tests/cuda/test_cuda_precision.py tests/algorithms/test_mixed_precision.py \
    tests/algorithms/test_matmul_precision.py tests/cuda/test_cuda_data.py \
    tests/cuda/test_cuda_decode.py tests/cuda/test_cuda_compile_memory.py tests/cuda/test_cuda_distributed.py \
    tests/algorithms/test_sync_batchnorm.py

# 4. The input pipeline (issue 41): ResNet-50 in bf16 and channels-last on 176 px random
# resized crops of 20,000 photo-sized JPEGs in WebDataset shards, every core a worker,
# decode=cpu and decode=gpu, against the same steps on a batch already on the device.
if [[ $DRY == 1 ]]; then
    PIPELINE=(--dry-run --threads 1)
else
    PIPELINE=(--images 20000 --workers "$(nproc)" --size 176 --batch 256 --steps 150 --warmup 30)
fi
step pipeline 200 "$PYTHON" benchmarks/bench_pipeline.py "${PIPELINE[@]}"

# 5. The time-to-accuracy pair (GPU_CHECK_PAIR=1; shown on an H100 in November): fp32
# baseline, then the fast recipe with bf16, channels-last and torch.compile. Each run
# in its own process and time limit.
[[ "${GPU_CHECK_PAIR:-0}" == 1 ]] || SKIP="$SKIP baseline fast "
if [[ $DRY == 1 ]]; then
    SCALE=(model.kwargs.channels=[8,16,32,64] model.kwargs.stem_width=8 data.image_size=16
           data.train_size=64 data.val_size=32 data.batch_size=32 trainer.device=cpu trainer.threads=1
           trainer.peak_tflops=1)
    BASE_EPOCHS=1 FAST_EPOCHS=1 FAST_EXTRA=(algorithms.torch_compile.backend=eager)
else
    SCALE=(model.kwargs.channels=[64,128,256,512] model.kwargs.stem_width=64 data.image_size=32
           data.train_size=25000 data.val_size=5000 data.batch_size=512 data.num_workers=4
           data.persistent_workers=true trainer.device=cuda)
    BASE_EPOCHS=${GPU_CHECK_BASE_EPOCHS:-16} FAST_EPOCHS=${GPU_CHECK_FAST_EPOCHS:-8} FAST_EXTRA=()
fi
COMMON=("${SCALE[@]}" trainer.progress_bar=false trainer.checkpoint_interval=null)
# GPU_CHECK_COMPILE=0: the fast run without torch_compile (its compilation is paid
# inside the run's time, which a short run may not win back).
COMPILE=(--algorithms torch_compile)
if [[ "${GPU_CHECK_COMPILE:-1}" == 0 ]]; then COMPILE=() FAST_EXTRA=(); fi
# `gpu_check.py train` is `slipstream train` that stamps its time outside the run and,
# 8 s before the limit, writes every thread's stack to the log.
step baseline 100 "$PYTHON" tools/gpu_check.py train --dump-after 92 --recipe resnet18_baseline "${COMMON[@]}" \
    trainer.max_duration="${BASE_EPOCHS}ep" trainer.run_dir="$WORK/baseline"
step fast 120 "$PYTHON" tools/gpu_check.py train --dump-after 112 --recipe resnet18_fast "${COMPILE[@]}" "${COMMON[@]}" \
    algorithms.mixed_precision.dtype=bf16 "${FAST_EXTRA[@]}" \
    trainer.max_duration="${FAST_EPOCHS}ep" trainer.run_dir="$WORK/fast"

# 6. The pair's network in a hand-written loop, and through the Trainer, on random data
# already on the device: what MFU the model reaches here without the engine, fp32 and
# bf16, NCHW and channels-last (the reference the pair's MFU is read against).
if [[ $DRY == 1 ]]; then
    PLAIN=(--quick --threads 1 --batch 8)
else
    PLAIN=(--device cuda --width 64 --batch 512 --sizes 32 --steps 20 --warmup 5 --repeats 2)
fi
step plain_loop 60 "$PYTHON" benchmarks/bench_plain_loop.py "${PLAIN[@]}" --engine

# 7. JPEG decoding: the imagefolder loader's 176 px random resized crops of 500x375
# photos (quality 90), data.decode=gpu (the workers read bytes, nvJPEG decodes each
# batch on the device) against cpu (the workers' PIL decode), every core a worker.
if [[ $DRY == 1 ]]; then
    DECODE=(--dry-run --threads 1)
else
    DECODE=(--images 4096 --workers "$(nproc)" --size 176 --batch 256 --repeats 2)
fi
step decode 90 "$PYTHON" benchmarks/bench_decode.py --what decode "${DECODE[@]}"

# 8. The report, and the logs beside it (at most 8 files come back from $OUT: the pair's
# two logs go as one).
"$PYTHON" tools/gpu_check.py report --out "$OUT" --work "$WORK" "${DRYFLAG[@]}" || exit 1
for f in install cuda_tests pipeline plain_loop; do [[ -f "$WORK/$f.log" ]] && cp "$WORK/$f.log" "$OUT/$f.log"; done
for f in baseline fast; do [[ -f "$WORK/$f.log" ]] && { echo "== $f"; cat "$WORK/$f.log"; }; done >"$WORK/pair.log"
[[ -s "$WORK/pair.log" ]] && cp "$WORK/pair.log" "$OUT/pair.log"
[[ -f "$WORK/cuda_tests.xml" ]] && cp "$WORK/cuda_tests.xml" "$OUT/"
echo "gpu_check: report in $OUT/gpu_check.txt and $OUT/gpu_check.json (work files in $WORK)"
failed=$(awk -F'\t' '$2 != 0 && $2 != "skipped"' "$WORK/steps.tsv" | wc -l)
[[ $failed == 0 ]]
