"""benchmarks/kernels.py (what benchmarks/gpu_check.sh runs on an H200) still runs, in Pallas
interpret mode on the CPU with a tiny grid: the GPU check is not the first place it can break."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernel_benchmark_runs_in_interpret_mode(tmp_path):
    command = [sys.executable, "benchmarks/kernels.py", "--interpret", "--batch-sizes", "1", "--context-lens", "32",
               "--repeats", "1", "--skip-reference", "--out-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("OUT", None)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "| decode | 1 | 32 |" in result.stdout and "| ragged | 1 | 32 |" in result.stdout
    written = [name for name in os.listdir(tmp_path) if name.endswith(".json")]
    assert written, os.listdir(tmp_path)
    assert json.loads((tmp_path / written[0]).read_text())
