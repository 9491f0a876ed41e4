"""Fused flash attention on a CPU: the forward and backward passes each one C++ kernel
(`flash_cpu.cc`), called through XLA's FFI.

Why. XLA:CPU runs the blocked attention of flash.py as separate ops: each block's two products
handed to YNNPACK, and between them the exponentials, the masking, the slices and the head-major
transposes, each a pass through memory, with the two cores often idle between ops. PyTorch's CPU
attention is one fused kernel, and was 1.6-2.6x faster than XLA's blocks in both passes (Intel
Xeon, B2/T2048 to B32/T128). This kernel is that kind: per query block (forward) or per kv head
(backward) it keeps its operands in one piece each, computes the products with a register-blocked
microkernel, the softmax online, and runs its items on XLA's own intra-op threads. Measured:
benchmarks/README.md, "The fused CPU attention".

Built on first use rather than at install, so that it always matches the jaxlib it runs in: the
machine's C++ compiler (`$CXX`, else `c++`) against the FFI headers of the installed jaxlib
(`jax.ffi.include_dir()`), with `-march=native`; the library is cached under
`$TRANSFORMER_KERNEL_CACHE` (default `~/.cache/transformer-ablations/kernels`), named by a hash of
the source, jaxlib's version, the compiler, its flags and the CPU. Where it cannot be built, or
with `TRANSFORMER_FUSED_ATTENTION=0`, `kernel_status()` says why and flash.py computes with XLA's blocks.

Scope: float32, the static masks of flash.Mask, head widths a multiple of the vector width the
kernel was built with (16 floats with AVX-512, else 8). Each (row, kv head)'s result depends on
that row and head alone, so it does not change with the batch, the threads or the mesh: in a
sharded step each device computes its own rows and kv heads (`layers.on_each_device`; XLA cannot
split a custom call itself and would compute it whole on every device).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from transformer.native import compile_library, kernel_cache

if TYPE_CHECKING:
    from transformer.model.flash import Mask

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("flash_cpu.cc")
FLAGS = ("-O3", "-std=gnu++17", "-fPIC", "-shared")
NATIVE = "-march=native"  # dropped where the compiler refuses it, except on x86 (see `_build`)
OFF = "TRANSFORMER_FUSED_ATTENTION"
FORWARD, BACKWARD = "transformer_flash_cpu_forward", "transformer_flash_cpu_backward"


class Unavailable(Exception):
    """The kernel cannot be built or loaded here (the message says why)."""


def _cpu_identity() -> str:
    """What -march=native compiles for: a library built on another CPU may not run on this one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    failure = compile_library([compiler, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE)], target)
    if failure is not None:
        raise Unavailable(failure)


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise Unavailable("no C++ compiler (set CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    failure = None
    # Without -march=native an x86 build has only SSE2's 4-float vectors: 2.3x slower than XLA's
    # blocks at B2/T2048 (449 ms against 198; AVX2 118, AVX-512 83), so it is not built. Elsewhere
    # (ARM) the baseline has the vectors the kernel is written for.
    baseline = () if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") else (FLAGS,)
    for flags in ((*FLAGS, NATIVE), *baseline):
        key = hashlib.sha256(
            b"\0".join(
                s.encode() for s in (SOURCE.read_text(), jaxlib.__version__, version, " ".join(flags), _cpu_identity())
            )
        ).hexdigest()[:16]
        target = kernel_cache() / f"flash_cpu-{key}.so"
        if target.exists():
            return target
        try:
            _compile(compiler, flags, target)
            return target
        except Unavailable as e:
            failure = failure or e
    raise failure or Unavailable("not built")


@functools.cache
def _library() -> tuple[int, str]:
    """(the vector width, 0 where unavailable; what the start-up line says of the kernel)."""
    if os.environ.get(OFF, "1") == "0":
        return 0, f"{OFF}=0"
    try:
        path = _build()
        try:
            lib = ctypes.cdll.LoadLibrary(str(path))
        except OSError:  # a damaged file in the cache: built again, once
            path.unlink(missing_ok=True)
            lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(FORWARD, jax.ffi.pycapsule(lib.FlashForward), platform="cpu")
        jax.ffi.register_ffi_target(BACKWARD, jax.ffi.pycapsule(lib.FlashBackward), platform="cpu")
        width = int(lib.FlashVectorWidth())
    except (Unavailable, OSError, subprocess.SubprocessError) as e:
        log.warning("fused CPU attention unavailable, XLA's blocks instead: %s", e)
        return 0, f"not built ({e})"
    return width, f"fused kernel (model/flash_cpu.cc, {width}-float vectors)"


def kernel_status() -> tuple[bool, str]:
    """(whether the kernel is built and loaded here, a phrase saying which or why not)."""
    width, why = _library()
    return width > 0, why


def describe_cpu_attention(head_dims: tuple[int, ...], dtype: str) -> str:
    """What computes the blocked attention on this CPU for these query/key and value head widths and
    this compute dtype: the start-up line's words."""
    width, why = _library()
    if width == 0:
        return f"XLA's blocks, the fused kernel {why}"
    if dtype != "float32":
        return f"XLA's blocks (the fused kernel computes float32, not {dtype})"
    odd = [h for h in head_dims if h % width]
    if odd:
        return f"XLA's blocks (head width {odd[0]} is not a multiple of the fused kernel's {width})"
    return f"the {why}"


def supports(q_BxTxKxGxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array) -> bool:
    """Does the kernel compute this call: float32, head widths a multiple of its vector width, the
    default backend a CPU?"""
    if jax.default_backend() != "cpu":
        return False
    if any(a.dtype != jnp.float32 for a in (q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH)):
        return False
    width = _library()[0]
    return width > 0 and q_BxTxKxGxH.shape[-1] % width == 0 and v_BxSxKxH.shape[-1] % width == 0


def _attrs(scale: float, mask: Mask) -> dict:
    return {"scale": np.float32(scale), "causal": bool(mask.causal), "window": np.int64(mask.window or 0)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def attention(
    q_BxTxKxGxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, scale: float, mask: Mask
) -> jax.Array:
    """softmax(q k^T * scale, masked by `mask`) v per query head: out [B, T, K, G, Hv] (see flash.py)."""
    return _fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask)[0]


def _fwd(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, scale, mask):
    B, T, K, G, _ = q_BxTxKxGxH.shape
    out_BxTxKxGxH, lse_BxKxGxT = jax.ffi.ffi_call(
        FORWARD,
        (
            jax.ShapeDtypeStruct((B, T, K, G, v_BxSxKxH.shape[-1]), jnp.float32),
            jax.ShapeDtypeStruct((B, K, G, T), jnp.float32),
        ),
        vmap_method="sequential",
    )(q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, **_attrs(scale, mask))
    return out_BxTxKxGxH, (q_BxTxKxGxH, k_BxSxKxH, v_BxSxKxH, out_BxTxKxGxH, lse_BxKxGxT)


def _bwd(scale, mask, residuals, dout_BxTxKxGxH):
    q, k, v = residuals[:3]
    return tuple(
        jax.ffi.ffi_call(
            BACKWARD,
            tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (q, k, v)),
            vmap_method="sequential",
        )(*residuals, dout_BxTxKxGxH, **_attrs(scale, mask))
    )


attention.defvjp(_fwd, _bwd)
