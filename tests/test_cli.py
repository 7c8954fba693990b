"""The coldstart command line: pack / verify / demo through the CLI, and serve's config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from deployments.cli import build_parser, with_gpus

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_demo_pack_verify_round_trip(tmp_path):
    assert _cli("demo", str(tmp_path / "hf"), "--shape", "tiny").returncode == 0
    r = _cli("pack", str(tmp_path / "hf"), str(tmp_path / "p"), "-q")
    assert r.returncode == 0 and "packed 21 tensors" in r.stdout
    r = _cli("verify", str(tmp_path / "p"))
    assert r.returncode == 0 and r.stdout.startswith("ok: ")


def test_errors_are_one_line_with_exit_codes(tmp_path):
    r = _cli("pack", str(tmp_path / "missing"), str(tmp_path / "p"))
    assert r.returncode == 2 and "coldstart pack: error:" in r.stderr and "no such directory" in r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.cst").write_bytes(b"nope" * 2000)
    r = _cli("verify", str(tmp_path / "bad"))
    assert r.returncode == 1 and "not a coldstart packed file" in r.stderr


def test_serve_gpus_sets_num_gpus_on_every_deployment():
    text = (ROOT / "serve_config.yaml").read_text()
    cfg = yaml.safe_load(with_gpus(text, 1))
    deps = [d for app in cfg["applications"] for d in app["deployments"]]
    assert deps and all(d["ray_actor_options"]["num_gpus"] == 1 for d in deps)
    base = yaml.safe_load(text)
    # nothing else changes
    for d in (base, cfg):
        for app in d["applications"]:
            for dep in app["deployments"]:
                dep["ray_actor_options"].pop("num_gpus")
    assert base == cfg


def test_serve_arguments():
    a = build_parser().parse_args(["serve", "--gpus", "1", "my.yaml"])
    assert (a.gpus, a.config) == (1.0, "my.yaml")
    a = build_parser().parse_args(["serve"])
    assert (a.gpus, a.config) == (None, "serve_config.yaml")


def test_doctor_keeps_its_own_flags():
    r = _cli("doctor", "--help")
    assert r.returncode == 0 and "--require-gpu" in r.stdout


def test_serve_gpus_fills_an_empty_ray_actor_options():
    text = "applications:\n- name: a\n  deployments:\n  - name: d\n    ray_actor_options:\n"
    cfg = yaml.safe_load(with_gpus(text, 1))
    assert cfg["applications"][0]["deployments"][0]["ray_actor_options"] == {"num_gpus": 1}
