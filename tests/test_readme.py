"""The README's Python recipe runs as written (on a small demo checkpoint instead of Llama-2-7B)."""

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
