"""Triton's once-per-process set-up, on a side thread from a replica's first instant.

Before Triton's first launch can even look in its kernel cache, the process must
import Triton, hash Triton's own files and its 400 MB library into every cache key,
find libcuda, and make Triton's CUDA driver object, which loads (on a new node:
compiles) a C helper module and runs ``file`` on the Python executable to key it.
On an H200 host that was 0.22 s of import, 0.26 s of hashing and 0.48 s of driver
on the replica's main thread (bench/results/runs/start-profile-v0-driver-on-main-thread.json).
Hashing, the compiler, the subprocesses and the module loads drop the GIL, so
``start`` runs them while the main thread imports torch; the first self-test of
the kernels calls ``wait``. The hash is kept per node (``kept_triton_key``), and
the driver's C helper is loaded before torch is there: only the driver object
itself, which asks torch whether CUDA is available, waits for the main thread's
``import torch``.

Neither Triton nor this module imports torch (``import torch`` on the side thread
waits for the main thread's); this module imports nothing heavy on purpose.
"""

from __future__ import annotations

import hashlib
import os
import threading

_THREADS: list[threading.Thread] = []


def gpu_expected(device: str) -> bool:
    """Whether a replica on ``device`` ("auto", "cpu", "cuda[:N]") will run on a GPU, as far
    as can be told before importing torch."""
    if device == "cpu":
        return False
    return device.startswith("cuda") or os.path.exists("/dev/nvidiactl")  # auto: an NVIDIA driver is here


def wanted(device: str) -> bool:
    """Whether a replica on ``device`` will launch Triton kernels (``gpu_expected``, and
    env COLDSTART_TRITON is not 0)."""
    return os.environ.get("COLDSTART_TRITON", "1") != "0" and gpu_expected(device)


def start(device: str = "auto") -> threading.Thread | None:
    """Start the side thread (once per process); None where Triton will not be used."""
    if not wanted(device) or _THREADS:
        return None

    def run() -> None:
        try:  # Triton's internals: a release that moved them just gives no head start
            import triton  # noqa: F401
            kept_triton_key()
            from triton.backends.nvidia.driver import CudaUtils, libcuda_dirs
            libcuda_dirs()
            CudaUtils()  # the driver's C helper (a singleton): needs neither torch nor a context
            try:  # what Triton's first launcher imports (46 modules): 0.18 s of the engine's first launch
                import triton.experimental.gluon.nvidia.hopper  # noqa: F401  (bench/results/runs/start-profile-v3-kept-engine.json)
            except ImportError:  # a Triton without it does not import it either
                pass
            import torch  # the main thread's import, once it is done
            if torch.cuda.is_available():  # no CUDA context is made here
                from triton.runtime.driver import driver
                driver.active  # noqa: B018 - made on first access
        except Exception:  # noqa: BLE001 - never fail a replica over a head start
            pass

    t = threading.Thread(target=run, name="triton-head-start", daemon=True)
    t.start()
    _THREADS.append(t)
    return t


def wait(timeout: float = 60.0) -> None:
    """Wait for ``start``'s thread, so that its work is not done twice."""
    for t in _THREADS:
        t.join(timeout)


def kept_dir() -> str | None:
    """Where a replica keeps what it works out once per node (the GEMV verdict, Triton's
    key): beside Triton's compiled kernels, which live as long as the node's (or volume's)
    kernel cache. None (nothing kept) with env COLDSTART_KERNEL_VERDICTS=0."""
    if os.environ.get("COLDSTART_KERNEL_VERDICTS", "1") == "0":
        return None
    from deployments.doctor import triton_cache_dir
    return str(triton_cache_dir(os.environ))


def write_kept(path: str | os.PathLike, text: str) -> OSError | None:
    """Write a file a replica keeps per node (beside Triton's cache) atomically: a reader
    sees the old file, no file, or the whole new one. Returns the error where the directory
    cannot be written (the caller then just works it out again at its next start)."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        os.makedirs(head or ".", exist_ok=True)
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return e
    return None


def _key_signature(root: str) -> str | None:
    """Size and mtime of every file Triton's own key hashes (its compiler, backends and
    language sources, ``runtime/cache.py``, ``_C/libtriton``): a reinstall or an edit of
    any of them changes it. None where Triton's layout is not the expected one."""
    h = hashlib.sha256()
    lib = [f for f in os.listdir(os.path.join(root, "_C")) if f.startswith("libtriton.")] \
        if os.path.isdir(os.path.join(root, "_C")) else []
    if not lib:
        return None
    files = [os.path.join(root, "runtime", "cache.py")] + [os.path.join(root, "_C", f) for f in sorted(lib)]
    for sub in ("compiler", "backends", "language"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, sub)):
            dirnames.sort()
            files += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def kept_triton_key() -> str:
    """Triton's ``triton_key()``, the prefix of every kernel's cache key, kept per node.

    Triton computes it in every process by hashing its own sources and its 400 MB library
    (0.26 s on an H200 host; on a cold page cache, 400 MB read from the disk the weights
    are read from). The key is kept beside Triton's kernel cache in a file named by the
    size and mtime of each file it hashes, and installed as ``triton.runtime.cache.triton_key``
    for this process; a change to Triton gets a new file. Env COLDSTART_KERNEL_VERDICTS=0
    keeps nothing (Triton computes its key as usual)."""
    import triton
    from triton.runtime import cache

    real = cache.triton_key
    where = kept_dir()
    if where is None:
        return real()
    try:
        sig = _key_signature(os.path.dirname(os.path.abspath(triton.__file__)))
    except OSError:
        sig = None
    if sig is None:
        return real()
    path = os.path.join(where, f"coldstart-triton-key-{sig[:32]}.txt")
    try:
        with open(path) as f:
            key = f.read()
    except OSError:
        key = ""
    if not key.startswith(str(triton.__version__)) or len(key) < 64:  # none yet, or torn: made anew
        key = real()
        write_kept(path, key)  # a cache that cannot be written: the next start computes it again
        return key

    def kept() -> str:
        return key
    kept.cache_info = real.cache_info  # type: ignore[attr-defined]  (lru_cache's API, for callers that use it)
    kept.cache_clear = real.cache_clear  # type: ignore[attr-defined]
    kept.kept = True  # type: ignore[attr-defined]
    cache.triton_key = kept
    from triton.runtime import autotuner  # it took the name at import

    if getattr(autotuner, "triton_key", None) is real:
        autotuner.triton_key = kept
    return key
