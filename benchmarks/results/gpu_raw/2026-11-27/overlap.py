"""Which XLA settings let the host codes' copies overlap the layers' work? (8B first, then
70B with the best, time permitting.) Prints one JSON line per run; writes $OUT/overlap.jsonl."""
import json, os, subprocess, sys, time
budget = float(sys.argv[1]); out = sys.argv[2]; t0 = time.time()
PIPE = "--xla_gpu_enable_pipelined_host_offloading=true"
VARIANTS = {"pipelined": PIPE,
            "pipelined+nocmdbuf": PIPE + " --xla_gpu_enable_command_buffer=",
            "pipelined+concurrent": PIPE + " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT"}
TOTAL_GIB = 139.8

def run(cell, flags, cap, trace=False, timeout=150):
    env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_PREALLOCATE="false",
               XLA_PYTHON_CLIENT_MEM_FRACTION=f"{cap / TOTAL_GIB:.4f}" if cap else "0.75",
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    args = [sys.executable, "-m", "benchmarks._device_step", cell, "--steps", "8"]
    if trace:
        args += ["--trace", "/tmp/traces"]
    left = budget - (time.time() - t0)
    if left < 30:
        return None
    try:
        p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=min(timeout, left))
        res = next((json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")),
                   {"error": (p.stderr or p.stdout)[-800:]})
    except subprocess.TimeoutExpired:
        res = {"error": "timed out"}
    res = {"cell": cell, "flags": flags, "cap": cap, "t": round(time.time() - t0), **res}
    print(json.dumps(res), flush=True)
    with open(f"{out}/overlap.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
    return res.get("step_s")

host8 = os.environ.get("CELL8", "llama-3-8b:qlora-nf4+host:1:layer:auto")
times = {}
h70 = "llama-3-70b:qlora-nf4+host:1:layer:auto"
for i, (name, flags) in enumerate(VARIANTS.items()):
    times[name] = run(host8, flags, 4, trace=(i == 0))
    if i and times[name] and times[name] < 0.85 * (times["pipelined"] or 1e9):
        print("WIN", name, times, flush=True)
        if budget - (time.time() - t0) > 100:
            run(h70, flags, 22, timeout=140)
        break
else:
    print("NO WIN", times, flush=True)
    if budget - (time.time() - t0) > 45:
        run(host8, "--xla_gpu_enable_command_buffer=", 4)  # no pipelining, no command buffers
