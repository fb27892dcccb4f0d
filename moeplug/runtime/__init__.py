"""Loads the C++ runtime core (``moeplug._runtime_core``) and says how to rebuild it when missing;
the runtime's execution streams and events.

Importing moeplug never needs the extension; the first op that does calls :func:`get_runtime`.
There is deliberately no slow pure-Python fallback: a broken build should fail loudly, once,
with the command that fixes it, rather than silently train 10x slower.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any, Callable

import torch

REBUILD_COMMAND = "pip install -e . --no-build-isolation   (or: pip install -e .)"
CUDA_BUILD_COMMAND = "pip install -e . -Ccmake.define.MOEPLUG_WITH_CUDA=ON   (needs nvcc)"

# dtype codes understood by the C++ kernels (runtime_cpp/include/moeplug/dtype.h).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class RuntimeMissingError(ImportError):
    """The compiled extension ``moeplug._runtime_core`` could not be imported."""


_lock = threading.Lock()
_core: ModuleType | None = None
_failure: RuntimeMissingError | None = None


def get_runtime() -> ModuleType:
    """The imported extension, with its worker pool sized to ``torch.get_num_threads()``."""
    global _core, _failure
    if _core is not None:
        return _core
    with _lock:
        if _core is not None:
            return _core
        if _failure is not None:  # already diagnosed: re-raise the same error, no retry spam
            raise _failure
        try:
            core = importlib.import_module("moeplug._runtime_core")
        except ImportError as exc:
            _failure = RuntimeMissingError(
                f"moeplug's C++ runtime core (moeplug._runtime_core) is not importable: {exc}. "
                f"Fix: rebuild it from the repository root with `{REBUILD_COMMAND}`")
            raise _failure from exc
        # The kernels and torch's intra-op threads take turns (kernels run between GEMMs), so
        # the same count uses every core without oversubscribing.
        core.set_num_threads(max(1, torch.get_num_threads()))
        gomp_parallel = _torch_gomp_parallel()
        if gomp_parallel:
            core.use_openmp(gomp_parallel)
        _core = core
        return core


EXECUTOR_ENV = "MOEPLUG_RUNTIME_EXECUTOR"


def _torch_gomp_parallel() -> int:
    """The address of GOMP_parallel in the libgomp torch has loaded, or 0 (torch not on GNU
    OpenMP, no /proc/self/maps, more than one libgomp mapped, or $MOEPLUG_RUNTIME_EXECUTOR=pool).

    Why the kernels run on torch's OpenMP team: after each op torch's OpenMP workers spin for a
    while (GOMP_SPINCOUNT) before they sleep. Kernels on the runtime's own pool, launched right
    after a GEMM, then shared the cores with spinning threads (3 threads on 2 cores: the SwiGLU
    forward took 8.2 ms a layer against 5.1-5.4 with GOMP_SPINCOUNT=0). On torch's team the
    spinning workers are the ones that take the kernel's chunks."""
    import os
    choice = os.environ.get(EXECUTOR_ENV, "openmp")
    if choice not in ("openmp", "pool"):
        raise ValueError(f"${EXECUTOR_ENV} = {choice!r}: unknown. Fix: set it to 'openmp' (the "
                         f"default: the kernels run on torch's OpenMP threads) or 'pool' (the "
                         f"runtime's own threads)")
    if choice == "pool" or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return 0
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return 0
    # A mapping's path is its sixth field (anonymous mappings have none).
    paths = {fields[5] for fields in map(str.split, maps.splitlines())
             if len(fields) > 5 and os.path.basename(fields[5]).startswith("libgomp")}
    if len(paths) != 1:  # none, or two OpenMP runtimes: which one torch uses is unknown
        return 0
    import ctypes
    try:  # dlopen of a loaded library returns it: the same runtime, the same thread teams
        return ctypes.cast(ctypes.CDLL(paths.pop()).GOMP_parallel, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def core_feature_missing(feature: str, what: str) -> str:
    """"" when the runtime core imports and binds ``feature`` (e.g. "ShmHeap", described as
    ``what``: "the shared-memory heap"), else why not, with the fix: a plugin's availability
    line. Imports the extension alone, without :func:`get_runtime`'s thread setup, so a plugin
    that registers asks this without starting anything (and plugins never import the extension
    themselves: moeplug.api)."""
    try:
        core = importlib.import_module("moeplug._runtime_core")
    except ImportError as exc:
        return f"moeplug's C++ runtime core is not importable: {exc}. Fix: `{REBUILD_COMMAND}`"
    if not hasattr(core, feature):
        return (f"the runtime core was built without {what}. Fix: rebuild it with "
                f"`{REBUILD_COMMAND}`")
    return ""


def retain_freed_memory() -> str:
    """Keep freed host memory in this process for the next allocation (the runtime core's
    ``retain_freed_memory``: glibc's large blocks stop being mmap'd per allocation and unmapped
    on free, so a step's large tensors reuse the last step's pages instead of faulting in fresh
    zeroed ones). Process-wide. "" when applied, else why not (no runtime core, not glibc)."""
    try:
        return get_runtime().retain_freed_memory()
    except RuntimeMissingError as exc:
        return f"the runtime core is missing: {exc}"


def runtime_available() -> bool:
    try:
        get_runtime()
    except RuntimeMissingError:
        return False
    return True


def runtime_info() -> dict[str, Any]:
    """What ``moeplug --version`` prints about the runtime core and its CUDA extension."""
    try:
        info = dict(get_runtime().build_info())
    except RuntimeMissingError as exc:
        return {"available": False, "error": str(exc)}
    info["available"] = True
    # The stash resources a run gets (moeplug.runtime.stash): what the core offers, sized per model.
    from moeplug.config import RuntimeSection
    info["stash_pool"] = (f"paged, contiguous page runs in one 4096-aligned allocation, page "
                          f"{RuntimeSection().stash_page_bytes} B by default "
                          f"(runtime.stash_page_bytes), sized from the registered MoE layers")
    info["cuda_extension"] = cuda_runtime_status()
    from moeplug.runtime.communicators import communicator_status
    info["communicators"] = communicator_status(get_runtime())
    return info


# ---- the CUDA extension -------------------------------------------------------------------
# moeplug._runtime_cuda (runtime_cpp/cuda/) is a separate extension, built only with
# MOEPLUG_WITH_CUDA=ON and imported only when torch sees a GPU: on a CPU machine it is never
# loaded, so a CPU-only box never needs the CUDA driver.
_cuda: ModuleType | None = None


def cuda_extension_built() -> bool:
    """Whether moeplug._runtime_cuda is installed (looked up, not imported)."""
    try:
        return importlib.util.find_spec("moeplug._runtime_cuda") is not None
    except (ImportError, ValueError):
        return False


def get_cuda_runtime() -> ModuleType:
    """The imported ``moeplug._runtime_cuda``; RuntimeMissingError says why it is not loaded."""
    global _cuda
    if _cuda is not None:
        return _cuda
    built = cuda_extension_built()
    if not torch.cuda.is_available():
        raise RuntimeMissingError(
            f"moeplug._runtime_cuda is not loaded: torch sees no GPU "
            f"(torch.cuda.is_available() is False; extension {'built' if built else 'not built'})")
    if not built:
        raise RuntimeMissingError(
            f"moeplug._runtime_cuda is not built (the default pip build is CPU-only). "
            f"Fix: `{CUDA_BUILD_COMMAND}`")
    try:
        _cuda = importlib.import_module("moeplug._runtime_cuda")
    except ImportError as exc:
        raise RuntimeMissingError(f"moeplug._runtime_cuda is built but does not import: {exc}. "
                                  f"Fix: rebuild it with `{CUDA_BUILD_COMMAND}`") from exc
    return _cuda


def runtime_for(t: torch.Tensor) -> tuple[ModuleType, dict[str, Any]]:
    """The runtime whose kernels take ``t``'s device, and the extra keyword arguments its
    kernels need there: none on the CPU; on a GPU, torch's current stream of that device."""
    if t.device.type == "cpu":
        return get_runtime(), {}
    return get_cuda_runtime(), {"stream": torch.cuda.current_stream(t.device).cuda_stream}


def cuda_runtime_status() -> str:
    """One line for ``moeplug --version``: loaded (with its build) or not loaded and why."""
    try:
        info = get_cuda_runtime().build_info()
    except RuntimeMissingError as exc:
        return str(exc)
    return (f"loaded (CUDA runtime {info['cuda_runtime']}, "
            f"architectures {info['cuda_architectures']})")


def dtype_code(t: torch.Tensor, op: str, name: str) -> int:
    """The kernel dtype code of ``t``; errors name the op, the argument and the fix."""
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; the runtime kernels take float32 or "
                        f"bfloat16. Fix: cast with {name}.float() or {name}.bfloat16()")
    return code


# ---- streams and events -------------------------------------------------------------------
# A runtime stream is a FIFO work queue with its own C++ worker thread (runtime_cpp/.../stream.h):
# kernels on two streams run at the same time, kernels on one stream run in order, and
# `other.wait(stream.record())` orders work across streams. Kernels run without the GIL.
#
#     comm = stream("comm")
#     comm.launch("permute", x, ids, x_SD, row_map, counts, x=x.data_ptr(), ...)  # async
#     done = comm.record()
#     stream("compute").wait(done)   # compute's later work starts after the permute
#     done.synchronize()             # blocks; raises KernelError naming the failed kernel
#     with comm:                     # launch(...) below goes to comm instead of running inline
#         launch("swiglu_forward", h, a, h=h.data_ptr(), ...)
#
# Launches take the kernel's raw-pointer arguments (the ones get_runtime().<kernel> takes) plus
# the tensors behind those pointers as positional `keep` arguments: the stream holds them until
# the kernel has run, so a caller cannot free memory a queued kernel still reads. Reading the
# outputs is the caller's business: wait on an event first, as with CUDA streams.
# moeplug.ops calls its kernels inline on the calling thread; it does not consult the current
# stream yet, and `moeplug train` does not use streams yet.

_streams: dict[str, "Stream"] = {}
_streams_lock = threading.Lock()  # not _lock: stream() calls get_runtime(), which takes _lock
_current = threading.local()  # .stack: the streams entered with `with stream:` on this thread


class Stream:
    """A named runtime-owned execution queue; get one with :func:`stream`."""

    def __init__(self, core_stream: Any):
        self._core = core_stream

    @property
    def name(self) -> str:
        return self._core.name

    def __repr__(self) -> str:
        return f"moeplug.runtime.Stream({self.name!r})"

    def launch(self, kernel: str, *keep: torch.Tensor, **args: Any) -> None:
        """Queue runtime kernel ``kernel`` (e.g. "permute") with its raw-pointer ``args``;
        ``keep`` (the tensors behind the pointers) stays alive until it has run."""
        enqueue = getattr(self._core, f"enqueue_{kernel}", None)
        if enqueue is None:
            known = sorted(n[len("enqueue_"):] for n in dir(self._core) if n.startswith("enqueue_"))
            raise ValueError(f"Stream.launch: kernel {kernel!r} is not a runtime kernel. "
                             f"Fix: use one of {', '.join(known)}")
        enqueue(**args, keep=keep)

    def call(self, fn: Callable[[], Any], name: str = "") -> None:
        """Queue the Python callable ``fn()`` (it runs on the stream's thread, holding the GIL)."""
        self._core.call(fn, name)

    def record(self) -> Any:
        """An event that completes once everything queued so far has run."""
        return self._core.record()

    def wait(self, event: Any) -> None:
        """Work queued after this call starts only once ``event`` (from any stream) completed."""
        self._core.wait(event)

    def synchronize(self) -> None:
        """Block until the queue is empty; raise the stream's KernelError (and clear it)."""
        self._core.synchronize()

    def __enter__(self) -> "Stream":
        stack = getattr(_current, "stack", None)
        if stack is None:
            stack = _current.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _current.stack.pop()


def stream(name: str) -> Stream:
    """The runtime stream called ``name`` (same name -> same stream), created on first use."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"stream: name must be a non-empty string, got {name!r}. "
                         f"Fix: pass e.g. stream('comm')")
    with _streams_lock:
        s = _streams.get(name)
        if s is None:
            if not _streams:
                atexit.register(drain_streams)
            s = _streams[name] = Stream(get_runtime().stream(name))
        return s


def current_stream() -> Stream | None:
    """The innermost stream entered with ``with stream:`` on this thread (None: run inline)."""
    stack = getattr(_current, "stack", None)
    return stack[-1] if stack else None


def launch(kernel: str, *keep: torch.Tensor, **args: Any) -> None:
    """Run runtime kernel ``kernel`` on the current stream (queued) or, outside any
    ``with stream:``, right now on the calling thread."""
    s = current_stream()
    if s is not None:
        s.launch(kernel, *keep, **args)
        return
    fn = getattr(get_runtime(), kernel, None)
    if fn is None or not hasattr(get_runtime().Stream, f"enqueue_{kernel}"):
        raise ValueError(f"launch: kernel {kernel!r} is not a runtime kernel. "
                         f"Fix: use one of the Stream.enqueue_* names without the prefix")
    fn(**args)


def drain_streams() -> None:
    """Run what every stream holds to the end (at exit: queued Python callables must not run
    while the interpreter shuts down; a process leaving through os._exit calls it first)."""
    for s in list(_streams.values()):
        try:
            s.synchronize()
        except RuntimeError as exc:  # an error nobody synchronized on: say so, don't lose it
            print(f"moeplug: unreported runtime stream error at exit: {exc}", file=sys.stderr)


def __getattr__(name: str) -> Any:
    # KernelError and Event live in the extension, which is loaded on first use.
    if name in ("KernelError", "Event"):
        return getattr(get_runtime(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RuntimeMissingError", "REBUILD_COMMAND", "get_runtime", "runtime_available",
           "core_feature_missing",
           "runtime_info", "dtype_code", "CUDA_BUILD_COMMAND", "cuda_extension_built",
           "get_cuda_runtime", "cuda_runtime_status", "Stream", "stream", "current_stream",
           "launch", "drain_streams"]
