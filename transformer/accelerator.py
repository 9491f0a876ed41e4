"""Choices that depend on the accelerator, made in one place: the compute dtype `model.dtype: auto`
runs, which attention implementation `model.attention_impl: auto` runs, how many layers each
iteration of the layer scan runs (`model.scan_unroll: null`), the XLA flags a GPU run gets, and the
compiler options a CPU run's steps compile with (`compiler_options`).

The model is built from `resolve(cfg)`, and the run's start-up line says what was picked and why.
The config a run directory saves records the dtype `auto` chose (`settle_dtype`), so that a run
started on a CPU in float32 is refused, naming `model.dtype`, rather than resumed in bfloat16 on a
GPU; the attention implementation and the scan's unroll stay `auto` there (every implementation
computes the same attention; they differ in rounding, as two machines do).

Compute dtype (`model.dtype: auto`, the default): float32 on a CPU (see `choose_dtype`); bfloat16 on a GPU or TPU, with parameters and optimiser state kept in
`param_dtype` (float32 by default): bf16 compute with f32 master weights, as MaxText and Levanter run.
Softmax, norms and the logits are float32 either way. So the same config trains float32 numbers on a
laptop and bf16 ones on a GPU; a comparison that must hold the numerics fixed across machines sets
`model.dtype` explicitly. The start-up line says which dtype a run computes in.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.native import compile_library, kernel_cache

if TYPE_CHECKING:  # stdlib only at import: train.py and eval.py restart before their heavier imports
    from transformer.config import Config

# XLA flags for GPU runs (JAX-Toolbox's image default, MaxText's GPU configs): overlap collectives
# with compute (the latency-hiding scheduler, pipelined FSDP all-gathers / reduce-scatters and data
# parallel all-reduces), and double-buffer the layer scan's while loop so the next layer's weights
# are fetched while this one computes. Flags the user already set in XLA_FLAGS win.
XLA_GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
# XLA:CPU (jaxlib 0.10) hands dots and reductions to YNNPACK. YNNPACK computes a batched dot's items
# one after another, each on one thread while it is small (below ~16 MFLOP), where XLA's own dot
# (Eigen) splits an item of ~4 MFLOP over the cores. The experts' blocks of a mixture are such items:
# a CPU step with experts compiles without YNNPACK fusions (an empty list of fusion kinds; leaving it
# the reductions still hands it the dots fused into them). Measured faster with dropless dispatch
# (capacity dispatch: unchanged within the noise); for a dense model it was mixed, so it keeps the
# default (benchmarks/README.md, "Dots on a CPU"). An option XLA_FLAGS already sets wins.
CPU_DOTS_OPTION = "xla_cpu_experimental_ynn_fusion_type"
CPU_COMPILER_OPTIONS = {CPU_DOTS_OPTION: ""}
# glibc's malloc asking the kernel for transparent huge pages (glibc >= 2.35): see `malloc_tunables`
HUGE_PAGES = "glibc.malloc.hugetlb=1"
HUGE_PAGES_OFF = "TRANSFORMER_HUGE_PAGES"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# glibc's mallopt parameters (malloc.h), for keeping a CPU step's buffer: see `keep_step_buffers`
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
KEEP_BUFFERS_OFF = "TRANSFORMER_KEEP_BUFFERS"
KEEP_SHARE = 4  # what keeping may add (KEEP_COPIES buffers) may take up to 1/KEEP_SHARE of the memory available
# a copy kept in the heap of each thread that ran a step: peak RSS grew by 0.0-0.28 GB (up to 7.5
# buffers) for cpu-study's 37 MB one (train.py, benchmarks/README.md, "Keeping the step's buffer")
KEEP_COPIES = 8
# a thread's malloc arena grows in heaps of 64 MiB and maps any block above that whatever `mallopt`
# says (one arena for all threads would keep them, but slowed a dropless MoE step by 40%); it
# unmaps a heap that falls empty unless the top pad is as large
THREAD_HEAP = 64 << 20
MEMINFO = Path("/proc/meminfo")
# a buffer above THREAD_HEAP: parked between steps by a library preloaded into train.py and eval.py
KEEP_LIBRARY = Path(__file__).with_name("keep_blocks.c")
KEEP_LIBRARY_BUILT = f"{KEEP_LIBRARY.stem}-"  # how its built copies' names start (keep_library)
KEEP_LIBRARY_FLAGS = ("-O2", "-fPIC", "-shared", "-pthread")
KEEP_LIBRARY_ON = "transformer_keep_blocks"  # its switch (keep_blocks.c)
MMAP_CEILING = 32 << 20  # glibc maps every block above this afresh (its mmap threshold's 64-bit maximum)
KEEP_LARGE_COPIES = 2  # what the library may hold parked: two step buffers
# objectives whose batches carry segment ids (documents, padding) whatever data.document_mask says
SEGMENTED = ("mlm", "seq2seq", "prefix")


def gpu_available(environ=os.environ) -> bool:
    """Will JAX use a GPU? Known without starting a backend (XLA_FLAGS must be set before that):
    a CUDA plugin is installed and JAX_PLATFORMS, if set, allows it."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    return any(importlib.util.find_spec(name) is not None for name in CUDA_PLUGINS)


def apply_xla_gpu_flags(environ=os.environ) -> list[str]:
    """Add XLA_GPU_FLAGS to XLA_FLAGS when a GPU will be used (before JAX starts); the ones added."""
    if not gpu_available(environ):
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f for f in XLA_GPU_FLAGS if f.split("=")[0] not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def _huge_pages_refused(environ, thp: Path) -> str | None:
    """Why a CPU run's malloc does not get huge pages here (None: it can)."""
    if environ.get(HUGE_PAGES_OFF, "1") == "0":
        return f"{HUGE_PAGES_OFF}=0"
    if gpu_available(environ):
        return "a GPU run (measured on CPU runs only)"
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    version = _glibc_version()
    if version is None or version < (2, 35):
        return f"malloc is not glibc >= 2.35 ({'glibc ' + '.'.join(map(str, version)) if version else 'another libc'})"
    try:
        if "[never]" in thp.read_text():
            return "transparent huge pages are off in this kernel (never)"
    except OSError:
        return f"no {thp}"
    return None


def _glibc_version() -> tuple[int, ...] | None:
    """(2, 36) under glibc 2.36; None under another libc, or off Linux."""
    if sys.platform != "linux":
        return None
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""  # "glibc 2.36"; another libc (musl) raises
    except (ValueError, OSError):
        return None
    return tuple(int(part) for part in libc.split()[-1].split(".")[:2]) if libc.startswith("glibc ") else None


def malloc_tunables(environ=os.environ, thp: Path = THP_SETTING) -> str | None:
    """GLIBC_TUNABLES for a CPU run, with malloc's transparent huge pages added to what it holds;
    None where they are there already or do nothing here (`_huge_pages_refused`).

    Why: XLA:CPU allocates a step's temporaries as one buffer (474 MB at benchmarks/vs_pytorch.py's
    t128), above glibc's 32 MiB ceiling for reusing freed memory, so malloc maps it afresh each step
    and the kernel faults it in page by page: 121,000 faults of 4 KiB and 0.23 s of system time a
    step there, a fifth of the step's time on two cores. In 2 MiB pages that is ~250x fewer faults;
    the bare step was 9-14% faster on five shapes (benchmarks/README.md, "Huge pages")."""
    current = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current or _huge_pages_refused(environ, thp) is not None:
        return None
    return ":".join(part for part in (current, HUGE_PAGES) if part)


def malloc_environment(environ=os.environ, thp: Path = THP_SETTING) -> dict[str, str]:
    """What `restart_with_malloc_tunables` adds to the environment of a CPU run: GLIBC_TUNABLES
    (`malloc_tunables`), and LD_PRELOAD with the library that keeps large step buffers
    (keep_blocks.c, off until `keep_step_buffers` switches it on) where it can be built and is not
    loaded yet. Empty where there is nothing to add."""
    changes = {}
    tunables = malloc_tunables(environ, thp)
    if tunables is not None:
        changes["GLIBC_TUNABLES"] = tunables
    if _preload_refused(environ) is None and not _keep_library_loaded():
        library, _ = keep_library(environ)
        preloaded = environ.get("LD_PRELOAD", "")
        if library is not None and str(library) not in preloaded:  # in it already: ld.so refused it, no second exec
            changes["LD_PRELOAD"] = " ".join(part for part in (preloaded, str(library)) if part)
    return changes


def _preload_refused(environ) -> str | None:
    """Why train.py does not preload keep_blocks.c here (None: it does)."""
    if environ.get(KEEP_BUFFERS_OFF, "1") == "0":
        return f"{KEEP_BUFFERS_OFF}=0"
    if gpu_available(environ):
        return "a GPU run"
    if _glibc_version() is None:
        return "not glibc's malloc"
    return None


def _keep_library_loaded() -> bool:
    """Is keep_blocks.c in this process (preloaded: loaded later, it would not see glibc's calls)?"""
    return _glibc_version() is not None and hasattr(ctypes.CDLL(None), KEEP_LIBRARY_ON)


def keep_library(environ=os.environ) -> tuple[Path | None, str]:
    """(keep_blocks.c built, "") or (None, why it cannot be): compiled on first use by the machine's
    C compiler (`$CC`, else `cc`) and cached in `kernel_cache()`, named by a hash of the source, the
    compiler, its flags and glibc's version."""
    compiler = environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None, "no C compiler (set CC)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        key = "\0".join((KEEP_LIBRARY.read_text(), version, " ".join(KEEP_LIBRARY_FLAGS), str(_glibc_version())))
        target = kernel_cache() / f"{KEEP_LIBRARY_BUILT}{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        failure = (
            None if target.exists() else compile_library([compiler, *KEEP_LIBRARY_FLAGS, str(KEEP_LIBRARY)], target)
        )
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{compiler}: {e}"
    return (None, failure) if failure else (target, "")


def restart_with_malloc_tunables(hold: tuple[signal.Signals, ...] = ()) -> None:
    """Re-execute this Python command with `malloc_environment()` set, where it adds something:
    glibc reads its tunables once, when a process starts, and only a preloaded library replaces
    its malloc. An exec, before anything but imports has run: the same process id, arguments and
    standard streams. The signals in `hold` are blocked across it, so one that arrives meanwhile
    waits, pending, for the new image to install its handler and unblock them. For train.py and
    eval.py's own processes: a process that imported the package (a notebook, the tests) is never
    replaced. Once the library is in, it is taken out of LD_PRELOAD again, so the processes this
    one starts (a compiler, a sweep's members) start without it."""
    if _keep_library_loaded():
        kept = [
            part
            for part in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
            if KEEP_LIBRARY_BUILT not in part
        ]
        if kept:
            os.environ["LD_PRELOAD"] = " ".join(kept)
        else:
            os.environ.pop("LD_PRELOAD", None)
    changes = malloc_environment()
    if not changes:
        return
    os.environ.update(changes)
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_BLOCK, hold)
    os.execv(sys.executable, sys.orig_argv)


def keep_step_buffers(temporaries: int, devices: int = 1, environ=os.environ, meminfo: Path = MEMINFO) -> str:
    """Have malloc keep a CPU step's temporaries (`temporaries` bytes a device, on `devices` local
    devices) from now on, where they fit (`_keeping_refused`); what the start-up line says of it.


    Why: a buffer above glibc's 32 MiB ceiling is mapped afresh at every allocation and returned to
    the kernel when freed, so every step the kernel clears its pages again (13% of a cpu-study
    step's samples under `perf`) and frees them (a periodic stall with huge pages). Heap memory is
    reused instead: no `mmap` for large blocks, no trimming of a heap's top, a top pad that keeps a
    thread's emptied heap. The cost is memory: each heap holds what it held at its peak, a copy of
    the buffer in each thread that ran a step (the bound counts KEEP_COPIES). Decided at run time
    (`mallopt`), once the compiled step says how large its buffer is (benchmarks/README.md,
    "Keeping the step's buffer").

    A heap cannot hold a buffer of THREAD_HEAP or more: such a one is parked by keep_blocks.c, which
    train.py and eval.py preload, switched on here. Up to KEEP_LARGE_COPIES buffers' worth of freed
    blocks above glibc's MMAP_CEILING are held, each handed back to the next allocation of its size
    (benchmarks/README.md, "Parking the large buffers")."""
    why = _keeping_refused(temporaries, devices, environ, meminfo)
    if why is None and temporaries >= THREAD_HEAP:
        switch = getattr(ctypes.CDLL(None), KEEP_LIBRARY_ON)
        switch.argtypes, switch.restype = [ctypes.c_size_t, ctypes.c_size_t], None
        switch(MMAP_CEILING, KEEP_LARGE_COPIES * temporaries)
        return f"the step's temporaries ({_megabytes(temporaries)}) parked between steps (keep_blocks.c, up to {KEEP_LARGE_COPIES} of them; {KEEP_BUFFERS_OFF}=0: not)"
    if why is None:
        libc = ctypes.CDLL(None)
        done = [
            libc.mallopt(M_MMAP_MAX, 0),
            libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1),
            libc.mallopt(M_TOP_PAD, THREAD_HEAP),
        ]
        if not all(done):
            why = "mallopt refused"
    if why is not None:
        return f"the step's temporaries ({_megabytes(temporaries)}) mapped afresh each step ({why})"
    return f"the step's temporaries ({_megabytes(temporaries)}) kept by malloc between steps (a copy per thread that runs steps; {KEEP_BUFFERS_OFF}=0: not)"


def _keeping_refused(temporaries: int, devices: int, environ, meminfo: Path) -> str | None:
    """Why a CPU run's malloc does not keep the step's buffer here (None: it does)."""
    if environ.get(KEEP_BUFFERS_OFF, "1") == "0":
        return f"{KEEP_BUFFERS_OFF}=0"
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{name}" in tunables for name in ("mmap_max", "trim_threshold")):
        return "GLIBC_TUNABLES sets malloc's mapping"
    if _glibc_version() is None:
        return "not glibc's malloc"
    try:
        available = next(
            int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:")
        )
    except (OSError, StopIteration, ValueError, IndexError):
        return f"no MemAvailable in {meminfo}"
    if devices > 1:  # measured on one device only; the several-device tests then saw a collective time out
        return f"{devices} local devices"
    copies = KEEP_LARGE_COPIES if temporaries >= THREAD_HEAP else KEEP_COPIES
    if copies * temporaries > available // KEEP_SHARE:
        return f"{copies} of them exceed 1/{KEEP_SHARE} of the {_megabytes(available)} available"
    if temporaries >= THREAD_HEAP and not _keep_library_loaded():
        why = keep_library(environ)[1] or "train.py and eval.py preload it, this process was started otherwise"
        return (
            f"above the {THREAD_HEAP >> 20} MiB a thread's malloc heap holds, and keep_blocks.c is not preloaded: {why}"
        )
    return None


def _megabytes(n: int) -> str:
    return f"{n / 1e6:,.0f} MB" if n >= 1e7 else f"{n / 1e6:.2g} MB"


def describe_host_memory(environ=os.environ, thp: Path = THP_SETTING) -> str:
    """What a CPU run's start-up line says of malloc's pages."""
    current = environ.get("GLIBC_TUNABLES", "")
    if HUGE_PAGES in current:
        return f"host memory in transparent huge pages (GLIBC_TUNABLES={current})"
    if "glibc.malloc.hugetlb" in current:
        return f"host memory as GLIBC_TUNABLES={current} says"
    why = _huge_pages_refused(environ, thp) or "GLIBC_TUNABLES unset: train.py sets it, an imported trainer does not"
    return f"host memory in 4 KiB pages ({why})"


def compiler_options(cfg: Config, platform: str, environ=os.environ) -> dict[str, str]:
    """The XLA options a run's jitted steps compile with on `platform`: CPU_COMPILER_OPTIONS for a
    model with experts on a CPU, unless XLA_FLAGS names the option itself or this jaxlib does not
    know it (the option is experimental: without it a step compiles as before rather than fails);
    none otherwise."""
    if platform != "cpu" or cfg.model.n_experts == 0 or CPU_DOTS_OPTION in environ.get("XLA_FLAGS", ""):
        return {}
    return dict(CPU_COMPILER_OPTIONS) if _cpu_options_accepted() else {}


@functools.cache
def _cpu_options_accepted() -> bool:
    import jax
    import jax.numpy as jnp

    try:
        x = jnp.zeros(2, device=jax.devices("cpu")[0])
        jax.jit(jnp.sum, compiler_options=CPU_COMPILER_OPTIONS).lower(x).compile()
    except Exception:  # jaxlib refuses an option it does not have (INVALID_ARGUMENT, by name)
        return False
    return True


def choose_dtype(cfg: Config, platform: str) -> str:
    """The compute dtype `model.dtype: auto` runs on `platform`: bfloat16 on a GPU or TPU, whose
    matrix units are built for it; float32 on a CPU, where bfloat16 buys little (XLA:CPU's bf16 step
    took 0.99x and 0.94x of the float32 one's time on the default and 6-layer presets,
    benchmarks/README.md) and first looks and the tests compare exact numbers."""
    if cfg.model.dtype != "auto":
        return cfg.model.dtype
    return "float32" if platform == "cpu" else "bfloat16"


def _blocked_on_cpu(cfg: Config, dtype: str) -> str:
    """Why blocked attention on a CPU, and what computes it there (the fused kernel, or why not)."""
    from transformer.model import describe_cpu_attention  # the model's, imported only where asked for

    m = cfg.model
    heads = (m.qk_head_dim, m.v_head_dim) if m.attention == "mla" else (m.head_dim,)
    # Measured (benchmarks/README.md): XLA's blocks as fast as xla at T=256, 2.7x the train step at
    # T=2048; the fused kernel 1.8-3.0x faster than XLA's blocks
    kernel = describe_cpu_attention(heads, dtype)
    return f"CPU, static mask: blocked attention, measured faster than xla (skips masked blocks); {kernel}"


def choose_attention(cfg: Config, platform: str) -> tuple[str, str]:
    """(implementation, why) that `model.attention_impl: auto` runs on `platform` (jax's backend
    name: cpu, gpu, tpu): cuDNN's fused flash attention on a GPU and the blocked one (model/flash.py)
    on a CPU where their masks and shapes allow, else XLA's (einsum where only it has the feature
    asked for)."""
    m = cfg.model
    dtype = choose_dtype(cfg, platform)
    if m.needs_einsum_attention:
        return "einsum", "attn_softcap and attn_dropout need the einsum implementation"
    mask_reasons = [
        (m.position == "alibi", "ALiBi adds a bias the cuDNN and blocked paths are not used with here"),
        (m.position == "t5_relative", "T5's relative bias is one the cuDNN and blocked paths are not used with here"),
        (
            cfg.data.document_mask or cfg.data.objective in SEGMENTED,
            "document masks and padding are explicit masks, not a static causal/window mask",
        ),
        (
            m.attention_pattern is not None and m.scan_layers,
            "per-layer windows inside the layer scan are traced, an explicit mask",
        ),
    ]
    if platform == "cpu":
        because = next((why for refused, why in mask_reasons if refused), None)
        return ("xla", because) if because is not None else ("blocked", _blocked_on_cpu(cfg, dtype))
    reasons = [
        (platform != "gpu", f"cuDNN attention needs a GPU, this is {platform}"),
        (dtype == "float32", "cuDNN attention needs bfloat16 or float16 compute (model.dtype)"),
        (
            m.head_dim % 8 != 0 or m.head_dim > 128,
            f"cuDNN flash attention needs head_dim <= 128, a multiple of 8, not {m.head_dim}",
        ),
        *mask_reasons,
        (m.attention == "mla", "MLA's keys and values differ in width, which the cuDNN path is not used with here"),
        (
            m.arch != "decoder",
            f"{m.arch} models attend bidirectionally (and across, to the encoder), which the cuDNN path is not used with here",
        ),
    ]
    for refused, why in reasons:
        if refused:
            return "xla", why
    window = f", sliding window {m.window}" if m.window else ""
    return "cudnn", f"GPU, {dtype}, causal mask{window}"


def choose_unroll(cfg: Config, platform: str) -> int:
    """Layers per iteration of the layer scan that `model.scan_unroll: null` runs on `platform`: the
    whole stack on a CPU, where XLA's scan copies every layer's saved activations into a zero-filled
    stack and back (measured ~10% of the step at 6 layers, benchmarks/README.md; the compile takes
    ~2x at 32 layers); one layer elsewhere (compile time flat in depth), and wherever `model.remat`
    is on: unrolled, XLA:CPU keeps the activations remat was asked to drop (measured: no memory saved)."""
    m = cfg.model
    return m.deepest_stack if platform == "cpu" and m.remat == "none" else 1


def settle_dtype(cfg: Config, platform: str | None = None) -> Config:
    """`cfg` with `model.dtype: auto` decided for `platform` (default: JAX's backend); the rest as it is."""
    if cfg.model.dtype != "auto":
        return cfg
    model = dataclasses.replace(cfg.model, dtype=choose_dtype(cfg, platform or _backend()))  # type: ignore[arg-type]
    return dataclasses.replace(cfg, model=model)


def _backend() -> str:
    import jax

    return jax.default_backend()


def resolve(cfg: Config, platform: str | None = None) -> Config:
    """`cfg` with what it leaves to the platform (`model.dtype: auto`, `model.attention_impl: auto`,
    `model.scan_unroll: null`) decided by `choose_dtype`, `choose_attention` and `choose_unroll` for
    `platform` (default: JAX's backend); a config that leaves nothing open as it is."""
    m = cfg.model
    if m.dtype != "auto" and m.attention_impl != "auto" and m.scan_unroll is not None:
        return cfg
    platform = platform or _backend()
    impl = choose_attention(cfg, platform)[0] if m.attention_impl == "auto" else m.attention_impl
    unroll = choose_unroll(cfg, platform) if m.scan_unroll is None else m.scan_unroll
    settled = dataclasses.replace(m, dtype=choose_dtype(cfg, platform), attention_impl=impl, scan_unroll=unroll)  # type: ignore[arg-type]
    return dataclasses.replace(cfg, model=settled)
