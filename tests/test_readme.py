"""The README's commands are the ones CI and the tests run, and its Python recipe runs as written (on a
small demo checkpoint instead of Llama-2-7B)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_python_recipe_runs(small_hf, tmp_path):
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "weights/llama-2-7b" in code and "/models/hf/Llama-2-7b-hf" in code
    code = code.replace("/models/hf/Llama-2-7b-hf", str(small_hf)).replace("weights/llama-2-7b",
                                                                             str(tmp_path / "packed"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "packed" / "model.cst").is_file()


def _bash_blocks() -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)]


def test_the_two_commands_are_the_ones_ci_and_the_tests_run():
    blocks = _bash_blocks()
    # run the service: tests/test_serve.py runs `coldstart serve` on its own Ray instance
    assert "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/coldstart serve" in blocks
    # its first request: the one tests/test_serve.py waits for
    assert any(b.startswith("curl -X POST http://localhost:8000/generate") and
               '\'{"prompt":"The answer is ", "max_new_tokens":128, "temperature":0}\'' in b for b in blocks)
    # install and run the tests: .ci/run runs the README's line, byte for byte
    test_cmd = 'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest -q'
    assert test_cmd in blocks
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.split("# --- the README's test command ---\n", 1)[1].strip().splitlines()[0] == test_cmd
    # a machine without a GPU: torch's CPU build first, from torch's own index
    assert any("pip install -q torch --index-url https://download.pytorch.org/whl/cpu" in b for b in blocks)
