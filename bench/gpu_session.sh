#!/bin/bash
# Every GPU measurement of reelflow in one go, for a machine with torch and CUDA but no internet
# and a few minutes of card time. Run from the repository root:
#
#   bash bench/gpu_session.sh [WHEELS] [OUT] [BUDGET_S]
#
# WHEELS: a folder with the wheels the machine lacks (av, hydra-core, omegaconf, antlr4,
#         transformers) and a setup.sh that installs them and sets PYTHONPATH (default .gpu/wheels;
#         skipped when absent, for a machine that has them; .gpu/ is ignored by git, so a remote call
#         must carry it);
# OUT:    where the results go (default $OUT, else outputs/gpu/<time>);
# BUDGET_S: seconds for the whole script (default 540): each part gets its own limit, cut to what
#         is left, and a part with under 30 s left is skipped and says so.
#
# Parts, in the order they run:
#   exactness  tests/models/test_prefix_attention.py (the Triton kernels in bf16 against float64
#              attention), tests/speculative/test_captured_head.py (the Sparrow head's tree and step
#              replayed against EAGLE-2 node by node and the eager head), tests/models/test_graph_capture.py
#              (two threads capturing at once) and tests/models/test_captured_step.py:
#              CUDA graphs against the eager lean path in bf16 (toy target and random 7B), printing near
#              ties and the largest logit difference;
#   kernel     bench.step_anatomy --kernel-sweep on the 7B shape at 8K and 32K: the prefix-attention kernel's
#              launch settings (programs per multiprocessor, keys per iteration, warps, rows per program);
#              the fastest is exported as REELFLOW_PREFIX_KERNEL for the parts after it (logged, and
#              recorded in realsize.json's prefix_kernel); not in the default set (the defaults won on
#              2026-11-28; sweep again after a change to the kernels);
#   realsize   bench_realsize on the Qwen2.5-VL-7B shape at 8K and 32K video tokens: the captured step
#              (inductor's kernels, over the weights as loaded and packed: q, k, v in one product, gate and
#              up in one) against its floor and transformers' static cache + torch.compile, verifications
#              and Sparrow's round (on the packed path; the head's tree over every token and over a
#              32,768-token draft vocabulary);
#   toy        bench_sparrow on the GPU with captured steps: ar, sparrow, vanilla_sd, parallelvlm, each with the
#              draft in the target's process (resources=gpu) and in one of its own (resources=gpu_split),
#              then bench.same_tokens: every answer against ar's;
#   rounds     bench.engine_vs_loop --profile: the toy's Sparrow rounds through the engine and as a plain
#              loop, and torch.profiler's tables of the loop's rounds (host-bound on a GPU: where they go);
#   anatomy    bench.step_anatomy on the 7B shape at 8K and 32K: the step's parts (weight products as loaded
#              and packed, attention by path, norms) each captured alone, against the whole captured step
#              (eager operations, inductor's kernels, inductor's over packed weights) and the floor;
#   figure5    QuickVideo's Figure 5 at real size (bench_quickvideo_gpu, ~5 min on an H100), with the
#              vision tower's and the group prefill's FLOPs as shares of the card's bf16 matrix rate
#              (encode_share, prefill_share, matrix_tflops): not in the default set; run it in a call
#              of its own with PARTS=figure5;
#   nvdec      decoding on the GPU (torchcodec's CUDA device) against QuickCodec on the CPU cores, on
#              the 10-min benchmark video, and NVDEC's frames against PyAV's (PARTS=nvdec; it needs
#              torchcodec's CUDA build and FFmpeg's libraries on the machine, and says so without them).
# PARTS (environment): which parts run, always in the order above (default "exactness realsize toy rounds
#   anatomy"). On an H200 (2026-11-28) exactness took 91 s, kernel 78 s, anatomy 55 s, realsize 146 s (before
#   the draft vocabulary's tree) and toy 103 s (18 jobs; 24 with parallelvlm), plus ~20 s installing the
#   wheels: the default set is about 500 s of one 540-s call, and a machine's start costs another 1-2
#   minutes of card time; figure5 (~5 min) and nvdec need a call of their own, or take the place of parts
#   the session does not need.
# Writes OUT/log.txt (everything printed, the rounds' profile too), anatomy.md, realsize.json / .md,
# toy_report.md, toy_same_tokens.md, kernel_sweep.md, kernel_choice.txt, figure5.md / .csv, nvdec.md;
# bench_realsize writes after each context, so a part cut short keeps what it measured. (Some remote
# runners bring back 8 files at most: the default set writes 6.)
set -u
WHEELS=${1:-.gpu/wheels}
OUT=${2:-${OUT:-outputs/gpu/$(date +%F_%H-%M-%S)}}
BUDGET=${3:-540}
PARTS=${PARTS:-exactness realsize toy rounds anatomy}
TOY_RESOURCES=${TOY_RESOURCES:-gpu,gpu_split}   # the toy part's resources sweep (gpu alone: half the runs)
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
start=$(date +%s)
mkdir -p "$OUT"
log="$OUT/log.txt"
left() { echo $(( BUDGET - ($(date +%s) - start) )); }

part() {        # part NAME SECONDS COMMAND...: run COMMAND within min(SECONDS, what is left)
    local name=$1 limit=$2 l rc t0
    shift 2
    wanted "$name" || return 0
    l=$(left)
    (( limit > l )) && limit=$l
    if (( limit < 30 )); then
        echo "== $name: skipped, $l s of the budget left" | tee -a "$log"
        return
    fi
    echo "== $name (limit ${limit} s): $*" | tee -a "$log"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s" | tee -a "$log"
}

if [ -f "$WHEELS/setup.sh" ]; then
    # shellcheck disable=SC1091
    . "$WHEELS/setup.sh" >> "$log" 2>&1 || { echo "installing the wheels failed (see $log)"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$log" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$log" 2>&1

# only the tests that need the card (their files' CPU tests run in CI, and would spend its time here)
part exactness 220 python3 -m pytest -q -s -p no:cacheprovider tests/models/test_prefix_attention.py \
    tests/speculative/test_captured_head.py tests/models/test_captured_step.py tests/models/test_graph_capture.py \
    -k "cuda or captured_graphs or on_a_gpu"
part kernel 150 python3 -m bench.step_anatomy random:qwen2.5-vl-7b --contexts 8192 32768 --kernel-sweep --out "$OUT"
# the sweep's choice, this call's or (a call that skips the sweep) an earlier call's on this machine, kept
# under outputs/ (ignored by git: it stays on a warm machine between calls, where OUT may not)
if [ -f "$OUT/kernel_choice.txt" ]; then
    mkdir -p outputs/gpu && cp "$OUT/kernel_choice.txt" outputs/gpu/kernel_choice.txt
fi
if [ -s outputs/gpu/kernel_choice.txt ] && [ -z "${REELFLOW_PREFIX_KERNEL:-}" ]; then
    export REELFLOW_PREFIX_KERNEL=$(cat outputs/gpu/kernel_choice.txt)
    echo "== the prefix-attention kernel from here on: REELFLOW_PREFIX_KERNEL=$REELFLOW_PREFIX_KERNEL" | tee -a "$log"
fi

tmp=$(mktemp -d)
part realsize 300 python3 -m bench.bench_realsize --models random:qwen2.5-vl-7b --contexts 8192 32768 \
    --paths reduce-overhead reduce-overhead+packed --sparrow --head-vocab 32768 --peer --steps 32 --repeats 2 \
    --out "$tmp/realsize"
[ -f "$tmp/realsize/results.json" ] && cp "$tmp/realsize/results.json" "$OUT/realsize.json"
[ -f "$tmp/realsize/table.md" ] && cp "$tmp/realsize/table.md" "$OUT/realsize.md"

part toy 300 python3 -m run -m +experiment=bench_sparrow resources="$TOY_RESOURCES" method=ar,sparrow,vanilla_sd,parallelvlm \
    model.target.compile=cudagraph model.draft.compile=cudagraph hydra.sweep.dir="$tmp/toy"
[ -f "$tmp/toy/report.md" ] && cp "$tmp/toy/report.md" "$OUT/toy_report.md"
# lossless: each method's answers against ar's of the same settings, token for token (also after a failed job)
if wanted toy && [ -d "$tmp/toy" ]; then
    python3 -m bench.same_tokens "$tmp/toy" --out "$OUT/toy_same_tokens.md" >> "$log" 2>&1
    echo "== toy: answers identical to ar's: exit $?" | tee -a "$log"
fi
# where a host-bound round's time goes: the toy's Sparrow rounds as a plain loop under torch.profiler (into the log)
part rounds 120 python3 -m bench.engine_vs_loop --method sparrow --device cuda --videos 2 --rounds 3 --profile -- \
    resources=gpu model.target.compile=cudagraph
part anatomy 160 python3 -m bench.step_anatomy random:qwen2.5-vl-7b --contexts 8192 32768 --out "$OUT"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True part figure5 480 python3 -m run -m +experiment=bench_quickvideo_gpu \
    hydra.sweep.dir="$tmp/figure5"
[ -f "$tmp/figure5/report.md" ] && cp "$tmp/figure5/report.md" "$OUT/figure5.md"
[ -f "$tmp/figure5/report.csv" ] && cp "$tmp/figure5/report.csv" "$OUT/figure5.csv"
part nvdec 60 python3 -m pytest -q -p no:cacheprovider tests/stages/test_decode.py -k nvdec
part nvdec 400 python3 -m run -m +experiment=bench_decode decode_case=len10 \
    stage/decode@graph.nodes.decode.stage=quickcodec,torchcodec_cuda graph.nodes.decode.stage.workers=16 \
    hydra.sweep.dir="$tmp/nvdec"
[ -f "$tmp/nvdec/report.md" ] && cp "$tmp/nvdec/report.md" "$OUT/nvdec.md"
echo "== done after $(( $(date +%s) - start )) s; results in $OUT" | tee -a "$log"
