"""The coldstart command line: pack / verify / demo through the CLI, and serve's config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deployments.tools.cli import build_parser, derived_config

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.tools.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_demo_pack_verify_round_trip(tmp_path):
    assert _cli("demo", str(tmp_path / "hf"), "--shape", "tiny").returncode == 0
    r = _cli("pack", str(tmp_path / "hf"), str(tmp_path / "p"), "-q")
    assert r.returncode == 0 and "packed 21 tensors" in r.stdout
    r = _cli("verify", str(tmp_path / "p"))
    assert r.returncode == 0 and r.stdout.startswith("ok: ")


def test_demo_force_replaces_only_a_demo_or_an_empty_directory(tmp_path):
    """--force never deletes what `coldstart demo` did not write: a folder of the user's is
    refused with --force or without, and left whole."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for extra in ([], ["--force"]):
        r = _cli("demo", str(mine), "--shape", "tiny", *extra)
        assert r.returncode == 2 and "is not a checkpoint `coldstart demo` made (no .coldstart-demo)" in r.stderr \
            and "--force or without" in r.stderr, r.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    assert _cli("demo", str(tmp_path / "hf"), "--shape", "tiny").returncode == 0
    r = _cli("demo", str(tmp_path / "hf"), "--shape", "tiny")
    assert r.returncode == 2 and "exists; pass --force to replace it" in r.stderr
    assert _cli("demo", str(tmp_path / "hf"), "--shape", "tiny", "--seed", "1", "--force").returncode == 0
    (tmp_path / "empty").mkdir()
    assert _cli("demo", str(tmp_path / "empty"), "--shape", "tiny", "--force").returncode == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


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
    cfg = yaml.safe_load(derived_config(text, 1))
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
    assert (a.gpus, a.config, a.model) == (None, "serve_config.yaml", None)
    a = build_parser().parse_args(["serve", "--model", "weights/x", "--gpus", "1"])
    assert (a.gpus, a.model) == (1.0, "weights/x")


def test_doctor_keeps_its_own_flags():
    r = _cli("doctor", "--help")
    assert r.returncode == 0 and "--require-gpu" in r.stdout


def test_serve_gpus_fills_an_empty_ray_actor_options():
    text = "applications:\n- name: a\n  deployments:\n  - name: d\n    ray_actor_options:\n"
    cfg = yaml.safe_load(derived_config(text, 1))
    assert cfg["applications"][0]["deployments"][0]["ray_actor_options"] == {"num_gpus": 1}


def test_serve_model_points_every_coldstart_application_at_it():
    text = (ROOT / "serve_config.yaml").read_text()
    cfg = yaml.safe_load(derived_config(text, model="/models/my-llama"))
    base = yaml.safe_load(text)
    assert cfg["applications"][0]["args"]["model"] == "/models/my-llama"
    base["applications"][0]["args"]["model"] = "/models/my-llama"
    # and the setup hook reads its weights early on a node where they are not cached
    base["applications"][0]["runtime_env"]["env_vars"]["COLDSTART_EARLY_WEIGHTS"] = "/models/my-llama"
    assert cfg == base  # nothing else changes, num_gpus neither
    other = "applications:\n- name: a\n  import_path: other.app:build\n  args: {model: m}\n"
    with pytest.raises(ValueError, match="no application with import_path deployments.app:build_app"):
        derived_config(other, model="/models/my-llama")


def test_serve_model_with_the_gpu_config_reads_that_model_early():
    """The README's GPU command (`coldstart serve --model M serve_config.gpu.yaml`): the copy points
    args.model and the setup hook's early read at M, not at the config's mounted model."""
    cfg = yaml.safe_load(derived_config((ROOT / "serve_config.gpu.yaml").read_text(), model="/models/my-llama"))
    app = cfg["applications"][0]
    assert app["args"]["model"] == "/models/my-llama"
    assert app["runtime_env"]["env_vars"]["COLDSTART_EARLY_WEIGHTS"] == "/models/my-llama"
    assert app["args"]["engine"]["kv_cache"] == "paged"  # the rest as the GPU config has it


def test_serve_model_is_checked_before_ray_starts(tmp_path, tiny_packed):
    """A missing or corrupt packed model is a one-line error at once, not a replica failing later."""
    r = _cli("serve", "--model", str(tmp_path / "nothing"), cwd=tmp_path)
    assert r.returncode == 2 and "model.cst missing" in r.stderr and "coldstart pack HF_DIR" in r.stderr
    assert "Traceback" not in r.stderr and "serve run" not in r.stdout
    bad = tmp_path / "bad"
    shutil.copytree(tiny_packed, bad)
    with open(bad / "model.cst", "r+b") as f:  # a flipped byte in the preamble
        f.seek(20)
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 0xFF]))
    r = _cli("serve", "--model", str(bad), cwd=tmp_path)
    assert r.returncode == 1 and str(bad) in r.stderr and "corrupt" in r.stderr, r.stderr
    assert "serve run" not in r.stdout and not (tmp_path / "weights").exists()


def test_serve_config_is_checked_before_ray_starts(tmp_path):
    """A missing, broken or foreign config file is a one-line error naming it, before Ray (and
    before the demo model is made); an import path is left to serve run."""
    r = _cli("serve", cwd=tmp_path)  # no serve_config.yaml here
    assert r.returncode == 2 and f"serve_config.yaml: no such config file in {tmp_path}" in r.stderr
    (tmp_path / "broken.yaml").write_text("applications: [\n")
    r = _cli("serve", "broken.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "broken.yaml: not valid YAML" in r.stderr and 'in "' in r.stderr
    (tmp_path / "other.yml").write_text("proxy_location: EveryNode\n")
    r = _cli("serve", str(tmp_path / "other.yml"), cwd=tmp_path)
    assert r.returncode == 2 and "needs an `applications:` list" in r.stderr
    for gpus in ("-1", "nan"):
        r = _cli("serve", "--gpus", gpus, cwd=tmp_path)
        assert r.returncode == 2 and "give the GPUs per replica, 0 or more" in r.stderr
    assert "Traceback" not in r.stderr and "serve run" not in r.stdout
    # a typo in the application's args or its warm-up plan: named before Ray starts
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["applications"][0]["args"]["engine"]["max_slot"] = 8
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(cfg))
    r = _cli("serve", "typo.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "application 'coldstart': args.engine: unknown field 'max_slot'" in r.stderr, r.stderr
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cfg["applications"][0]["deployments"][0]["user_config"]["warmup"]["requests"] = "one"
    (tmp_path / "typo2.yaml").write_text(yaml.safe_dump(cfg))
    r = _cli("serve", "typo2.yaml", cwd=tmp_path)
    assert r.returncode == 2 and "user_config.warmup.requests must be int, got str 'one'" in r.stderr, r.stderr
    assert not (tmp_path / "weights").exists()


def test_the_ready_line_points_at_the_configs_application():
    from deployments.tools.cli import health_url
    text = (ROOT / "serve_config.yaml").read_text()
    assert health_url(text) == "http://127.0.0.1:8000/health"
    assert health_url(text.replace("route_prefix: /", "route_prefix: /llm").replace("port: 8000", "port: 9000")
                      .replace("host: 127.0.0.1", "host: 0.0.0.0")) == "http://127.0.0.1:9000/llm/health"
    assert health_url("applications:\n  - import_path: other:app\n") is None


def test_serve_warns_where_autoscaling_works_against_a_replicas_slots(tmp_path):
    from deployments.tools.cli import check_config
    for shipped in ("serve_config.yaml", "serve_config.gpu.yaml"):
        assert check_config(str(ROOT / shipped)) == []  # the project's own configs agree with their slots
    cfg = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    dep = cfg["applications"][0]["deployments"][0]
    dep["autoscaling_config"]["target_ongoing_requests"] = 20
    dep["max_ongoing_requests"] = 4
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    notes = check_config(str(tmp_path / "c.yaml"))
    assert len(notes) == 2, notes
    assert "target_ongoing_requests 20 is above engine.max_slots 8" in notes[0]
    assert "max_ongoing_requests 4 is below engine.max_slots 8: 4 of each replica's slots never fill" in notes[1]
