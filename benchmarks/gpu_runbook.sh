#!/usr/bin/env bash
# GPU run-book: the CNN reproductions that do not fit on a CPU, in priority order, and a smoke
# test to run first on any new GPU machine.
#
# Usage (from the repository root, pflego installed or PYTHONPATH=src):
#   bash benchmarks/gpu_runbook.sh --smoke [DEVICE]    CUDA == CPU tests, the round targets, the speed benches, every algorithm 2 rounds
#   bash benchmarks/gpu_runbook.sh --list              the run-book: preset, blocks, hours
#   bash benchmarks/gpu_runbook.sh --dry-run [DEVICE]  print the run-book's commands, run nothing
#   bash benchmarks/gpu_runbook.sh [DEVICE]            run the run-book, in priority order
#   bash benchmarks/gpu_runbook.sh --only N [DEVICE]   run entry N of --list alone (1-based)
# DEVICE: cuda (default), cuda:N or cpu.
#
# Every run-book command is a `pflego reproduce` with a fixed --out: rerunning the script (or
# one of its lines) skips finished runs and resumes stopped ones from their checkpoints, so a
# machine lent for a few hours works through the list over several sittings. Results land in
# $RUNBOOK_OUT/<preset>[-<blocks>]/ (report.md, report.csv, report.png, one directory per run);
# commit them under results/ as blocks finish.
#
# Environment:
#   PFLEGO_DATA      folder with cifar-10-batches-py/, omniglot/ (default ~/.cache/pflego/data)
#   RUNBOOK_OUT      where results land (default runs/gpu)
#   RUNBOOK_JOBS     runs trained at once (default 1; small CNNs leave a GPU idle: try 2-4)
#   RUNBOOK_DEVICES  devices given to the jobs round-robin (default DEVICE), e.g. cuda:0,cuda:1
#   RUNBOOK_PYTHON   the Python that has pflego (default python)
#   RUNBOOK_SMOKE_ROUNDS  rounds of each smoke run (default 2)
#   RUNBOOK_SMOKE_BUDGET  seconds for the whole smoke test (default 0: no limit); each part also
#                    has its own limit under a budget, and what the budget leaves out is
#                    reported as skipped (a device lent for 15 minutes: 540 fits one call)
#   RUNBOOK_SMOKE_TINY=1  the smoke test sized for a CPU (about 5 minutes on 2 shared cores): the
#                    CNN bench on mnist5k, a few clients and a fraction of an epoch, and no
#                    --quick of the run-book presets
#
# Expected hours on one GPU scale the seconds per round of one or two methods of each entry,
# measured on one H100 on 2026-11-25 (results/gpu-h100/report.md), to all its methods and rounds
# (docs/gpu.md shows the arithmetic); evaluation and checkpoints come on top. pflego-cifar10's
# figure is an upper bound (measured with 15 runs sharing the GPU); FedEM's assume the full CIFAR-10.
set -euo pipefail

PY=${RUNBOOK_PYTHON:-python}
OUT=${RUNBOOK_OUT:-runs/gpu}
JOBS=${RUNBOOK_JOBS:-1}
SMOKE_ROUNDS=${RUNBOOK_SMOKE_ROUNDS:-2}
SMOKE_BUDGET=${RUNBOOK_SMOKE_BUDGET:-0}
DATA=${PFLEGO_DATA:-$HOME/.cache/pflego/data}

# The run-book, in priority order: preset | blocks (- for all) | rows (- for all) |
# estimated GPU hours | what it reproduces [| further `pflego reproduce` arguments].
RUNBOOK=(
  "pflego-omniglot|-|-|14|PFLEGO Table 2: 8 methods x 1000 rounds, conv4, 50 alphabets"
  "pgfed-cifar10|25|-|4|PGFed Tables 1-3, the 25-client block: 15 methods x 300 rounds"
  "fedem-table2|cifar10|-|15|FedEM Table 2, CIFAR-10: 7 methods x 200 rounds, MobileNet-v2"
  "fedem-table3|cifar10|-|20|FedEM Table 3, CIFAR-10: 10 methods x 200 rounds, MobileNet-v2"
  "pflego-cifar10|-|-|13.5|PFLEGO Table 1, CIFAR-10: 3 methods x 3 blocks, tuned, then 200 rounds|--tune --tune-rounds 20"
)

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
}

field() { # field INDEX ENTRY: one |-separated field of a run-book entry (never globbed)
  local parts
  IFS='|' read -r -a parts <<<"$2"
  printf "%s" "${parts[$1]:-}"
}

build_command() { # build_command ENTRY DEVICE: CMD=the `pflego reproduce` line of an entry
  local preset blocks rows out
  preset=$(field 0 "$1")
  blocks=$(field 1 "$1")
  rows=$(field 2 "$1")
  out="$OUT/$preset"
  CMD=("$PY" -m pflego reproduce "$preset" --set device="$2" --jobs "$JOBS")
  CMD+=(--devices "${RUNBOOK_DEVICES:-$2}")
  if [[ $blocks != "-" ]]; then
    CMD+=(--blocks "$blocks")
    out+="-${blocks//,/-}"
  fi
  if [[ $rows != "-" ]]; then
    CMD+=(--rows "$rows")
  fi
  CMD+=(--data-dir "$DATA" --out "$out" --quiet)
  local extra
  read -ra extra <<<"$(field 5 "$1")" # split on spaces, never globbed
  CMD+=("${extra[@]}")
}

list() {
  local n=0 entry
  printf 'n\tpreset\tblocks\trows\tGPU hours (estimate)\twhat\targuments\n'
  for entry in "${RUNBOOK[@]}"; do
    n=$((n + 1))
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$n" "$(field 0 "$entry")" "$(field 1 "$entry")" \
      "$(field 2 "$entry")" "$(field 3 "$entry")" "$(field 4 "$entry")" "$(field 5 "$entry")"
  done
}

timed() { # timed LABEL COMMAND...: run a command and say how long it took
  local label=$1 start
  shift
  start=$(date +%s)
  echo "== $label: $*"
  "$@"
  echo "== $label: done in $(($(date +%s) - start)) s"
}

SMOKE_FAILED=()
part() { # part LIMIT LABEL COMMAND...: one smoke part, within LIMIT seconds and the budget left
  local limit=$1 label=$2 begin rc=0
  shift 2
  if ((SMOKE_BUDGET > 0)); then
    local left=$((SMOKE_BUDGET - ($(date +%s) - SMOKE_START)))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
      echo "== $label: skipped, the smoke budget of $SMOKE_BUDGET s is spent"
      SMOKE_FAILED+=("$label (skipped)")
      return
    fi
  else
    limit=0 # no budget: no limit (timeout 0 never stops the command)
  fi
  begin=$(date +%s)
  echo "== $label: $*"
  timeout "$limit" "$@" || rc=$?
  echo "== $label: rc $rc in $(($(date +%s) - begin)) s"
  if ((rc == 124)); then
    SMOKE_FAILED+=("$label (out of time)")
  elif ((rc != 0)); then
    SMOKE_FAILED+=("$label (rc $rc)")
  fi
}

targets() { # targets DIR: the measured targets of issue 37, last (what the smoke test is for)
  local files=("$1"/targets-round.md "$1"/bench-against-*.md) file
  for file in "${files[@]}"; do
    [[ -f $file ]] || continue
    echo "== targets: $file"
    grep -E '^(\||##|Targets)' "$file" || true
  done
}

smoke() {
  local device=$1 cnn_dataset smoke_out="$OUT/smoke"
  SMOKE_START=$(date +%s)
  rm -rf "$smoke_out" # a smoke test starts afresh every time
  mkdir -p "$smoke_out"
  # The parts come in priority order, so that a short lease spends its minutes on what matters
  # most: correctness first, then the measurements that have never been made on that device.
  # 0. On a GPU: every algorithm's two rounds on CUDA against the CPU (float64, to 1e-8); needs
  # pytest and the source checkout's tests/.
  if [[ $device == cuda* ]]; then
    if [[ -f tests/test_fast_sim.py ]] && "$PY" -c "import pytest" 2>/dev/null; then
      local workers=()
      if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
      part 120 "every algorithm, CUDA == CPU; graph replays == eager" "$PY" -m pytest \
        -p no:cacheprovider -rs tests/test_fast_sim.py tests/test_graph_backend.py -k cuda \
        "${workers[@]}"
    else
      echo "== every algorithm, CUDA == CPU: skipped (needs pytest and a source checkout)"
      SMOKE_FAILED+=("every algorithm, CUDA == CPU (skipped: needs pytest and a source checkout)")
    fi
    # 1. Issue 37's round targets: pgfed-cifar10 block 25 (FedAvg <= 0.5 s a round at >= 10% of
    # the fp32 peak, PGFed <= 0.8 s, the block <= 30 min), the graph backend against vmap.
    local round_data=()
    if [[ ! -d $DATA/cifar-10-batches-py ]]; then # the same setting on mnist5k, smaller
      round_data=(--set dataset=mnist5k)
    fi
    part 200 "round targets, graph vs vmap on $device" "$PY" benchmarks/graph_round.py \
      --data-dir "$DATA" --device "$device" --rounds 1 "${round_data[@]}" \
      --out "$smoke_out/targets-round.md"
    # 2. pflego (auto: the graph backend on CUDA) against the conventional loop on the device,
    # with % of its matmul peak (issue 37: CNN training >= 20x, evaluation >= 10x): one model per
    # call, so that a model that runs out of time leaves the other's table; each row is printed
    # as it finishes. Three such calls of 100 s each did not finish on an H200 (results/gpu-h200).
    local model limit algorithms
    for model in pgfed-cnn mlp; do
      limit=120 algorithms=(fedavg)
      [[ $model == pgfed-cnn ]] && limit=180 algorithms=(fedavg pgfed)
      part "$limit" "pflego bench --against conventional, $model on $device" "$PY" -m pflego \
        bench --against conventional --device "$device" --data-dir "$DATA" --models "$model" \
        --algorithms "${algorithms[@]}" --against-rounds 2 --out "$smoke_out/bench-against-$model.md"
    done
    # 3. What one client's CNN step reaches there (eager, TF32, channels-last, a CUDA graph,
    # torch.compile), and whether pflego's own vmap round can be captured as a CUDA graph.
    part 150 "one CNN step and a pflego round, eager vs CUDA graph" "$PY" benchmarks/cuda_step.py \
      --models pgfed-cnn mobilenet-v2
  fi
  # 4. The CNN bench: client training speed of the PGFed CNN, FedAvg vs PGFed (Table 7's setting
  # on CIFAR-10 where its files are present, else on the built-in mnist5k).
  cnn_dataset=mnist5k
  if [[ -d $DATA/cifar-10-batches-py && ${RUNBOOK_SMOKE_TINY:-0} != 1 ]]; then
    cnn_dataset=cifar10
  fi
  local bench=(--dataset "$cnn_dataset" --data-dir "$DATA" --set device="$device")
  if [[ ${RUNBOOK_SMOKE_TINY:-0} == 1 ]]; then
    bench+=(--clients 8 --participation 0.5 --local-epochs 0.1 --methods fedavg,pgfed)
  else
    bench+=(--clients 50 --local-epochs 1 --methods fedavg,pgfed,pgfedmo,pgfed-ce)
  fi
  part 90 "CNN bench on $device ($cnn_dataset)" "$PY" benchmarks/pgfed_speed.py "${bench[@]}"
  # 5. Every registered algorithm (the leaderboard holds them all), 2 rounds, on the device.
  part 240 "every algorithm, $SMOKE_ROUNDS rounds on $device" \
    "$PY" -m pflego reproduce leaderboard-mnist --quick --offline --rounds "$SMOKE_ROUNDS" \
    --set device="$device" --out "$smoke_out/leaderboard" --quiet
  # 6. On a GPU: each run-book preset's --quick version, where its data is present, so that
  # every model and command of the run-book has run once on the device before hours are spent.
  if [[ ${RUNBOOK_SMOKE_TINY:-0} != 1 ]]; then
    local entry preset shorter extra
    for entry in "${RUNBOOK[@]}"; do
      preset=$(field 0 "$entry")
      shorter=()
      if [[ $preset == fedem-* ]]; then # MobileNet-v2, every client a full epoch: a tenth of it
        shorter=(--set local_epochs=0.1)
      fi
      read -ra extra <<<"$(field 5 "$entry")" # the entry's own arguments, at 1 tuning round
      if [[ ${#extra[@]} -gt 0 ]]; then
        extra+=(--tune-rounds 1)
      fi
      part 300 "$preset --quick on $device" "$PY" -m pflego reproduce "$preset" --quick \
        --set device="$device" "${shorter[@]}" "${extra[@]}" --data-dir "$DATA" \
        --out "$smoke_out/$preset" --quiet
    done
  fi
  targets "$smoke_out"
  local took=$(($(date +%s) - SMOKE_START))
  if ((${#SMOKE_FAILED[@]} > 0)); then
    echo "smoke test FAILED on $device in $took s: $(IFS=';'; echo "${SMOKE_FAILED[*]}"); results in $smoke_out"
    return 1
  fi
  echo "smoke test passed on $device in $took s; results in $smoke_out"
}

run_book() { # run_book DEVICE [N]: every entry in order, or entry N alone
  local device=$1 only=${2:-} n=0 entry
  for entry in "${RUNBOOK[@]}"; do
    n=$((n + 1))
    if [[ -n $only && $n != "$only" ]]; then continue; fi
    echo "== $n. $(field 4 "$entry") (estimate: $(field 3 "$entry") h on one GPU)"
    build_command "$entry" "$device"
    if [[ ${DRY_RUN:-0} == 1 ]]; then
      echo "${CMD[*]}"
    else
      timed "$(field 0 "$entry")" "${CMD[@]}"
    fi
  done
}

mode=run
only=
case ${1:-} in
  --smoke) mode=smoke; shift ;;
  --list) list; exit 0 ;;
  --dry-run) DRY_RUN=1; shift ;;
  --only) only=${2:?--only needs an entry number (see --list)}; shift 2 ;;
  -h | --help) usage; exit 0 ;;
  -*) echo "gpu_runbook.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
esac
DEVICE=${1:-cuda}
if [[ $mode == smoke ]]; then
  smoke "$DEVICE"
else
  run_book "$DEVICE" "$only"
fi
