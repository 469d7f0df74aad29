"""scripts/count_launches.py end to end on the CPU (the GPU code path forced): its JSON gives our
12 launches per OPT decode layer-step beside the plain layer's 11, and host times for both."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_launches.py"


def test_count_launches_reports_ours_beside_the_plain_floor(tmp_path):
    out = tmp_path / "launches.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPT), "--layers", "2", "--steps", "3", "--rounds", "2", "--json", str(out)],
                   check=True, capture_output=True, text=True, env=env, timeout=300)
    figures = json.loads(out.read_text())
    ours, plain = figures["ours"], figures["plain"]
    assert ours["launches"] == 12 and plain["launches"] == 11
    assert ours["host_us"] > 0 and plain["host_us"] > 0 and ours["ratio"] > 0
    assert ours["outside_launches"] > 0 and figures["profiler_kernels_per_layer_step"] is None  # no CUDA here
