"""`model.dtype: auto`, `model.attention_impl: auto`, the GPU flags and the CPU compiler options:
the decision on fake platforms, the CPU fallback."""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compiled_dots, tiny_run_overrides, write_corpus
from flax import nnx

from transformer import accelerator, limits, sharding
from transformer.config import Config, ConfigError, DataConfig, ModelConfig, config_changes
from transformer.config_loader import load_config
from transformer.data import prepare
from transformer.model.attention import Attention
from transformer.train.loop import train
from transformer.train.trainer import Trainer, default_controls


def _cfg(document_mask=False, **model) -> Config:
    m = dict(d_model=64, n_heads=4, n_kv_heads=4, dtype="bfloat16", attention_impl="auto") | model
    return Config(model=ModelConfig(**m), data=DataConfig(seq_len=32, document_mask=document_mask))


@pytest.mark.parametrize(
    ("platform", "cfg", "impl", "why"),
    [
        ("gpu", _cfg(), "cudnn", "causal mask"),
        ("gpu", _cfg(window=8), "cudnn", "sliding window 8"),
        ("cpu", _cfg(), "blocked", "measured faster than xla"),
        ("cpu", _cfg(window=8), "blocked", "static mask"),
        ("cpu", _cfg(position="alibi"), "xla", "ALiBi"),
        ("cpu", _cfg(document_mask=True), "xla", "document masks"),
        ("tpu", _cfg(), "xla", "this is tpu"),
        ("gpu", _cfg(dtype="float32"), "xla", "model.dtype"),
        ("gpu", _cfg(head_dim=160), "xla", "head_dim"),
        ("gpu", _cfg(position="alibi"), "xla", "ALiBi"),
        ("gpu", _cfg(position="rope", attention="mla"), "xla", "MLA"),
        ("gpu", _cfg(document_mask=True), "xla", "document masks"),
        ("gpu", _cfg(window=8, attention_pattern=("local", "global")), "xla", "per-layer windows"),
        ("gpu", _cfg(attn_softcap=30.0), "einsum", "attn_softcap"),
        ("gpu", _cfg(arch="encoder", window=8), "xla", "padding are explicit masks"),  # MLM rows carry documents
        ("cpu", _cfg(arch="encoder", window=8), "xla", "padding are explicit masks"),
        ("gpu", _cfg(arch="encoder_decoder"), "xla", "bidirectionally"),
    ],
)
def test_auto_picks_cudnn_only_where_its_masks_and_shapes_allow(platform, cfg, impl, why):
    picked, reason = accelerator.choose_attention(cfg, platform)
    assert (picked, why in reason) == (impl, True), reason
    assert accelerator.resolve(cfg, platform).model.attention_impl == impl
    fixed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl=impl, scan_unroll=1))
    assert accelerator.resolve(fixed, platform) is fixed


@pytest.mark.parametrize(
    ("platform", "dtype", "computed"),
    [
        ("cpu", "auto", "float32"),
        ("gpu", "auto", "bfloat16"),  # bf16 compute, f32 master weights: param_dtype stays float32
        ("tpu", "auto", "bfloat16"),
        ("gpu", "float32", "float32"),  # a dtype the config sets is kept
        ("cpu", "bfloat16", "bfloat16"),
    ],
)
def test_dtype_auto_is_bfloat16_on_accelerators_and_float32_on_a_cpu(platform, dtype, computed):
    cfg = _cfg(dtype=dtype)
    resolved = accelerator.resolve(cfg, platform).model
    assert (resolved.dtype, resolved.compute_dtype, resolved.param_dtype) == (computed, computed, "float32")
    # auto's dtype is what auto's attention is chosen for: cuDNN on a GPU needs the bf16 it settles on
    expected = {"gpu": "cudnn" if computed != "float32" else "xla", "cpu": "blocked", "tpu": "xla"}[platform]
    assert resolved.attention_impl == expected
    # what a run directory records: the dtype settled, the attention implementation still auto's
    settled = accelerator.settle_dtype(cfg, platform).model
    assert (settled.dtype, settled.attention_impl) == (computed, "auto")


def test_an_unresolved_auto_dtype_computes_as_a_cpu_does():
    """A model built straight from a config (a test, a notebook) without `resolve` runs float32 and
    XLA's attention, the reference the other implementations are tested against."""
    assert (ModelConfig().dtype, ModelConfig().attention_impl) == ("auto", "auto")
    assert (ModelConfig().compute_dtype, ModelConfig().attention_kernel) == ("float32", "xla")


def test_an_unresolved_auto_model_keeps_soft_capping():
    """Soft-capping and attention dropout exist only in the einsum implementation: an unresolved
    auto model runs it, as `choose_attention` would pick it, and so computes the cap (a cap of
    1e-3 flattens these logits, which changes the output) exactly as a model that asks for einsum."""
    x_BxTxD = jax.random.normal(jax.random.key(0), (2, 8, 32))
    positions_BxT = jnp.broadcast_to(jnp.arange(8), (2, 8))

    def attention(**model):
        module = Attention(ModelConfig(d_model=32, n_heads=4, max_seq_len=16, **model), rngs=nnx.Rngs(0))
        return module(x_BxTxD, positions_BxT, None, None)[0]

    assert ModelConfig(attn_softcap=0.1).attention_kernel == "einsum"
    assert ModelConfig(attn_dropout=0.1).attention_kernel == "einsum"
    capped, plain = attention(attn_softcap=1e-3), attention()
    np.testing.assert_array_equal(capped, attention(attn_softcap=1e-3, attention_impl="einsum"))
    assert np.max(np.abs(capped - plain)) > 1e-3 * np.max(np.abs(plain))


def test_the_default_config_runs_the_fast_attention_of_each_platform():
    """What a user who sets nothing gets: the blocked attention on a CPU (XLA's took 2.6x the step
    at T=2048) and cuDNN's on a GPU (1.9-3.3x XLA's tokens/s on an H200, and 4-6x less memory on
    the GPT-2 shapes; benchmarks/README.md). A run that saved the former default resumes under it."""
    cfg = load_config(None, [])
    assert cfg.model.attention_impl == "auto"
    assert accelerator.resolve(cfg, "cpu").model.attention_impl == "blocked"
    assert accelerator.resolve(cfg, "gpu").model.attention_impl == "cudnn"
    unsafe, safe = config_changes(load_config(None, ["model.attention_impl=xla"]), cfg)
    assert (unsafe, safe) == ([], ["model.attention_impl: 'xla' -> 'auto'"])


def test_blocked_is_refused_in_a_dtype_its_xla_fallback_cannot_compile():
    """Blocked attention hands explicit masks (KV-cache decoding, documents) to XLA's, which XLA:CPU
    cannot compile in float16: the run is refused before it starts, not at its first generation."""
    if accelerator._backend() != "cpu":
        pytest.skip("the float16 limit is XLA:CPU's")
    with pytest.raises(ConfigError, match=r"^model.dtype: float16 compute is not supported on cpu") as e:
        limits.check_platform(load_config(None, ["model.dtype=float16"]))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("platform", "model", "unroll"),
    [
        ("cpu", dict(n_layers=6), 6),
        ("cpu", dict(n_layers=2, arch="encoder_decoder", n_encoder_layers=5), 5),
        ("gpu", dict(n_layers=6), 1),
        ("tpu", dict(n_layers=6), 1),
        ("cpu", dict(n_layers=6, remat="full"), 1),  # unrolled, remat would save no memory
        ("cpu", dict(n_layers=6, scan_unroll=2), 2),  # a value the config sets is kept
    ],
)
def test_scan_unroll_null_unrolls_the_stack_on_a_cpu_only(platform, model, unroll):
    cfg = Config(model=ModelConfig(**{"attention_impl": "xla", **model}))
    assert accelerator.resolve(cfg, platform).model.scan_unroll == unroll
    assert accelerator.resolve(cfg, platform).model.attention_impl == "xla"


def test_auto_on_cpu_runs_blocked_and_says_so(tmp_path):
    """On CPU auto trains exactly as blocked does (it is blocked), passes the platform check cudnn
    fails, and the start-up line names the pick."""
    corpus = write_corpus(tmp_path / "docs.jsonl", seed=0, n=40)
    base = tiny_run_overrides(corpus, tmp_path / "cache", "model.n_layers=1", "train.steps=2", "model.n_kv_heads=4")
    runs = {}
    for impl in ("auto", "blocked"):  # auto is the default: no key set
        cfg = load_config(None, [*base, *([] if impl == "auto" else [f"model.attention_impl={impl}"])])
        limits.check_platform(cfg)
        data = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
        cfg = cfg.with_vocab(data.vocab_size)
        lines: list[str] = []
        result = train(cfg, data, None, sharding.make_mesh(cfg, jax.devices()[:1]), log=lines.append)
        runs[impl] = (result, lines)
    assert any("attention blocked (auto: CPU, static mask" in line for line in runs["auto"][1])
    assert any("compute float32 (auto)" in line for line in runs["auto"][1])
    assert not any("YNNPACK" in line for line in runs["auto"][1])  # a dense model keeps XLA:CPU's default
    for a, b in zip(jax.tree.leaves(runs["auto"][0].params), jax.tree.leaves(runs["blocked"][0].params)):
        np.testing.assert_array_equal(a, b)


def test_gpu_flags_only_where_a_gpu_will_be_used(monkeypatch):
    assert accelerator.apply_xla_gpu_flags({}) == [] or accelerator.gpu_available({})  # no CUDA plugin here
    monkeypatch.setattr(accelerator.importlib.util, "find_spec", lambda name: object())  # pretend one
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    added = accelerator.apply_xla_gpu_flags(env)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env["XLA_FLAGS"]  # the user's setting wins
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in env["XLA_FLAGS"]
    assert added and all(flag in env["XLA_FLAGS"] for flag in added)
    assert accelerator.apply_xla_gpu_flags({"JAX_PLATFORMS": "cpu"}) == []


def test_a_cpu_step_with_experts_computes_its_dots_by_xla_not_ynnpack():
    """The trainer's steps compile with accelerator.compiler_options: on a CPU no dot of a model with
    experts is left to YNNPACK (whose batched dots run on one thread); a plain jit of the same step
    leaves them there, as the trainer does for a dense model."""
    moe = dict(n_experts=4, top_k=2, capacity_factor=None)
    for experts, options in ((moe, accelerator.CPU_COMPILER_OPTIONS), ({}, {})):
        model = ModelConfig(d_model=32, n_heads=2, n_layers=1, vocab_size=64, **experts)
        cfg = Config(model=model, data=DataConfig(seq_len=16))
        trainer = Trainer(cfg, sharding.make_mesh(cfg, jax.devices()[:1]))
        assert trainer.compiler_options == options
        state = jax.eval_shape(trainer.init, jax.random.key(0))
        batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, 16), jnp.int32) for k in ("inputs", "targets")}
        args = (state, batch, default_controls())
        assert compiled_dots(jax.jit(trainer._train_step).lower(*args).compile().as_text())[0] > 0  # XLA:CPU's default
        assert (compiled_dots(trainer.train_step.lower(*args).compile().as_text())[0] == 0) == bool(options)
        assert (compiled_dots(trainer.eval_step.lower(state.params, batch).compile().as_text())[0] == 0) == bool(
            options
        )


def test_cpu_compiler_options_only_with_experts_on_a_cpu_and_never_against_the_user(monkeypatch):
    moe = Config(model=ModelConfig(n_experts=4, top_k=2))
    assert accelerator.compiler_options(moe, "cpu", {}) == accelerator.CPU_COMPILER_OPTIONS
    assert accelerator.compiler_options(Config(), "cpu", {}) == {}
    assert accelerator.compiler_options(moe, "gpu", {}) == accelerator.compiler_options(moe, "tpu", {}) == {}
    mine = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT"}
    assert accelerator.compiler_options(moe, "cpu", mine) == {}  # XLA_FLAGS' setting wins
    # a jaxlib that does not know the option compiles as before instead of failing
    monkeypatch.setattr(accelerator, "CPU_COMPILER_OPTIONS", {accelerator.CPU_DOTS_OPTION: "NO_SUCH_FUSION_TYPE"})
    monkeypatch.setattr(accelerator, "_cpu_options_accepted", accelerator._cpu_options_accepted.__wrapped__)
    assert accelerator.compiler_options(moe, "cpu", {}) == {}


def _thp(tmp_path, setting: str):
    path = tmp_path / "enabled"
    path.write_text(setting)
    return path


def test_malloc_tunables_add_huge_pages_to_what_the_user_set(tmp_path):
    madvise = _thp(tmp_path, "always [madvise] never\n")
    if accelerator._huge_pages_refused({}, madvise) is not None:
        pytest.skip(accelerator._huge_pages_refused({}, madvise))  # not Linux with glibc >= 2.35
    assert accelerator.malloc_tunables({}, madvise) == accelerator.HUGE_PAGES
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert accelerator.malloc_tunables(mine, madvise) == f"glibc.malloc.arena_max=2:{accelerator.HUGE_PAGES}"
    # nothing to add where the user's word or the machine decides, so no restart
    assert accelerator.malloc_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, madvise) is None
    assert accelerator.malloc_tunables({"GLIBC_TUNABLES": accelerator.HUGE_PAGES}, madvise) is None
    assert accelerator.malloc_tunables({accelerator.HUGE_PAGES_OFF: "0"}, madvise) is None
    assert accelerator.malloc_tunables({}, _thp(tmp_path, "always madvise [never]\n")) is None
    assert accelerator.malloc_tunables({}, tmp_path / "absent") is None


def _meminfo(tmp_path, available_kb: int):
    path = tmp_path / f"meminfo-{available_kb}"
    path.write_text(f"MemTotal:       {4 * available_kb} kB\nMemAvailable:   {available_kb} kB\n")
    return path


def test_the_step_buffer_is_kept_only_where_it_fits_and_a_thread_heap_holds_it(tmp_path):
    if accelerator._glibc_version() is None:
        pytest.skip("not glibc")
    one = {"GLIBC_TUNABLES": accelerator.HUGE_PAGES}

    def refused(temporaries, environ, meminfo, devices=1):
        return accelerator._keeping_refused(temporaries, devices, environ, meminfo)

    small = _meminfo(tmp_path, 200_000)  # 205 MB available: 51 MB for KEEP_COPIES (8) buffers
    assert refused(6_000_000, one, small) is None
    assert "8 of them exceed 1/4 of the 205 MB available" in refused(7_000_000, one, small)
    large = _meminfo(tmp_path, 10_000_000)  # 10.2 GB available: 2.56 GB for KEEP_LARGE_COPIES (2)
    assert refused(60_000_000, one, large) is None
    assert refused(1_000_000, one, large, devices=4) == "4 local devices"  # one device only, as measured
    assert refused(1_000_000, {**one, accelerator.KEEP_BUFFERS_OFF: "0"}, large) == "TRANSFORMER_KEEP_BUFFERS=0"
    mine = {"GLIBC_TUNABLES": "glibc.malloc.mmap_max=4"}
    assert refused(1_000_000, mine, large) == "GLIBC_TUNABLES sets malloc's mapping"
    assert "no MemAvailable" in refused(1_000_000, one, tmp_path / "absent")


def test_a_buffer_too_large_for_a_heap_is_parked_where_the_library_is_preloaded(tmp_path, monkeypatch):
    if accelerator._glibc_version() is None:
        pytest.skip("not glibc")
    one, large = {"GLIBC_TUNABLES": accelerator.HUGE_PAGES}, _meminfo(tmp_path, 10_000_000)
    monkeypatch.setattr(accelerator, "_keep_library_loaded", lambda: True)
    assert accelerator._keeping_refused(70_000_000, 1, one, large) is None
    assert accelerator._keeping_refused(1_200_000_000, 1, one, large) is None
    assert "2 of them exceed 1/4 of the 10,240 MB available" in accelerator._keeping_refused(
        1_300_000_000, 1, one, large
    )
    assert accelerator._keeping_refused(70_000_000, 2, one, large) == "2 local devices"
    monkeypatch.setattr(accelerator, "_keep_library_loaded", lambda: False)
    why = accelerator._keeping_refused(70_000_000, 1, one, large)
    assert why.startswith("above the 64 MiB a thread's malloc heap holds, and keep_blocks.c is not preloaded: ")
    no_compiler = accelerator._keeping_refused(70_000_000, 1, {**one, "CC": str(tmp_path / "no-cc")}, large)
    assert "keep_blocks.c is not preloaded: " in no_compiler and "no-cc" in no_compiler


def _keep_library() -> str:
    library, why = accelerator.keep_library()
    if library is None:
        pytest.skip(f"keep_blocks.c not built here: {why}")
    return str(library)


def test_the_library_hands_a_parked_block_back_to_the_next_allocation_of_its_size():
    """keep_blocks.c, preloaded into a fresh process: switched on, a freed 6 MiB block comes back
    with its contents (the same pages, not a fresh zeroed map) to the next request of its size, not
    to an aligned request its address does not meet, and what stays parked keeps to the budget,
    oldest out first; switched off, or never on, every call is glibc's."""
    import subprocess

    script = """if True:
        import ctypes, sys
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        libc.transformer_keep_blocks.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        def stats():
            out = (ctypes.c_long * 4)()
            libc.transformer_keep_blocks_stats(out)
            return list(out)  # hits, misses, blocks parked, bytes parked
        MiB = 1 << 20
        if sys.argv[1] == "on":
            libc.transformer_keep_blocks(4 * MiB, 20 * MiB)
        p = libc.malloc(6 * MiB)
        ctypes.memset(p, 7, 6 * MiB)
        libc.free(p)
        q = libc.malloc(6 * MiB)
        print("back", q == p, ctypes.string_at(q, 1)[0], stats())
        libc.free(q)
        aligned = ctypes.c_void_p()
        assert libc.posix_memalign(ctypes.byref(aligned), 4096, 5 * MiB) == 0
        print("aligned", aligned.value == q, aligned.value % 4096, stats())
        libc.free(aligned.value)
        small = libc.malloc(3 * MiB)
        libc.free(small)
        print("small", stats())
        big = libc.malloc(12 * MiB)
        libc.free(big)
        print("budget", stats())
        libc.transformer_keep_blocks(4 * MiB, 0)
        print("off", stats())
        r = libc.malloc(12 * MiB)
        libc.free(r)
        print("after", stats())
    """

    def run(mode):
        env = {**os.environ, "LD_PRELOAD": _keep_library()}
        out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        return dict(line.partition(" ")[::2] for line in out.stdout.splitlines())

    MiB = 1 << 20
    on = run("on")
    assert on["back"].startswith("True 7 [1, 1, 0, 0]"), on  # the first 6 MiB missed, the second was served
    # 4096-aligned: the parked block (glibc's mapped block, 16 past a page) does not meet it
    assert on["aligned"].startswith("False 0 [1, 2, 1,"), on
    counts = {key: json.loads(line[line.index("[") :]) for key, line in on.items()}  # hits, misses, blocks, bytes
    hits, _, n, parked = counts["small"]  # 3 MiB: below `from`, neither served nor parked
    assert (hits, n) == (1, 2) and 11 * MiB <= parked < 12 * MiB, on  # the 6 and 5 MiB blocks
    hits, _, n, parked = counts["budget"]
    assert (hits, n) == (1, 2) and 17 * MiB <= parked < 18 * MiB, on  # 6 + 5 + 12 > 20: the oldest, 6, out
    assert counts["off"][2:] == [0, 0] and counts["after"] == counts["off"], on  # off: nothing parked or served
    off = run("off")
    assert off["back"].startswith("False 0 ") or off["back"].startswith("True 0 "), off  # a fresh, zeroed map
    assert all(line.endswith("[0, 0, 0, 0]") for line in off.values()), off


def test_the_restart_preloads_the_library_and_a_large_step_buffer_switches_it_on():
    """train.py's restart (one exec) preloads keep_blocks.c, leaves it out of its children's
    LD_PRELOAD, and `keep_step_buffers` with a 100 MB buffer switches it on: a thread's freed
    100 MB block comes back with its contents. TRANSFORMER_KEEP_BUFFERS=0: nothing preloaded."""
    import subprocess

    _keep_library()
    script = """if True:
        import ctypes, os, threading
        from transformer import accelerator
        accelerator.restart_with_malloc_tunables()
        print("children", os.environ.get("LD_PRELOAD", ""))
        print("line", accelerator.keep_step_buffers(100_000_000))
        if accelerator._keep_library_loaded():
            libc = ctypes.CDLL(None)
            libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
            libc.free.argtypes = [ctypes.c_void_p]
            seen = []
            def step():
                block = libc.malloc(100_000_000)
                seen.append(ctypes.string_at(block, 1)[0])
                ctypes.memset(block, 5, 100_000_000)
                libc.free(block)
            for _ in range(2):
                thread = threading.Thread(target=step)
                thread.start()
                thread.join()
            print("seen", seen)
    """
    environ = {k: v for k, v in os.environ.items() if k not in (accelerator.KEEP_BUFFERS_OFF, "LD_PRELOAD")}
    environ["JAX_PLATFORMS"] = "cpu"
    out = {}
    for mode, env in (("on", environ), ("off", {**environ, accelerator.KEEP_BUFFERS_OFF: "0"})):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        out[mode] = dict(line.partition(" ")[::2] for line in done.stdout.splitlines())
    assert out["on"]["children"] == "", out
    assert "parked between steps (keep_blocks.c, up to 2 of them" in out["on"]["line"], out
    assert out["on"]["seen"] == "[0, 5]", out  # the second step got the first one's pages back
    assert out["off"]["line"].endswith("(TRANSFORMER_KEEP_BUFFERS=0)") and "seen" not in out["off"], out


def test_the_restart_environment_names_the_library_once(tmp_path):
    if accelerator._glibc_version() is None:
        pytest.skip("not glibc")
    library = _keep_library()
    cpu = {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert accelerator.malloc_environment(cpu) == {"LD_PRELOAD": library}
    assert accelerator.malloc_environment({**cpu, "LD_PRELOAD": "/lib/other.so"}) == {
        "LD_PRELOAD": f"/lib/other.so {library}"
    }
    assert accelerator.malloc_environment({**cpu, "LD_PRELOAD": library}) == {}  # ld.so refused it: no loop
    assert accelerator.malloc_environment({**cpu, accelerator.KEEP_BUFFERS_OFF: "0"}) == {}
    none, why = accelerator.keep_library({"CC": str(tmp_path / "no-cc")})
    assert none is None and "no-cc" in why
    none, why = accelerator.keep_library({"CC": "false"})
    assert none is None and why.startswith("false failed"), why


def test_a_kept_buffer_stays_in_the_process_after_it_is_freed():
    """What keeping does: a 48 MB block that a thread frees stays in its malloc heap (the resident
    size keeps it), where without it the block goes back to the kernel: mapped afresh without
    keeping, or its emptied heap unmapped without the top pad (checked: 0 MiB kept then). In a
    fresh process: mallopt is for good."""
    if accelerator._glibc_version() is None:
        pytest.skip("not glibc")
    import subprocess

    script = """if True:
        import ctypes, sys, threading
        from transformer import accelerator
        if sys.argv[1] == "keep":
            accelerator.keep_step_buffers(1)
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        resident = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096

        held = []

        def step():  # as XLA's threads allocate a step's buffer: in their own arenas, past what they hold
            held.append(libc.malloc(24 << 20))  # so the block needs a heap of its own in the arena
            block = libc.malloc(48 << 20)
            ctypes.memset(block, 1, 48 << 20)
            libc.free(block)

        before = resident()
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        print(resident() - before)
    """
    grown = {}
    environ = {k: v for k, v in os.environ.items() if k != accelerator.KEEP_BUFFERS_OFF}  # a user's =0 off
    for mode in ("keep", "map"):
        out = subprocess.run(
            [sys.executable, "-c", script, mode], capture_output=True, text=True, check=True, env=environ
        )
        grown[mode] = int(out.stdout.split()[-1])
    assert grown["keep"] >= 46 << 20 and grown["map"] < 8 << 20, grown


def test_the_start_up_line_says_which_pages_malloc_gets(tmp_path):
    madvise, never = _thp(tmp_path, "[madvise]"), tmp_path / "absent"
    on = {"GLIBC_TUNABLES": accelerator.HUGE_PAGES}
    assert "host memory in transparent huge pages" in accelerator.describe_host_memory(on, madvise)
    assert "as GLIBC_TUNABLES=glibc.malloc.hugetlb=0 says" in accelerator.describe_host_memory(
        {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, madvise
    )
    off = accelerator.describe_host_memory({accelerator.HUGE_PAGES_OFF: "0"}, madvise)
    assert off == f"host memory in 4 KiB pages ({accelerator.HUGE_PAGES_OFF}=0)"
    assert "4 KiB pages" in accelerator.describe_host_memory({}, never)


def test_the_restart_comes_before_the_heavy_imports():
    """train.py and eval.py exec themselves again once (huge pages) after importing the accelerator
    module and nothing else of the package: all a process imports before the exec is paid twice, so
    that module stays on the standard library (numpy, yaml, JAX and the CLI come after)."""
    import subprocess
    import sys

    probe = "import sys, transformer.accelerator; print(sorted({'numpy', 'yaml', 'jax', 'transformer.cli', 'transformer.config'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
