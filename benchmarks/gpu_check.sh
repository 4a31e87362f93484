#!/usr/bin/env bash
# Issue 20's GPU check in one call of about 9-11 minutes (docs/benchmarks.md, "Compiled decoding on a GPU"): the
# sampling law through the compiled path (tests/test_gpu_law.py, at most LAW_LIMIT seconds, default 200), the
# ensemble's compiled merge against its eager tokens (at most ENSEMBLE_LIMIT, default 150), then the methods
# ONLY names, in that order (default: what the next run has to settle first: the chained step of EAGLE-3, the SSM
# and Medusa against their split steps now that drafters' own compiled steps run under CUDA graphs, whether each
# keeps its CUDA graphs, then the oracle and HF's static compile), and a profile of the verify forward.
# Run from the repository root on a machine with a CUDA GPU:
#
#     OUT=results_dir bash benchmarks/gpu_check.sh                 # writes $OUT/gpu_compiled.json and its log
#     OUT=/tmp/gc EXTRA="--tiny --no-hf-compile" bash benchmarks/gpu_check.sh   # a smoke test on any machine
#
# Wheels in .whl/ (a machine that cannot reach a package index: e.g. the transformers the results were made with)
# are installed into /tmp/site first. LIMIT caps the benchmark (seconds, default 350); no warm-up starts after
# DEADLINE (default 220), so the timed rounds still run within LIMIT. Partial results are saved after every round.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# The sampling law through the compiled path on the GPU, split and fused (tests/test_gpu_law.py): what a GPU needs
# before it fuses sampled steps by default (decode.decoder.fused_default).
timeout "${LAW_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_law.py -k "not ensembles" \
  > "$OUT/gpu_law.log" 2>&1
echo "tests/test_gpu_law.py exit status $? (124: stopped at LAW_LIMIT)"
tail -n 3 "$OUT/gpu_law.log" | cut -c1-300
# The ensemble's merge and vote as compiled tensor calls on the GPU, against the eager path's tokens (ENSEMBLE_LIMIT
# seconds, default 150; 0 skips it).
if [ "${ENSEMBLE_LIMIT:-150}" != 0 ]; then
  timeout "${ENSEMBLE_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_law.py -k ensembles \
    > "$OUT/gpu_ensemble.log" 2>&1
  echo "the ensemble's GPU tests exit status $? (124: stopped at ENSEMBLE_LIMIT)"
  tail -n 3 "$OUT/gpu_ensemble.log" | cut -c1-300
fi
ONLY=${ONLY:-"hf_generate plain_compiled plain_compiled_fused eagle3_compiled_fused_chained ssm_compiled_fused_split
  ssm_compiled_fused_chained medusa_compiled_fused_split medusa_compiled_fused_chained eagle3_compiled_fused_split
  oracle_default-4h-25_compiled_fused hf_static_compiled plain_compiled_fused_sampled"}
# shellcheck disable=SC2086  # EXTRA and ONLY are lists
timeout "${LIMIT:-350}" python3 benchmarks/gpu_compiled.py --no-eager --fused-step --chained \
  --sampled --reps 2 --profile --deadline "${DEADLINE:-220}" --out "$OUT" --only $ONLY ${EXTRA:-} \
  > "$OUT/gpu_compiled.log" 2>&1
status=$?
echo "gpu_compiled.py exit status $status (124: stopped at LIMIT; the rounds saved so far are in the results)"
grep -E "warm-up|failed|Error|skipping cudagraphs|verify alone|^(plain|oracle|medusa|eagle3|ssm|hf)_|agree" "$OUT/gpu_compiled.log" | cut -c1-300
exit $status
