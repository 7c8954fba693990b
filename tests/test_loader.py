"""weights.load: one buffer, views, verification on the loading path, CPU and GPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import gpu, rewrite_index
from weights import (DeviceMemoryError, LoadOptions, PackedFormatError, PackOptions, PhaseTimer,
                     load, pack, read_packed)
from weights import checksum
from weights.checksum import chunk_sums
from weights.format import PREAMBLE_BYTES
from deployments.tools.doctor import drop_page_cache
from weights.loader import PendingLoad, check_fits, start_load


def _source(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(-1).view(torch.uint8)


def test_cpu_tensors_are_views_of_the_file_map(small_hf, tmp_path):
    dest = pack(small_hf, tmp_path / "p", PackOptions(progress=False))
    m = load(dest, "cpu")
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str((dest / "model.cst").resolve())):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            maps.append((lo, hi))
    assert maps, "model.cst is not memory-mapped"
    for name, t in m.tensors.items():
        p = t.data_ptr()
        assert any(lo <= p < hi for lo, hi in maps), f"{name} is not a view of the map"


def test_phases_feed_the_timer_and_sinks(tiny_packed):
    seen = []
    timer = PhaseTimer(sinks=[lambda name, s, n: seen.append(name)])
    load(tiny_packed, "cpu", timer=timer)
    assert seen == ["open", "map", "verify", "assemble"]
    v = timer.get("verify")
    assert v.nbytes == read_packed(tiny_packed).data_bytes and v.gbps > 0
    assert v.line().startswith("[METRIC] phase=verify seconds=")


def test_check_fits_message():
    check_fits(10, 11, 20, "cuda:0")
    with pytest.raises(DeviceMemoryError, match=r"needs 12.50 GiB on cuda:0, which has 8.00 GiB free "
                                                r"of 80.00 GiB"):
        check_fits(int(12.5 * 2**30), 8 * 2**30, 80 * 2**30, "cuda:0")
    with pytest.raises(DeviceMemoryError, match=r"plus 4.00 GiB of headroom"):
        check_fits(2**30, 4 * 2**30, 80 * 2**30, "cuda:0", headroom=4 * 2**30)


@pytest.mark.parametrize("kw, msg", [
    (dict(threads=0), "threads\n  Input should be greater than or equal to 1"),
    (dict(read_bytes=1000), "read_bytes=1000 must be a positive multiple of 4096"),
    (dict(slots_per_thread=0), "slots_per_thread\n  Input should be greater than or equal to 1"),
    (dict(cold_read_bytes=5000), "cold_read_bytes=5000 must be a positive multiple of 4096"),
    (dict(cold_threads=0), "cold_threads\n  Input should be greater than or equal to 1"),
])
def test_load_options_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LoadOptions(**kw)


def test_unknown_device(tiny_packed):
    with pytest.raises(ValueError, match="only cpu and cuda"):
        load(tiny_packed, "meta")


def test_missing_packed_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="coldstart pack"):
        load(tmp_path, "cpu")


@pytest.mark.parametrize("text, msg", [("{bad", "not valid JSON"), ("[]", "holds a JSON list, not an object")])
def test_a_config_broken_after_packing_names_the_file(tiny_packed, tmp_path, text, msg):
    """Refused as changed since packing (its sha256 is in the index); in a pack from before
    side-file checksums, by what is wrong with it."""
    import shutil

    d = tmp_path / "packed"
    shutil.copytree(tiny_packed, d)
    (d / "config.json").write_text(text)
    with pytest.raises(PackedFormatError, match="changed since packing") as e:
        load(d, "cpu")
    assert str(d / "config.json") in str(e.value) and "re-pack it" in str(e.value)
    rewrite_index(d, lambda doc: doc.pop("side_files"))
    with pytest.raises(ValueError, match=msg) as e:
        load(d, "cpu")
    assert str(d / "config.json") in str(e.value) and "re-pack the model" in str(e.value)


def test_start_load_on_cpu_is_done_at_once(tiny_packed):
    p = start_load(tiny_packed, "cpu")
    assert p.done()
    m = p.wait()
    ref = load(tiny_packed, "cpu")
    assert set(m.tensors) == set(ref.tensors)
    assert all(torch.equal(m.tensors[k], ref.tensors[k]) for k in ref.tensors)


def test_pending_load_hands_its_error_to_the_waiter(tiny_packed):
    """The bytes arrive on a thread of the load's own; wait() blocks until that thread is done
    and re-raises its error in the caller (a checksum mismatch, a read error)."""
    import threading
    m = load(tiny_packed, "cpu")
    go = threading.Event()

    def work() -> None:
        go.wait(10)
        raise PackedFormatError("checksum mismatch in chunk 3 (test)")
    p = PendingLoad(m.path, m.packed, m.device, m.buffer, m.config, PhaseTimer(), work)
    assert not p.done() and p.tensors.keys() == m.tensors.keys()  # views exist before the bytes
    with pytest.raises(TimeoutError, match="still loading"):
        p.wait(timeout=0.05)
    go.set()
    with pytest.raises(PackedFormatError, match="chunk 3"):
        p.wait()
    assert p.done()


def test_held_load_reads_nothing_until_released_and_can_be_cancelled(tiny_packed):
    """hold=True: the load's work waits for release() (or wait(), which releases); a held load
    that is cancelled never runs its work and its waiter gets an error, not garbage."""
    import threading
    import time
    m = load(tiny_packed, "cpu")
    ran = threading.Event()

    def work() -> None:
        ran.set()
    p = PendingLoad(m.path, m.packed, m.device, m.buffer, m.config, PhaseTimer(), work, hold=True)
    time.sleep(0.1)
    assert not ran.is_set() and not p.done()
    p.release()
    assert p.wait(timeout=10).tensors.keys() == m.tensors.keys() and ran.is_set()
    assert p.held_s >= 0.1
    ran.clear()
    q = PendingLoad(m.path, m.packed, m.device, m.buffer, m.config, PhaseTimer(), work, hold=True)
    q.cancel()
    with pytest.raises(RuntimeError, match="cancelled before it began reading"):
        q.wait(timeout=10)
    assert not ran.is_set()
    r = PendingLoad(m.path, m.packed, m.device, m.buffer, m.config, PhaseTimer(), work, hold=True)
    r.wait(timeout=10)  # wait() releases: a caller that forgot release() does not hang
    assert ran.is_set() and r.done()
    unheld = PendingLoad(m.path, m.packed, m.device, m.buffer, m.config, PhaseTimer(), work)
    assert unheld.wait(timeout=10) and unheld.held_s == 0.0  # only a held load records its wait
    r.cancel()  # once it has read: nothing to cancel
    r.wait(timeout=10)


# ---- GPU: run on the GPU machine ----

@gpu
@pytest.mark.parametrize("threads, read_bytes, direct", [(1, 4096, False), (3, 12288, False),
                                                         (16, 8 << 20, False), (3, 12288, True)])
def test_gpu_bit_exact(small_hf, tmp_path_factory, threads, read_bytes, direct):
    dest = tmp_path_factory.mktemp("g") / "p"
    pack(small_hf, dest, PackOptions(chunk_bytes=65536, progress=False))
    m = load(dest, "cuda", options=LoadOptions(threads=threads, read_bytes=read_bytes, direct_io=direct,
                                               adapt=False))
    src = _source(small_hf)
    assert set(m.tensors) == set(src)
    for name, t in src.items():
        g = m.tensors[name]
        assert g.is_cuda and g.dtype == t.dtype and g.shape == t.shape
        assert torch.equal(_bits(g), _bits(t)), name
    assert all(t.untyped_storage().data_ptr() == m.buffer.untyped_storage().data_ptr()
               for t in m.tensors.values())


@gpu
def test_gpu_start_load_returns_before_the_bytes_and_wait_gives_them_all(small_hf, tmp_path):
    dest = pack(small_hf, tmp_path / "p", PackOptions(chunk_bytes=65536, progress=False))
    timer = PhaseTimer()
    p = start_load(dest, "cuda", options=LoadOptions(threads=2, read_bytes=65536, adapt=False), timer=timer)
    views = dict(p.tensors)  # usable now: same addresses as after the load
    m = p.wait()
    assert p.done() and all(m.tensors[k].data_ptr() == v.data_ptr() for k, v in views.items())
    for name, t in _source(small_hf).items():
        assert torch.equal(_bits(m.tensors[name]), _bits(t)), name
    assert {"open", "alloc", "assemble", "read_copy", "verify"} <= set(timer.as_dict())


@gpu
def test_gpu_read_ahead_starts_after_the_buffers_views(tiny_packed, monkeypatch):
    """A bulk read of the weights starves the page faults of whatever the caller's thread
    runs beside it: the read-ahead starts only once the buffer and every view exist."""
    import weights.loader as loader_mod
    from weights import readahead

    events: list[str] = []
    real_views, real_prefetch = loader_mod._views, readahead.prefetch
    monkeypatch.setattr(loader_mod, "_views", lambda *a: (events.append("views"), real_views(*a))[1])
    monkeypatch.setattr(readahead, "prefetch", lambda p: (events.append("prefetch"), real_prefetch(p))[1])
    p = start_load(tiny_packed, "cuda", options=LoadOptions(adapt=False))
    p.wait()
    assert events == ["views", "prefetch"]
    events.clear()
    start_load(tiny_packed, "cuda", options=LoadOptions(adapt=False, readahead=False)).wait()
    assert events == ["views"]


@gpu
def test_gpu_held_load_copies_only_after_release(small_hf, tmp_path):
    dest = pack(small_hf, tmp_path / "p", PackOptions(chunk_bytes=65536, progress=False))
    p = start_load(dest, "cuda", options=LoadOptions(threads=2, read_bytes=65536, adapt=False), hold=True)
    import time
    time.sleep(0.2)
    assert not p.done() and "read_copy" not in p.timer.as_dict()
    p.release()
    m = p.wait()
    for name, t in _source(small_hf).items():
        assert torch.equal(_bits(m.tensors[name]), _bits(t)), name
    q = start_load(dest, "cuda", options=LoadOptions(adapt=False), hold=True)
    q.cancel()
    with pytest.raises(RuntimeError, match="cancelled"):
        q.wait()
    assert "read_copy" not in q.timer.as_dict()


@gpu
def test_gpu_torch_copy_path_bit_exact(small_hf, tmp_path, monkeypatch):
    # the path taken where libcudart cannot be bound: torch's own copies and events
    from weights import stream
    monkeypatch.setattr(stream, "cudart", lambda: None)
    dest = pack(small_hf, tmp_path / "p", PackOptions(chunk_bytes=65536, progress=False))
    m = load(dest, "cuda", options=LoadOptions(threads=4, read_bytes=65536))
    for name, t in _source(small_hf).items():
        assert torch.equal(_bits(m.tensors[name]), _bits(t)), name


def test_libcudart_is_bound_once_and_a_miss_is_not_kept(monkeypatch):
    """The loader and the engine's graph upload share one binding; a lookup that found
    nothing (before CUDA was initialised, say) is tried again by the next caller."""
    from weights.cudart import CudaRT
    found: list = [None]
    calls = []

    def find(cls):
        calls.append(1)
        return found[0]
    monkeypatch.setattr(CudaRT, "_shared", None)
    monkeypatch.setattr(CudaRT, "find", classmethod(find))
    assert CudaRT.shared() is None and CudaRT.shared() is None and len(calls) == 2
    found[0] = object.__new__(CudaRT)
    assert CudaRT.shared() is found[0]
    assert CudaRT.shared() is found[0] and len(calls) == 3


@pytest.mark.parametrize("n, chunk", [((3 << 20) + 8192, 1 << 20), (16 << 20, 16 << 20), (4096, 1 << 20)])
@pytest.mark.parametrize("fill", ["random", "ones"])  # all ones: every sum wraps past 2**64
@pytest.mark.filterwarnings("error")  # wrapping is the sum's design: no overflow warning either
def test_the_host_checksum_of_a_transfer_gives_the_index_sums(n, chunk, fill):
    data = torch.randint(0, 256, (n,), dtype=torch.uint8) if fill == "random" else torch.full((n,), 255, dtype=torch.uint8)
    got = checksum.chunk_sums_host(data.numpy(), chunk)
    assert got.dtype == np.int64 and got.tolist() == checksum.chunk_sums_tensor(data, chunk).tolist()
    assert [(a & (2**64 - 1), b & (2**64 - 1)) for a, b in got.tolist()] == chunk_sums(data, chunk)


@gpu
def test_gpu_and_cpu_checksums_agree():
    data = torch.randint(0, 256, ((3 << 20) + 8192,), dtype=torch.uint8)
    assert chunk_sums(data, 1 << 20) == chunk_sums(data.cuda(), 1 << 20)


@gpu
def test_gpu_load_detects_a_corrupt_chunk(tiny_packed, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_packed, d)
    pf = read_packed(d)
    victim = pf.tensors[-1]
    with open(d / "model.cst", "r+b") as f:
        f.seek(PREAMBLE_BYTES + victim.offset)
        b = f.read(1)
        f.seek(PREAMBLE_BYTES + victim.offset)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(PackedFormatError, match=r"checksum mismatch in chunk \d+"):
        load(d, "cuda")
    pending = start_load(d, "cuda")  # the same through a load that runs beside other work
    with pytest.raises(PackedFormatError, match=r"checksum mismatch in chunk \d+"):
        pending.wait()


@gpu
def test_gpu_out_of_memory_refused(tiny_packed):
    free, _ = torch.cuda.mem_get_info()
    with pytest.raises(DeviceMemoryError, match=r"GiB of headroom on cuda:\d, which has"):
        load(tiny_packed, "cuda", options=LoadOptions(headroom_bytes=free))


def test_load_settings_follow_the_page_cache(small_hf, tmp_path):
    from weights.loader import _settings_for_cache
    from weights.readahead import resident_fraction

    dest = pack(small_hf, tmp_path / "p", PackOptions(progress=False))
    pf = read_packed(dest)
    (dest / "model.cst").read_bytes()  # in the page cache
    warm = resident_fraction(pf.path, pf.data_offset, pf.data_bytes)
    if warm is None:
        pytest.skip("mincore(2) is not available here")
    opts = LoadOptions()
    assert warm > 0.9 and _settings_for_cache(pf, opts) == opts
    drop_page_cache([pf.path])
    cold = resident_fraction(pf.path, pf.data_offset, pf.data_bytes)
    if cold >= 0.5:
        pytest.skip("this kernel kept the pages despite POSIX_FADV_DONTNEED")
    chosen = _settings_for_cache(pf, opts)
    assert (chosen.threads, chosen.read_bytes) == (opts.cold_threads, opts.cold_read_bytes)
    # the front half in the page cache (a trickle's work): the rest is still a disk read
    with open(pf.path, "rb") as fh:
        fh.seek(pf.data_offset)
        fh.read(pf.data_bytes // 2)
    half = resident_fraction(pf.path, pf.data_offset, pf.data_bytes)
    if not 0.3 < half < 0.8:
        pytest.skip(f"the kernel read ahead to {half:.0%} of the file")
    chosen = _settings_for_cache(pf, opts)
    assert (chosen.threads, chosen.read_bytes) == (opts.cold_threads, opts.cold_read_bytes)


def _evicted_file(path: Path, size: int) -> Path:
    from weights.readahead import resident_bytes

    with open(path, "wb") as fh:
        fh.write(os.urandom(size))
        fh.flush()
        os.fsync(fh.fileno())
    drop_page_cache([path])
    before = resident_bytes(path, 0, size)
    if before is None:
        pytest.skip("mincore(2) is not available here")
    if before > size // 2:
        pytest.skip("this filesystem kept the pages despite POSIX_FADV_DONTNEED")
    return path


def _wait_resident(path: Path, offset: int, length: int, timeout: float = 30) -> bool:
    """Whether the range came into the page cache: all of it, or all but a 32nd once the timeout
    passed (pages the kernel reclaimed meanwhile, under the memory the rest of the suite holds;
    one read-ahead hint alone brings in 128 KiB of a file, far below that)."""
    import time

    from weights.readahead import resident_bytes

    deadline = time.time() + timeout
    while resident_bytes(path, offset, length) < length and time.time() < deadline:
        time.sleep(0.05)
    return resident_bytes(path, offset, length) >= length - length // 32


def test_prefetch_reads_the_whole_file_into_the_page_cache(tmp_path):
    """One WILLNEED over a whole file reads only read_ahead_kb of it on Linux; the
    prefetch must bring in every byte, while the caller goes on: the reads are a helper
    process's, started and not waited for."""
    import os

    from weights.readahead import prefetch

    size = 48 << 20
    f = _evicted_file(tmp_path / "model.cst", size)
    proc = prefetch(f)
    assert proc is not None and proc.pid != os.getpid() and str(f.resolve()) in proc.args
    assert prefetch(tmp_path) is proc  # the directory's model.cst: the same helper
    assert proc.wait(timeout=60) == 0
    assert _wait_resident(f, 0, size)


def test_prefetch_reads_ahead_at_most_half_the_free_memory(tmp_path, monkeypatch):
    from weights import readahead

    size = 48 << 20
    f = _evicted_file(tmp_path / "model.cst", size)
    monkeypatch.setattr(readahead, "_available_memory", lambda: 32 << 20)  # half: 16 MiB
    assert readahead.prefetch(f).wait(timeout=60) == 0
    assert _wait_resident(f, 0, 16 << 20)
    rest = readahead.resident_bytes(f, 16 << 20, size - (16 << 20))
    assert rest < (size - (16 << 20)) // 4, f"{rest >> 20} MiB past the limit were read ahead"


def test_trickle_reads_the_file_one_piece_at_a_time_and_stops(tmp_path):
    """The trickle brings the whole file into the page cache, in one helper per file; it
    can be stopped (what it read stays); is_cold tells a cold file from a warm one."""
    from weights import readahead

    size = 24 << 20
    f = _evicted_file(tmp_path / "model.cst", size)
    assert readahead.is_cold(tmp_path) and readahead.is_cold(f)
    proc = readahead.trickle(f, piece=1 << 20)
    assert proc is not None and readahead.trickle(tmp_path) is proc  # the directory's model.cst
    assert proc.wait(timeout=60) == 0
    assert _wait_resident(f, 0, size) and not readahead.is_cold(f)
    assert readahead.stop_trickle(f) is False  # it had finished
    assert readahead.stop_trickle(f) is False  # and is forgotten
    # a long one (6144 reads of 4 KiB, one at a time), stopped while it runs
    (tmp_path / "other").mkdir()
    g = _evicted_file(tmp_path / "other" / "model.cst", size)
    slow = readahead.trickle(g, piece=4096)
    assert slow is not None and readahead.stop_trickle(g) is True
    assert slow.poll() is not None
    assert readahead.resident_bytes(g, 0, size) < size
    assert readahead.trickle(tmp_path / "missing") is None and not readahead.is_cold(tmp_path / "missing")


def test_expandable_segments_setting_is_read_from_either_variable():
    from weights.segments import expandable_segments_on
    assert expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert expandable_segments_on({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"})
    assert not expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert not expandable_segments_on({})
    # torch reads PYTORCH_ALLOC_CONF first: where it is set, the older name does not count
    assert not expandable_segments_on({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
                                       "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})


def test_one_segment_turns_expandable_segments_off_only_inside(monkeypatch):
    """Where expandable segments are on, the allocator is told to make plain segments for what
    is allocated inside, and told back afterwards, also when the allocation fails; on the CPU,
    or where they are off, nothing is changed."""
    from weights import loader
    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    # the other options are given both times: torch resets those a settings string leaves out
    conf = "garbage_collection_threshold:0.8,expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    with loader.one_segment(torch.device("cuda", 0)):
        assert calls == ["garbage_collection_threshold:0.8,expandable_segments:False"]
    assert calls == ["garbage_collection_threshold:0.8,expandable_segments:False", conf]
    with pytest.raises(MemoryError):
        with loader.one_segment(torch.device("cuda", 0)):
            raise MemoryError("out of memory")
    assert calls[-1] == conf and len(calls) == 4
    with loader.one_segment(torch.device("cpu")):
        pass
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    with loader.one_segment(torch.device("cuda", 0)):
        pass
    assert len(calls) == 4


ONE_SEGMENT_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from weights.segments import one_segment
dev = torch.device("cuda", 0)
with one_segment(dev):
    big = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
after = torch.empty(3 << 20, dtype=torch.uint8, device=dev)
segs = {s["address"]: s for s in torch.cuda.memory_snapshot()}
def seg(t):
    p = t.data_ptr()
    return next(s for a, s in segs.items() if a <= p < a + s["total_size"])
print(json.dumps({"big": seg(big).get("is_expandable"), "after": seg(after).get("is_expandable"),
                  "zeros": int(big.sum().item())}))
"""


@gpu
def test_one_segment_on_the_gpu(tmp_path):
    """With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a tensor made inside one_segment
    lies in a plain segment and one made after it in an expandable one."""
    import json
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run([sys.executable, "-c", ONE_SEGMENT_SCRIPT, str(root)], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"big": False, "after": True, "zeros": 0}


def test_default_device_is_cuda_where_available_else_cpu(tiny_packed):
    """load(path) with no device: the GPU where torch sees one, the CPU otherwise."""
    m = load(tiny_packed)
    assert m.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert start_load(tiny_packed).wait().device.type == m.device.type


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_asked_for_without_cuda_says_so(tiny_packed, device):
    with pytest.raises(ValueError, match=r"CUDA is not available here.*pass device=\"cpu\""):
        load(tiny_packed, device)
    with pytest.raises(ValueError, match="CUDA is not available here"):
        start_load(tiny_packed, device)
