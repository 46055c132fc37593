#!/usr/bin/env bash
# Validate the NVML backend on a real NVIDIA node in one short run (about two minutes):
#   1. nvidia-smi's view of the machine;
#   2. a fixture of every raw NVML answer the backend asks for (bench/record_nvml_fixture.py),
#      recorded while a GPU load runs so utilization, power and the process list are not idle;
#   3. the backend's Python overhead over the library calls it makes (bench/nvml_hardware.py);
#   4. the agent itself against the real GPU(s): /metrics, /readyz, its log, and its CPU per
#      collection cycle at a 1 s interval (no kubelet socket, no Kubernetes API: the device half).
# Usage: OUT=<dir> bash bench/gpu_validate.sh   (run from the repository root; PYTHON to override)
# It changes nothing on the GPUs (no MIG or clock changes, no reset).
set -uo pipefail
OUT=${OUT:?set OUT to a directory for the results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
log() { echo "== $(date +%T) $*"; }
# get URL [ACCEPT]: the body on stdout, " (status)" on stderr (no curl needed)
get() {
  "$PY" -c '
import sys, urllib.error, urllib.request
req = urllib.request.Request(sys.argv[1], headers={"Accept": sys.argv[2]} if len(sys.argv) > 2 else {})
try:
    r = urllib.request.urlopen(req, timeout=5)
    code, body = r.status, r.read()
except urllib.error.HTTPError as e:
    code, body = e.code, e.read()
except OSError:
    sys.exit(1)
sys.stdout.buffer.write(body)
print(f" ({code})", file=sys.stderr)
' "$@"
}

log "machine"
nvidia-smi -q > "$OUT/nvidia-smi-q.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,mig.mode.current,pci.bus_id,memory.total --format=csv
"$PY" -c 'import pynvml, platform; print("nvidia-ml-py", pynvml.__file__, "python", platform.python_version())'

# A load on the GPU: a matrix-product loop (PyTorch, when the image has it), so the recorded
# utilization, power, clocks and running processes are those of a busy GPU.
LOAD_PID=""
if "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" - <<'EOF' &
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + 200
while time.time() < end:
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
EOF
  LOAD_PID=$!
  sleep 5
fi

log "fixture"
timeout 120 "$PY" bench/record_nvml_fixture.py --out "$OUT/nvml-fixture.json" --cycles 3 --interval 1.0 --latency-calls 200 2>&1 | tail -5

log "backend overhead"
timeout 120 "$PY" bench/nvml_hardware.py --reads 300 --rounds 5 --out "$OUT/nvml-overhead.json" 2>&1 | grep -v '^\S* \S* \[info' | tail -20

log "agent"
"$PY" -m exporter --backend nvml --listen 127.0.0.1:9402 --interval 1 --node-name gpu-check \
  --kubelet-socket /tmp/no-kubelet.sock --log-format json --log-level info > "$OUT/agent.log" 2>&1 &
AGENT=$!
for _ in $(seq 1 100); do get http://127.0.0.1:9402/metrics >/dev/null 2>&1 && break; sleep 0.2; done
sleep 3
cpu() { awk '{print $14 + $15}' "/proc/$AGENT/stat"; }
T0=$(date +%s.%N); C0=$(cpu)
sleep 30
T1=$(date +%s.%N); C1=$(cpu)
TCK=$(getconf CLK_TCK)
awk -v c0="$C0" -v c1="$C1" -v t0="$T0" -v t1="$T1" -v hz="$TCK" \
  'BEGIN { s = (c1 - c0) / hz; printf "agent CPU over %.1f s at a 1 s interval: %.3f s = %.2f%% of a core\n", t1 - t0, s, 100 * s / (t1 - t0) }' | tee "$OUT/agent-cpu.txt"
get http://127.0.0.1:9402/metrics > "$OUT/metrics.txt"
get http://127.0.0.1:9402/metrics application/openmetrics-text > "$OUT/metrics.openmetrics.txt"
echo "readyz: $(get http://127.0.0.1:9402/readyz 2>&1)" | tee -a "$OUT/agent-cpu.txt"
echo "healthz: $(get http://127.0.0.1:9402/healthz 2>&1)" | tee -a "$OUT/agent-cpu.txt"
grep -E '^(gpu_|dra_gpu_exporter_(collect|cycle|read))' "$OUT/metrics.txt" | grep -v '_bucket' | head -60
kill -TERM "$AGENT"; wait "$AGENT"; echo "agent exit status $?"

# 5. Where that CPU goes, all threads (yappi, when it is importable): 30 s after 5 s of start-up.
if "$PY" -c 'import yappi' 2>/dev/null; then
  log "profile"
  timeout 90 "$PY" bench/profile_agent.py --warmup 5 --seconds 30 --top 45 --out "$OUT/agent-profile.txt" -- \
    --backend nvml --listen 127.0.0.1:9403 --interval 1 --node-name gpu-check \
    --kubelet-socket /tmp/no-kubelet.sock --log-format json --log-level warning >/dev/null 2>&1
  head -40 "$OUT/agent-profile.txt"
fi
[ -n "$LOAD_PID" ] && kill "$LOAD_PID" 2>/dev/null
log "done"
ls -la "$OUT"
