import sys, json
from benchmarks import workload
from tests.servers import redis_url
url = redis_url(); broker = workload.broker_url(url)
which = sys.argv[1:] or ["W1", "W2a", "W2b", "W4"]
setups = [("dedicated", "dedicated", url), ("gate", "gate", url)]
for w in which:
    if w == "W1": rows = workload.uniform("W1", 120, 0.05, 4, broker, setups)
    if w == "W2a": rows = workload.uniform("W2", 2000, 0.01, 4, broker, setups)
    if w == "W2b": rows = workload.uniform("W2", 1000, 0.05, 4, broker, setups)
    if w == "W4": rows = workload.uniform("W4", 400, 0.05, 8, broker, setups)
    g = rows[-1]; d = rows[0]
    print("RESULT", w, json.dumps({"vs": g["vs_dedicated"], "p99": g["handoff_p99_ms"], "p99_ded": d["handoff_p99_ms"], "p50": g["handoff_p50_ms"], "p50_ded": d["handoff_p50_ms"]}), flush=True)
