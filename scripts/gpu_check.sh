#!/usr/bin/env bash
# The GPU check: one script, under 8 minutes on one H100 / H200, for the rare day a GPU is lent (about 15 minutes).
#
#   make gpu-wheels                      # here, once: the wheels the GPU image lacks, into .whl/ (versions: the lock)
#   bash scripts/gpu_check.sh [DIR]   # there, from the repository root; DIR defaults to $OUT, else gpu-check/
#
# The image has torch, transformers, peft and accelerate but not TRL, datasets, pydantic or math-verify: the wheels
# in .whl/ are installed to /tmp/site first where they are missing (nothing else is installed). Steps, each under its own time limit:
#   1. versions and the device;
#   2. the objective tests on CUDA (each reference / finiteness test runs on the CPU and the GPU), the version shims,
#      mixed precision and the trainer tests;
#   3. the embedded default (`trustclip train`) on CUDA, and its held-out numbers before -> after;
#   4. scripts/objective_overhead.py --device cuda --objectives ratio (the loss layer, eager and fused, against an
#      inline PPO loss; each fused objective compiles first, so the ratio objectives only);
#   5. scripts/trainer_overhead.py --device cuda (our trainer against TRL's built-in loss: step time, peak memory).
# It writes DIR/summary.md (each step's status, time and result lines) beside each step's full log. Without a GPU it
# says so and runs the CPU-capable parts (step 2 on the CPU), so the script itself is checked anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${OUT:-gpu-check}}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ! $PY -c "import trl, datasets, pydantic, math_verify" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: the wheels in .whl/ did not install" >&2; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
SUMMARY=$DIR/summary.md
echo "# GPU check, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" > "$SUMMARY"

# step NAME LIMIT_S GREP_PATTERN COMMAND...: run it under a time limit, log it, and copy its status, time and the
# log lines matching GREP_PATTERN into the summary.
step() {
    local name=$1 limit=$2 pattern=$3 start rc
    shift 3
    start=$(date +%s)
    timeout "$limit" "$@" > "$DIR/$name.log" 2>&1
    rc=$?
    { echo; echo "## $name: $([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc$([ $rc = 124 ] && echo ", past ${limit} s"))") in $(( $(date +%s) - start )) s"
      echo '```'; { grep -E "$pattern" "$DIR/$name.log" || tail -5 "$DIR/$name.log"; } | tail -40; echo '```'; } >> "$SUMMARY"
    echo "gpu_check: $name exit $rc"
}

step versions 60 . $PY -c "
import torch, transformers, peft, accelerate, trl, datasets
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
      'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)
print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA GPU')"
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$CUDA" != 1 ]; then
    echo "gpu_check: no CUDA GPU visible to torch: steps 3-5 need one; running step 2 on the CPU only" | tee -a "$SUMMARY"
fi

step tests $([ "$CUDA" = 1 ] && echo 200 || echo 1200) "passed|failed|error|Error" $PY -m pytest -q -p no:cacheprovider -x tests/test_compat.py \
    tests/test_precision.py tests/test_trainer.py tests/test_objectives.py tests/test_objective_inputs.py \
    tests/test_objective_properties.py \
    -k "not test_objective_properties or finite_loss"
[ "$CUDA" = 1 ] || exit 0

step default 180 "held-out|->|average|seconds|Error" $PY -m trustclip.cli train --output-dir "$DIR/default" --set plots=false
$PY - "$DIR/default/summary.json" >> "$SUMMARY" 2>&1 <<'EOF'
import json, sys
summary = json.load(open(sys.argv[1]))
print("\nembedded default on CUDA, summary.json:", json.dumps({k: v for k, v in summary.items() if "time" not in k})[:1500])
EOF
step objective_overhead 240 . $PY scripts/objective_overhead.py --device cuda --repeats 30 --objectives ratio
step trainer_overhead 150 "ratio|TRL|trustclip|GPU" $PY scripts/trainer_overhead.py --device cuda --steps 20 --rounds 2
echo "gpu_check: summary in $SUMMARY"
