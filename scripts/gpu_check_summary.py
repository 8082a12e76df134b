"""Fold one gpu_check.sh run's outputs into DIR/gpu_check.json (and print a short table).

Reads, from DIR: gpu_tests.xml (pytest's junit XML: every kernel test's outcome), and the
benchmarks' JSONs (gpu_bench_attention, gpu_bench_kv_quant, bench_quant_matmul, gpu_bench_e2e,
bench_tensor_parallel*). A missing file is recorded as missing, never guessed.

    python scripts/gpu_check_summary.py DIR
"""

from __future__ import annotations

import glob
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET


def test_outcomes(path: str) -> dict:
    if not os.path.exists(path):
        return {"missing": path}
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = kinds[0] if kinds else "passed"
    counts = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return {"counts": counts, "not_passed": {k: v for k, v in outcomes.items() if v != "passed"},
            "num_tests": len(outcomes)}


def main() -> int:
    directory = sys.argv[1]
    summary = {"python": platform.python_version()}
    try:
        import jax
        summary["jax"] = jax.__version__
        summary["devices"] = [str(d) for d in jax.devices()]
    except Exception as e:  # the summary must come back even when jax cannot start
        summary["jax_error"] = repr(e)
    summary["kernel_tests"] = test_outcomes(os.path.join(directory, "gpu_tests.xml"))
    for name in ("gpu_bench_attention", "gpu_bench_kv_quant", "bench_quant_matmul", "gpu_bench_e2e"):
        path = os.path.join(directory, name + ".json")
        summary[name] = json.load(open(path)) if os.path.exists(path) else {"missing": path}
    for path in sorted(glob.glob(os.path.join(directory, "bench_tensor_parallel*.json"))):
        summary[os.path.basename(path)[:-5]] = json.load(open(path))
    with open(os.path.join(directory, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    tests = summary["kernel_tests"]
    print(f"gpu_check.json: jax {summary.get('jax')}, kernel tests {tests.get('counts', tests)}")
    for name, outcome in list(tests.get("not_passed", {}).items())[:40]:
        print(f"  {outcome:<8} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
