"""`coldstart doctor`: real files, real probes; the GPU-only paths skip cleanly without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments import gpu_facts
from deployments.tools import check, doctor, doctor_files
from deployments.tools.doctor import Check, GpuInfo

ROOT = Path(__file__).resolve().parent.parent
CHECK_NAMES = ["torch build", "nvidia driver", "cuda runtime", "cuda context", "visible gpu",
               "gpu memory", "env vars", "kernel cache", "compiled modules", "page cache", "read speed",
               "pinned h2d"]
TP_CHECKS = ["tp gpus", "tp peer access", "tp group start"]  # with --tp N
GPU_CHECKS = ["nvidia driver", "cuda runtime", "cuda context", "visible gpu", "gpu memory",
              "pinned h2d"]


def _has_gpu() -> bool:
    import torch

    return doctor.probe_driver()[0] is not None or torch.cuda.is_available()


HAS_GPU = _has_gpu()
cpu_only = pytest.mark.skipif(HAS_GPU, reason="asserts what the doctor says on a machine without a GPU")
# pip's default torch on Linux is a CUDA build, which the doctor calls ok even without a GPU;
# a CPU-only build is a skip (a fail under --require-gpu)
def _cuda_build() -> bool:
    import torch

    return torch.version.cuda is not None


CUDA_BUILD = _cuda_build()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A stand-in packed model: a model.cst of 3 MiB + 5 bytes, plus a config."""
    d = tmp_path / "model"
    d.mkdir()
    (d / check.WEIGHTS_FILE).write_bytes(os.urandom((3 << 20) + 5))
    (d / "config.json").write_text("{}")
    return d


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = doctor.main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def by_name(report: dict) -> dict[str, dict]:
    return {c["check"]: c for c in report["checks"]}


# ------------------------------------------------------------------ the command
def test_help_imports_no_torch():
    code = "import sys, deployments.tools.doctor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False", "deployments.tools.doctor must import torch lazily"
    r = subprocess.run([sys.executable, "-m", "deployments.tools.doctor", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for flag in ("--model", "--read-gib", "--json", "--require-gpu"):
        assert flag in r.stdout


@cpu_only
def test_json_report_without_gpu(capsys, model_dir):
    rc, report = run_json(capsys, "--model", str(model_dir), "--read-gib", "0.001")
    assert rc == 0
    assert report["ok"] is True
    assert [c["check"] for c in report["checks"]] == CHECK_NAMES
    for c in report["checks"]:
        assert set(c) == {"check", "status", "detail", "action", "data"}
        assert c["status"] in doctor.STATUSES and c["detail"]
    assert report["summary"] == {s: sum(c["status"] == s for c in report["checks"])
                                 for s in doctor.STATUSES}
    checks = by_name(report)
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "skip", checks[name]
        assert "not checked" in checks[name]["detail"]
    assert checks["env vars"]["status"] in ("ok", "warn")
    read = checks["read speed"]
    assert read["status"] in ("ok", "warn")
    assert read["data"]["bytes"] == int(0.001 * check.GIB)  # --read-gib caps the read
    assert read["data"]["gbps"] > 0
    cache = checks["page cache"]
    assert cache["data"]["files"] == [str(model_dir / check.WEIGHTS_FILE)]
    frac = cache["data"]["fraction"]
    assert (cache["status"] == "skip" and frac is None) or (cache["status"] == "ok" and frac > 0)


@cpu_only
def test_table_without_gpu(capsys, model_dir):
    rc = doctor.main(["--model", str(model_dir), "--read-gib", "0.001"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["check", "status", "detail", "what", "to", "do"]
    starts = [line for line in lines[2:] if line and not line.startswith(" ")]
    assert [next(n for n in CHECK_NAMES if s.startswith(n)) for s in starts[:-1]] == CHECK_NAMES
    for name in GPU_CHECKS:
        row = next(s for s in starts if s.startswith(name))
        assert row[len(name):].split()[0] == "skip"
    build = next(s for s in starts if s.startswith("torch build"))
    assert build[len("torch build"):].split()[0] == ("ok" if CUDA_BUILD else "skip")
    # the six GPU checks and the kernel cache, and the torch build when it is a CPU-only one
    assert lines[-1].endswith(", 0 fail, 7 skip" if CUDA_BUILD else ", 0 fail, 8 skip")


@cpu_only
def test_require_gpu_fails_without_gpu(capsys, model_dir):
    rc, report = run_json(capsys, "--model", str(model_dir), "--read-gib", "0.001",
                          "--require-gpu")
    assert rc == 1 and report["ok"] is False
    checks = by_name(report)
    for name in ("nvidia driver", "cuda context", "pinned h2d") + (() if CUDA_BUILD else ("torch build",)):
        assert checks[name]["status"] == "fail", checks[name]
        assert checks[name]["detail"].startswith("--require-gpu: ")
    if CUDA_BUILD:
        assert checks["torch build"]["status"] == "ok", checks["torch build"]
    assert "no NVIDIA driver" in checks["nvidia driver"]["detail"]
    assert "nvidia.com/gpu" in checks["nvidia driver"]["action"]
    assert checks["read speed"]["status"] in ("ok", "warn")  # the CPU checks still ran


def test_missing_model_given_is_a_fail(capsys, tmp_path):
    rc, report = run_json(capsys, "--model", str(tmp_path / "nope"))
    assert rc == 1
    for name in ("page cache", "read speed"):
        c = by_name(report)[name]
        assert c["status"] == "fail" and "does not exist" in c["detail"]
        assert "--model" in c["action"]


@cpu_only
def test_missing_default_model_is_a_skip(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no weights/demo here
    rc, report = run_json(capsys)
    assert rc == 0
    assert by_name(report)["read speed"]["status"] == "skip"


@pytest.mark.parametrize("argv, field", [(["--read-gib", "0"], "--read-gib"),
                                         (["--threads", "0"], "--threads")])
def test_bad_arguments_name_the_flag(capsys, argv, field):
    assert doctor.main(argv) == 2
    assert field in capsys.readouterr().err


def test_exit_code_is_1_only_when_a_check_fails(capsys, monkeypatch):
    rows = [Check("a", "ok", "fine"), Check("b", "warn", "meh", "do x"), Check("c", "skip", "n/a")]
    monkeypatch.setattr(doctor, "run_checks", lambda opts: rows)
    assert doctor.main([]) == 0
    monkeypatch.setattr(doctor, "run_checks", lambda opts: rows + [Check("d", "fail", "broken")])
    assert doctor.main(["--json"]) == 1
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["summary"] == {"ok": 1, "warn": 1, "fail": 1, "skip": 1}


def test_a_crashing_probe_is_a_fail_row(capsys, monkeypatch, model_dir):
    def boom():
        raise RuntimeError("probe exploded")
    monkeypatch.setattr(doctor, "check_env", boom)
    rc, report = run_json(capsys, "--model", str(model_dir), "--read-gib", "0.001")
    assert rc == 1
    env = by_name(report)["env vars"]
    assert env["status"] == "fail" and "RuntimeError: probe exploded" in env["detail"]


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError, match="Check.status.*'great'"):
        Check("x", "great", "")


def test_table_wraps_to_width():
    rows = [Check("read speed", "warn", "word " * 60, "advice " * 30),
            Check("env vars", "ok", "short")]
    table = doctor.render_table(rows, width=100)
    assert all(len(line) <= 100 for line in table.splitlines())
    assert table.count("\nread speed") == 1 and "\nenv vars  " in table


def test_weights_file_name_matches_the_format():
    from weights.format import WEIGHTS_FILE

    assert check.WEIGHTS_FILE == WEIGHTS_FILE


# ------------------------------------------------------------------ files, page cache, reads
def test_page_cache_fraction_of_a_file_just_written(tmp_path):
    p = tmp_path / "w.bin"
    p.write_bytes(os.urandom(1 << 20))
    frac = doctor_files.page_cache_fraction([p])
    # just written, so its pages are in the cache; None only where mincore is unavailable
    assert frac is None or 0 < frac <= 1
    from weights.readahead import resident_bytes
    part = resident_bytes(p, offset=4096 + 7, length=10_000)
    assert part is None or 0 <= part <= 10_000
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    assert doctor_files.page_cache_fraction([empty]) is None  # nothing to measure


def test_page_cache_fraction_unknown_off_linux(tmp_path, monkeypatch):
    p = tmp_path / "w.bin"
    p.write_bytes(b"x" * 8192)
    monkeypatch.setattr(doctor.sys, "platform", "darwin")
    assert doctor_files.page_cache_fraction([p]) is None


@pytest.mark.parametrize("limit, threads", [(10 << 20, 3), ((64 << 10) + 5, 2), (1, 1)])
def test_read_files_reads_exactly_up_to_the_limit(tmp_path, limit, threads):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(os.urandom(3 * (64 << 10) + 123))  # not a multiple of the chunk
    b.write_bytes(os.urandom(100_000))
    n, secs = doctor_files.read_files([a, b], limit, threads=threads, chunk=64 << 10)
    assert n == min(limit, a.stat().st_size + b.stat().st_size)
    assert secs >= 0


def test_model_files(tmp_path, model_dir):
    assert doctor.model_files(model_dir) == [model_dir / check.WEIGHTS_FILE]
    loose = tmp_path / "hf"
    (loose / "sub").mkdir(parents=True)
    for name in ("b.safetensors", "a.json", "sub/c.bin"):
        (loose / name).write_bytes(b"x")
    assert doctor.model_files(loose) == sorted([loose / "a.json", loose / "b.safetensors",
                                                loose / "sub" / "c.bin"])
    assert doctor.model_files(loose / "a.json") == [loose / "a.json"]


# ------------------------------------------------------------------ driver
def test_parse_nvidia_smi():
    out = ("0, GPU-1111, 580.159.03, NVIDIA H200, 143771\n"
           "1, GPU-2222, 580.159.03, NVIDIA A100-SXM4-40GB, 40960\n")
    driver, gpus = gpu_facts.parse_nvidia_smi(out)
    assert driver == "580.159.03"
    assert gpus == [GpuInfo(0, "NVIDIA H200", "GPU-1111", 143771),
                    GpuInfo(1, "NVIDIA A100-SXM4-40GB", "GPU-2222", 40960)]
    assert gpu_facts.parse_nvidia_smi("") == (None, [])


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  525.85.12  Sat Jan 28 02:10:06 UTC 2023\n"
     "GCC version:  gcc version 11.3.0", "525.85.12"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build", "580.65.06"),
    ("no driver here", None),
])
def test_parse_proc_driver_version(text, version):
    assert gpu_facts.parse_proc_driver_version(text) == version


@pytest.mark.parametrize("driver, cuda, status", [
    ("580.159.03", "13.0", "ok"),
    ("580.65.06", "13.0", "ok"),
    ("580.10", "13.0", "warn"),     # minor-version compatibility only
    ("575.51.03", "13.0", "fail"),  # below the CUDA 13 floor: CUDA will not initialise
    ("570.86.15", "12.8", "ok"),
    ("550.54.14", "12.8", "warn"),
    ("525.85.12", "12.1", "warn"),
    ("470.199.02", "12.1", "fail"),
    ("525.85.12", "11.8", "ok"),
    ("450.80.02", "11.8", "warn"),
    ("560.35.03", "12.7", "ok"),    # no 12.7 toolkit: judged against 12.6's driver
    ("999.1", "14.0", "warn"),      # unknown major: says so rather than guess
])
def test_driver_verdict(driver, cuda, status):
    got, detail, action = doctor.driver_verdict(driver, cuda)
    assert got == status, detail
    assert driver in detail
    if status == "fail":
        assert "install driver >=" in action


# ------------------------------------------------------------------ which GPU
ONE = [GpuInfo(0, "NVIDIA A100-SXM4-40GB", "GPU-aaaa", 40960)]


def test_host_index_inside_a_container_is_a_fail():
    env = {"CUDA_VISIBLE_DEVICES": "3", "NVIDIA_VISIBLE_DEVICES": "3",
           "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    status, detail, action = doctor.visibility_verdict(env, ONE, 0)
    assert status == "fail"
    assert "numbered from 0" in detail and "GPU 3" in detail
    assert "cuda:0" in action


def test_device_plugin_index_is_explained():
    env = {"NVIDIA_VISIBLE_DEVICES": "3", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    status, detail, _ = doctor.visibility_verdict(env, ONE, 1)
    assert status == "ok"
    assert "host GPU 3" in detail and "cuda:0" in detail


def test_all_gpus_in_kubernetes_is_a_warning():
    env = {"NVIDIA_VISIBLE_DEVICES": "all", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    status, detail, action = doctor.visibility_verdict(env, ONE * 8, 8)
    assert status == "warn" and "every GPU of the node" in detail
    assert "nvidia.com/gpu" in action


@pytest.mark.parametrize("cvd", ["", "-1"])
def test_empty_cuda_visible_devices_hides_the_gpus(cvd):
    status, detail, _ = doctor.visibility_verdict({"CUDA_VISIBLE_DEVICES": cvd}, ONE, 0)
    assert status == "warn" and "hides every GPU" in detail


def test_ray_style_visibility_is_ok():
    # Ray gives a replica CUDA_VISIBLE_DEVICES=<its GPU>; torch then sees exactly one
    gpus = [GpuInfo(i, "NVIDIA A100", f"GPU-{i}", 40960) for i in range(8)]
    status, detail, _ = doctor.visibility_verdict({"CUDA_VISIBLE_DEVICES": "5"}, gpus, 1)
    assert status == "ok" and "torch sees 1" in detail


def test_driver_sees_gpus_but_torch_none_is_a_fail():
    status, _, action = doctor.visibility_verdict({}, ONE, 0)
    assert status == "fail" and "CUDA_VISIBLE_DEVICES" in action


# ------------------------------------------------------------------ env vars
@pytest.mark.parametrize("env, needle, fix", [
    ({"CUDA_MODULE_LOADING": "EAGER"}, "CUDA_MODULE_LOADING=EAGER", "CUDA_MODULE_LOADING=LAZY"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
      "PYTORCH_ALLOC_CONF": "max_split_size_mb:128"}, "disagree", "only one"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, "max_split_size_mb", "expandable_segments"),
    ({"CUDA_LAUNCH_BLOCKING": "1"}, "CUDA_LAUNCH_BLOCKING", "unset CUDA_LAUNCH_BLOCKING"),
    ({"LD_LIBRARY_PATH": "/usr/local/cuda-11.8/lib64:/opt/x"}, "/usr/local/cuda-11.8/lib64",
     "LD_LIBRARY_PATH"),
])
def test_env_warnings(env, needle, fix):
    status, detail, action = doctor.env_verdict(env)
    assert status == "warn"
    assert needle in detail and fix in action


def test_expandable_segments_with_spaces_counts_as_on():
    status, _, action = doctor.env_verdict({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments : True"})
    assert (status, action) == ("ok", "")


def test_recommended_env_is_ok():
    env = {"CUDA_MODULE_LOADING": "LAZY", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    status, detail, action = doctor.env_verdict(env)
    assert (status, action) == ("ok", "")
    assert "expandable_segments:True" in detail


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device")
def test_gpu_checks_run_on_a_gpu(model_dir):
    # a fresh process: the context must not exist yet for its creation to be timed
    p = subprocess.run([sys.executable, "-m", "deployments.tools.cli", "doctor", "--json", "--model", str(model_dir),
                        "--read-gib", "0.001", "--require-gpu"], capture_output=True, text=True, cwd=ROOT)
    rc, report = p.returncode, json.loads(p.stdout)
    checks = by_name(report)
    assert checks["cuda context"]["status"] in ("ok", "warn")
    assert checks["cuda context"]["data"]["context_s"] > 0
    assert checks["pinned h2d"]["data"]["gbps"] > 0
    assert checks["gpu memory"]["data"]["total_bytes"] > 0
    assert checks["kernel cache"]["status"] in ("ok", "warn", "skip")  # skip: Triton not installed
    assert rc == (1 if report["summary"]["fail"] else 0)


@cpu_only
def test_tp_rows_check_the_gpus_and_start_a_group(capsys, model_dir):
    """--tp 2 on a machine without a GPU: the GPU rows skip (fail with --require-gpu), and the
    group's start is tried with gloo: two real processes join and all-reduce."""
    rc, report = run_json(capsys, "--model", str(model_dir), "--read-gib", "0.001", "--tp", "2")
    checks = by_name(report)
    assert [c["check"] for c in report["checks"]] == CHECK_NAMES + TP_CHECKS and rc == 0
    assert checks["tp gpus"]["status"] == checks["tp peer access"]["status"] == "skip"
    group = checks["tp group start"]
    assert group["status"] == "ok" and group["data"]["backend"] == "gloo", group
    assert group["data"]["join_and_all_reduce_s"] > 0
    rc, report = run_json(capsys, "--model", str(model_dir), "--read-gib", "0.001", "--tp", "2", "--require-gpu")
    assert rc == 1 and all(by_name(report)[n]["status"] == "fail" for n in TP_CHECKS)
    assert doctor.main(["--tp", "0"]) == 2 and "--tp" in capsys.readouterr().err


def test_doctor_reads_every_rank_of_a_split_pack(capsys, tiny_hf, tmp_path):
    from weights import PackOptions, pack
    split = pack(tiny_hf, tmp_path / "split", PackOptions(tp=2, progress=False))
    rc, report = run_json(capsys, "--model", str(split), "--read-gib", "0.001")
    assert by_name(report)["page cache"]["data"]["files"] == [str(split / f"rank-{k}" / check.WEIGHTS_FILE)
                                                             for k in (0, 1)]


def test_operator_guide_covers_every_check():
    guide = (ROOT / "docs" / "operations.md").read_text()
    missing = [name for name in CHECK_NAMES + TP_CHECKS if f"| {name} |" not in guide]
    assert not missing, f"docs/operations.md has no row for {missing}"


# ------------------------------------------------------------------ Triton's kernel cache
def test_triton_cache_dir():
    from deployments.node_cache import triton_cache_dir

    assert triton_cache_dir({"TRITON_CACHE_DIR": "/cache/t"}) == Path("/cache/t")
    assert triton_cache_dir({"TRITON_HOME": "/srv"}) == Path("/srv/.triton/cache")
    assert triton_cache_dir({}) == Path.home() / ".triton" / "cache"


MOUNTS = """overlay / overlay rw,relatime,lowerdir=/a,upperdir=/b 0 0
/dev/nvme1n1 /var/cache/coldstart ext4 rw,relatime 0 0
/dev/nvme0n1 /models xfs ro 0 0
/dev/sdb /mnt/my\\040disk ext4 rw 0 0
"""


def test_mount_of_picks_the_longest_mount_point():
    assert doctor_files.mount_of(Path("/var/cache/coldstart/triton"), MOUNTS) == ("/var/cache/coldstart", "ext4")
    assert doctor_files.mount_of(Path("/root/.triton/cache"), MOUNTS) == ("/", "overlay")
    assert doctor_files.mount_of(Path("/var/cache/coldstartx"), MOUNTS) == ("/", "overlay")  # not a prefix match
    assert doctor_files.mount_of(Path("/mnt/my disk/t"), MOUNTS) == ("/mnt/my disk", "ext4")
    assert doctor_files.mount_of(Path("/x"), "") is None


@pytest.mark.parametrize("kernels, writable, fstype, status, needle", [
    (12, True, "ext4", "ok", "12 compiled kernel groups"),
    (0, True, "ext4", "ok", "compiles the decode kernels once"),
    (12, False, "ext4", "warn", "not writable"),
    (12, True, "overlay", "warn", "container's own filesystem"),
])
def test_kernel_cache_verdict(kernels, writable, fstype, status, needle):
    st, detail, action = doctor_files.kernel_cache_verdict(Path("/c"), kernels, 5 << 20, writable, fstype)
    assert st == status and needle in detail
    assert (action != "") == (status == "warn")


def test_kernel_cache_is_skipped_when_triton_is_off(monkeypatch):
    monkeypatch.setenv("COLDSTART_TRITON", "0")
    c = doctor.check_kernel_cache(doctor.DoctorOptions(), None)
    assert c.status == "skip" and "COLDSTART_TRITON=0" in c.detail


def test_compiled_modules_says_where_replicas_keep_them(monkeypatch, tmp_path):
    """Where torch has no .pyc the interpreter can read or write, the doctor says so and
    where replicas keep the compiled modules instead; turned off, it warns."""
    from deployments.startup import bytecode

    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(bytecode, "needed", lambda probe="torch": False)
    c = doctor.check_bytecode()
    assert c.status == "ok" and "itself" in c.detail
    monkeypatch.setattr(bytecode, "needed", lambda probe="torch": probe == "torch")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("COLDSTART_BYTECODE_CACHE", str(tmp_path / "bc"))
    (tmp_path / "bc" / "x").mkdir(parents=True)
    (tmp_path / "bc" / "x" / "m.cpython-312.pyc").write_bytes(b"")
    c = doctor.check_bytecode()
    assert c.status == "ok" and str(tmp_path / "bc") in c.detail and c.data["pyc_files"] == 1
    assert "PYTHONDONTWRITEBYTECODE is set" in c.detail
    # Ray without .pyc files too: its worker compiles them before the replica can keep any
    monkeypatch.setattr(bytecode, "needed", lambda probe="torch": True)
    c = doctor.check_bytecode()
    assert c.status == "warn" and "Ray is installed without them" in c.detail
    assert f"PYTHONPYCACHEPREFIX={tmp_path / 'bc'}" in c.action and "serve_config.yaml" in c.action
    monkeypatch.setenv("COLDSTART_BYTECODE_CACHE", "0")
    c = doctor.check_bytecode()
    assert c.status == "warn" and "every replica compiles" in c.detail and "COLDSTART_BYTECODE_CACHE" in c.action
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "theirs"))
    assert doctor.check_bytecode().status == "ok"
