import functools
import math
import textwrap
from pathlib import Path

import pytest
import yaml

from transformer.config import DEFAULT_CONFIG, Config, ConfigError, ModelConfig
from transformer.config_loader import from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_CONFIGS = sorted(ROOT.glob("configs/**/*.yaml"))


def load(*overrides: str, path: Path | None = None) -> Config:
    return load_config(path, list(overrides))


def load_error(*overrides: str, path: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path)
    return info.value


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def get(cfg: Config, key: str):
    return functools.reduce(getattr, key.split("."), cfg)


# --- inheritance ---------------------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """root.yaml <- a/mid.yaml <- a/b/leaf.yaml, each `base:` relative to its own file."""
    write(
        tmp_path / "root.yaml",
        """
        model:
          d_model: 256
          n_layers: 8
          n_heads: 8
          window: 64
          attention_pattern: [local, local, global]
        train:
          steps: 100
          batch_size: 32
        """,
    )
    write(
        tmp_path / "a" / "mid.yaml",
        """
        base: ../root.yaml
        model:
          n_layers: 6
          attention_pattern: [local, global]
        train:
          steps: 200
        """,
    )
    return write(
        tmp_path / "a" / "b" / "leaf.yaml",
        """
        base: ../mid.yaml
        model:
          n_layers: 2
        optim:
          lr: 1.0e-3
        """,
    )


def test_base_chain_merges_child_over_parent(chain, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path / "a")
    cfg = load(path=chain)
    assert cfg.model.n_layers == 2
    assert cfg.model.d_model == 256
    assert cfg.model.n_heads == 8
    assert cfg.model.window == 64
    assert cfg.model.attention_pattern == ("local", "global")
    assert cfg.train.steps == 200
    assert cfg.train.batch_size == 32
    assert cfg.optim.lr == 0.001
    assert cfg.optim.warmup_steps == Config().optim.warmup_steps


def test_overrides_apply_on_top_of_inherited_values(chain):
    cfg = load("model.n_layers=5", "train.batch_size=8", path=chain)
    assert (cfg.model.n_layers, cfg.model.d_model) == (5, 256)
    assert (cfg.train.batch_size, cfg.train.steps) == (8, 200)


def test_base_can_point_at_the_shipped_default(tmp_path):
    child = write(tmp_path / "child.yaml", f"base: {DEFAULT_CONFIG}\nmodel:\n  n_layers: 3\n")
    cfg = load(path=child)
    assert cfg.model.n_layers == 3
    assert cfg.train.steps == load().train.steps


@pytest.mark.parametrize(
    "files, cycle",
    [
        ({"a.yaml": "base: b.yaml", "b.yaml": "base: a.yaml"}, "a.yaml -> b.yaml -> a.yaml"),
        ({"a.yaml": "base: a.yaml"}, "a.yaml -> a.yaml"),
    ],
    ids=["a-b-a", "self"],
)
def test_inheritance_cycle_is_refused(tmp_path, files, cycle):
    for name, text in files.items():
        write(tmp_path / name, text)
    error = load_error(path=tmp_path / "a.yaml")
    assert error.key == "base"
    assert "cycle" in error.message
    assert cycle in error.message


def test_missing_base_names_the_file(tmp_path):
    child = write(tmp_path / "child.yaml", "base: missing.yaml\n")
    message = str(load_error(path=child))
    assert "missing.yaml" in message
    assert "child.yaml" in message


def test_missing_config_file_names_the_file(tmp_path):
    assert "nope.yaml" in str(load_error(path=tmp_path / "nope.yaml"))


@pytest.mark.parametrize("via_base", [False, True])
def test_invalid_yaml_names_file_and_line(tmp_path, via_base):
    bad = write(tmp_path / "bad.yaml", "# comment\nmodel:\n\td_model: 3\n")
    path = write(tmp_path / "child.yaml", "base: bad.yaml\n") if via_base else bad
    message = str(load_error(path=path))
    assert f"{bad}:3" in message


def test_unknown_key_in_a_file_is_reported_with_its_dotted_path(tmp_path):
    path = write(tmp_path / "c.yaml", "model:\n  n_head: 4\n")
    error = load_error(path=path)
    assert error.key == "model.n_head"
    assert "model.n_heads" in error.message


def test_file_that_is_not_a_mapping_is_refused(tmp_path):
    with pytest.raises(ConfigError):
        load(path=write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_empty_file_gives_schema_defaults(tmp_path):
    assert load(path=write(tmp_path / "empty.yaml", "")) == Config()


# --- overrides -----------------------------------------------------------------------------------


OVERRIDES = [
    (["model.window=64", "model.window=null"], "model.window", None),
    (["optim.clip_norm=null"], "optim.clip_norm", None),
    (["optim.lr=3e-4"], "optim.lr", 0.0003),
    (["optim.lr=1.5e-3"], "optim.lr", 0.0015),
    (["model.dropout=0"], "model.dropout", 0.0),
    (["model.window=8", "model.attention_pattern=[local,global]"], "model.attention_pattern", ("local", "global")),
    (["model.n_layers=2.0"], "model.n_layers", 2),
    (["model.qk_norm=true"], "model.qk_norm", True),
    (["data.cache_dir=some/dir"], "data.cache_dir", "some/dir"),
    (["train.seed=7", "train.seed=8"], "train.seed", 8),
]


@pytest.mark.parametrize("overrides, key, expected", OVERRIDES, ids=[" ".join(case[0]) for case in OVERRIDES])
def test_override_values_are_parsed_as_yaml_and_coerced(overrides, key, expected):
    value = get(load(*overrides), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.n_layers=abc", "model.n_layers"),
        ("model.n_layers=true", "model.n_layers"),
        ("model.n_layers=2.5", "model.n_layers"),
        ("model.n_layers=[2]", "model.n_layers"),
        ("optim.lr=abc", "optim.lr"),
        ("optim.lr=false", "optim.lr"),
        ("model.qk_norm=3", "model.qk_norm"),
        ("data.source=7", "data.source"),
        ("model.window=abc", "model.window"),
        ("model=3", "model"),
    ],
)
def test_override_of_wrong_type_is_refused(override, key):
    assert load_error(override).key == key


@pytest.mark.parametrize(
    "override", ["model.n_layers", "model.window", "=3", "model..n_layers=3", ".n_layers=3", "model.=3"]
)
def test_malformed_override_is_refused(override):
    assert override in str(load_error(override))


def test_override_into_a_value_is_refused():
    assert load_error("model.d_model.x=1", "model.d_model=64").key == "model.d_model"


# --- validation ----------------------------------------------------------------------------------

INVALID = [
    (["model.n_head=4"], "model.n_head", "model.n_heads"),
    (["model.layers=2"], "model.layers", "model.n_layers"),
    (["train.lr=0.1"], "train.lr", "optim.lr"),
    (["train.warmup_steps=10"], "train.warmup_steps", "optim.warmup_steps"),
    (["nosuchsection.x=1"], "nosuchsection", "unknown"),
    (["model.n_layers=abc"], "model.n_layers", "abc"),
    (["model.dropout=1.5"], "model.dropout", "1.5"),
    (["train.steps=0"], "train.steps", ">= 1"),
    (["model.window=0"], "model.window", ">= 1"),
    (["optim.lr=0"], "optim.lr", "> 0"),
    (["model.n_kv_heads=3"], "model.n_kv_heads", "multiple"),
    (["model.n_kv_heads=8"], "model.n_kv_heads", "n_heads"),
    (["model.head_dim=7"], "model.head_dim", "even"),
    (
        ["model.position=sinusoidal", "model.d_model=129", "model.n_heads=3", "model.n_kv_heads=3"],
        "model.d_model",
        "even",
    ),
    (["model.attention_pattern=[local,global]"], "model.attention_pattern", "model.window"),
    (["model.window=64", "model.attention_pattern=[local,foo]"], "model.attention_pattern[1]", "foo"),
    (["model.window=64", "model.attention_pattern=[]"], "model.attention_pattern", "at least one"),
    (["model.rope_local_theta=1e4"], "model.rope_local_theta", "model.window"),
    (["model.position=t5_relative", "model.rel_buckets=1"], "model.rel_buckets", ">= 2"),
    (["model.encoder_positions=true", "model.position=learned"], "model.encoder_positions", "encoder_decoder"),
    (["model.window=64", "model.rope_local_theta=1e4", "model.position=alibi"], "model.rope_local_theta", "rope"),
    (["model.window=64", "model.rope_local_theta=0"], "model.rope_local_theta", "> 0"),
    (["model.norm_bias=false"], "model.norm_bias", "layernorm"),
    (["model.first_attn_norm=false", "model.norm_position=post"], "model.first_attn_norm", "pre"),
    (["model.first_attn_norm=false", "model.n_experts=2"], "model.first_attn_norm", "dense"),
    (["model.mlm_head_bias=false"], "model.mlm_head_bias", "mlm_head"),
    (["model.rope_beta_fast=16"], "model.rope_beta_fast", "yarn"),
    (["model.rope_local_scaling=false", "model.window=8"], "model.rope_local_scaling", "rope_scaling"),
    (["model.rope_local_scaling=false", "model.rope_scaling=linear"], "model.rope_local_scaling", "window"),
    (["model.rope_attention_factor=1.1"], "model.rope_attention_factor", "yarn"),
    (["model.rope_scaling=yarn", "model.rope_beta_slow=40"], "model.rope_beta_fast", "exceed"),
    (["model.rope_scaling=yarn", "model.rope_attention_factor=0"], "model.rope_attention_factor", "> 0"),
    (["model.rope_scaling=yarn", "model.window=8", "model.rope_local_theta=1e3"], "model.rope_local_theta", "yarn"),
    (["mesh.tensor=3"], "mesh.tensor", "model.n_heads"),
    (["data.seq_len=512", "model.max_seq_len=256"], "data.seq_len", "model.max_seq_len"),
    (["train.grad_accum=3"], "train.grad_accum", "batch_size"),
    (["model.attention_impl=xla", "model.attn_softcap=30"], "model.attn_softcap", "einsum"),  # auto picks einsum
    (["model.attention_impl=cudnn", "model.dtype=float32"], "model.attention_impl", "model.dtype"),
    (["data.prefetch=-1"], "data.prefetch", "must be >= 0"),
    (["model.norm_position=sandwhich"], "model.norm_position", "did you mean sandwich?"),
    (["model.norm=batchnorm"], "model.norm", "layernorm, rmsnorm"),
    (["model.n_heads=3", "model.n_kv_heads=3"], "model.n_heads", "model.head_dim"),
]


@pytest.mark.parametrize("overrides, key, fragment", INVALID, ids=[" ".join(case[0]) for case in INVALID])
def test_invalid_config_names_the_key(overrides, key, fragment):
    error = load_error(*overrides)
    assert error.key == key
    assert fragment in error.message
    assert str(error) == f"{key}: {error.message}"


def test_misspelled_section_suggests_the_section():
    error = load_error("modle.n_layers=2")
    assert error.key == "modle"
    assert "model" in error.message


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("model.norm_position=prenorm", "pre"),
        ("model.norm_position=postnorm", "post"),
        ("model.ffn=swiglue", "swiglu"),
        ("model.position=ropes", "rope"),
    ],
)
def test_unknown_choice_lists_choices_and_suggests_the_closest(override, suggestion):
    key, value = override.split("=")
    error = load_error(override)
    assert error.key == key
    assert repr(value) in error.message
    assert f"did you mean {suggestion}?" in error.message


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.n_heads=8", "model.n_kv_heads=2", "mesh.tensor=2"],
        ["model.n_kv_heads=1"],
        ["model.window=32", "model.attention_pattern=[local,global]"],
        ["model.attention_impl=einsum", "model.attn_softcap=50"],
        ["model.attention_impl=cudnn", "model.dtype=bfloat16"],
        ["model.position=sinusoidal", "model.d_model=96", "model.n_heads=3", "model.n_kv_heads=3"],
        ["model.n_heads=3", "model.n_kv_heads=3", "model.head_dim=32"],
        ["train.grad_accum=4"],
    ],
    ids=" ".join,
)
def test_valid_combinations_load(overrides):
    assert isinstance(load(*overrides), Config)


def test_learned_positions_take_max_seq_len_from_data():
    cfg = load("model.position=learned", "data.seq_len=128")
    assert cfg.model.max_seq_len == 128


# --- round trip and derived values ---------------------------------------------------------------

NONTRIVIAL = [
    "model.n_heads=8",
    "model.n_kv_heads=2",
    "model.window=64",
    "model.attention_pattern=[local,local,global]",
    "model.ffn=gelu",
    "model.norm_position=deepnorm",
    "model.attention_impl=einsum",
    "model.attn_softcap=30.0",
    "optim.lr=3e-4",
    "optim.clip_norm=null",
    "data.cache_dir=some/cache",
    "checkpoint.async=false",
    "mesh.tensor=2",
]


@pytest.mark.parametrize("overrides", [[], NONTRIVIAL], ids=["default", "nontrivial"])
def test_resolved_config_round_trips_through_yaml(overrides, tmp_path):
    cfg = load(*overrides)
    assert from_dict(yaml.safe_load(cfg.to_yaml())) == cfg
    assert load(path=write(tmp_path / "resolved.yaml", cfg.to_yaml())) == cfg


def test_nontrivial_overrides_took_effect():
    cfg = load(*NONTRIVIAL)
    assert cfg.model.attention_pattern == ("local", "local", "global")
    assert cfg.optim.clip_norm is None
    assert cfg.checkpoint.async_ is False
    assert cfg.to_dict()["checkpoint"]["async"] is False


def test_default_config_is_the_shipped_file():
    assert load() == load(path=ROOT / "configs" / "default.yaml")


def test_n_kv_heads_defaults_to_n_heads():
    assert ModelConfig(n_heads=8).n_kv_heads == 8
    assert load("model.n_heads=8", "model.n_kv_heads=null").model.n_kv_heads == 8


@pytest.mark.parametrize(
    "kwargs, head_dim", [(dict(d_model=128, n_heads=8), 16), (dict(d_model=128, n_heads=8, head_dim=32), 32)]
)
def test_head_dim(kwargs, head_dim):
    assert ModelConfig(**kwargs).head_dim == head_dim


@pytest.mark.parametrize(
    "d_model, ffn, ffn_multiple, d_ff",
    [
        (128, "gelu", 64, 512),
        (128, "relu", 64, 512),
        (96, "relu", 32, 384),
        (128, "swiglu", 64, 384),
        (128, "geglu", 64, 384),
        (128, "reglu", 64, 384),
        (96, "swiglu", 32, 256),
        (64, "swiglu", 64, 192),
        (64, "swiglu", 1, 171),
    ],
)
def test_d_ff_default(d_model, ffn, ffn_multiple, d_ff):
    assert ModelConfig(d_model=d_model, n_heads=4, ffn=ffn, ffn_multiple=ffn_multiple).d_ff == d_ff


def test_explicit_d_ff_is_kept():
    assert ModelConfig(d_ff=100).d_ff == 100


def test_max_seq_len_is_filled_from_data_seq_len():
    assert load("data.seq_len=128").model.max_seq_len == 128
    assert load("data.seq_len=128", "model.max_seq_len=512").model.max_seq_len == 512


@pytest.mark.parametrize(
    "vocab_size, multiple, padded", [(259, 64, 320), (256, 64, 256), (259, 1, 259), (50257, 128, 50304)]
)
def test_padded_vocab(vocab_size, multiple, padded):
    assert ModelConfig(vocab_size=vocab_size, vocab_multiple=multiple).padded_vocab == padded


@pytest.mark.parametrize(
    "kwargs, windows",
    [
        (dict(n_layers=5, window=64, attention_pattern=("local", "local", "global")), (64, 64, None, 64, 64)),
        (dict(n_layers=3, window=32), (32, 32, 32)),
        (dict(n_layers=2), (None, None)),
    ],
)
def test_layer_windows(kwargs, windows):
    assert ModelConfig(**kwargs).layer_windows == windows


@pytest.mark.parametrize(
    "n_layers, alpha, beta", [(2, math.sqrt(2), 0.5), (8, 2.0, 2**-1.5), (32, 2 * math.sqrt(2), 0.25)]
)
def test_deepnorm_constants(n_layers, alpha, beta):
    cfg = ModelConfig(n_layers=n_layers)
    assert cfg.deepnorm_alpha == pytest.approx(alpha)
    assert cfg.deepnorm_beta == pytest.approx(beta)
    assert cfg.deepnorm_alpha == pytest.approx((2 * n_layers) ** 0.25)
    assert cfg.deepnorm_beta == pytest.approx((8 * n_layers) ** -0.25)


# --- the data source ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("builtin:stdlib", dict(kind="builtin", name="stdlib")),
        ("hf:someone/thing", dict(kind="hf", name="someone/thing", config=None)),
        ("hf:someone/thing:sub", dict(kind="hf", name="someone/thing", config="sub")),
        ("files:~/corpus/**/*.txt", dict(kind="files", glob="~/corpus/**/*.txt")),
        ("files:C:/data", dict(kind="files", glob="C:/data")),  # only the first colon separates the kind
    ],
)
def test_the_data_source_is_parsed_once_into_its_parts(text, expected):
    source = load(f"data.source={text}").data.source_spec
    assert source.text == text
    assert {k: getattr(source, k) for k in expected} == expected
    assert source.recall is None


def test_a_recall_source_carries_its_task():
    from transformer.synthetic import RecallTask

    source = load("data.source=builtin:recall:pairs=4,distance=16").data.source_spec
    assert (source.kind, source.name) == ("builtin", "recall")
    assert source.recall == RecallTask(pairs=4, distance=16)
    assert load("data.source=builtin:recall").data.source_spec.recall == RecallTask()


# --- shipped configs -----------------------------------------------------------------------------


def test_shipped_configs_are_found():
    assert ROOT / "configs" / "default.yaml" in SHIPPED_CONFIGS


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=[str(p.relative_to(ROOT)) for p in SHIPPED_CONFIGS])
def test_shipped_config_loads(path):
    from transformer.config_loader import load_raw
    from transformer.sweep import expand

    raw = load_raw(path)
    if "sweep" in raw:  # a study: every member is a valid config
        assert all(isinstance(m.config, Config) for m in expand(raw, str(path)).members)
    else:
        assert isinstance(load(path=path), Config)


def _int_keys() -> list[str]:
    """Every key of the schema whose value is an integer (or an integer or null)."""
    import dataclasses
    import typing

    from transformer.config_loader import all_keys

    def annotation(key: str):
        cls: typing.Any = Config
        for part in key.split("."):
            hints = typing.get_type_hints(cls)
            (field,) = [f for f in dataclasses.fields(cls) if f.metadata.get("key", f.name) == part]
            cls = hints[field.name]
        return cls

    return [k for k in all_keys() if int in (annotation(k), *typing.get_args(annotation(k)))]


@pytest.mark.parametrize("key", _int_keys())
def test_integers_beyond_32_bits_are_refused_naming_the_key(key):
    """JAX holds steps, seeds and sizes as int32: 2**31 would overflow (or hang) far from the config."""
    error = load_error(f"{key}={2**31}")
    assert error.key == key
    assert "32-bit" in error.message and "2,147,483,648" in error.message


def test_the_integer_keys_include_steps_seeds_and_sizes():
    assert {"optim.warmup_steps", "train.steps", "train.seed", "model.d_model", "faults.nan_step"} <= set(_int_keys())


@pytest.mark.parametrize("axis", ["fsdp", "tensor"])
def test_a_second_filled_mesh_axis_is_the_one_named(axis):
    error = load_error(f"mesh.{axis}=-1")
    assert error.key == f"mesh.{axis}"
    assert "mesh.data is -1 too" in error.message


# --- hostile files and values --------------------------------------------------------------------


def _alias_bomb(levels: int = 9) -> str:
    """A 'billion laughs' flow sequence of 9**levels values in a few hundred bytes: level i is
    level i - 1 (defined in place, anchored) followed by eight aliases of it."""
    text = "&l0 [" + ",".join(["lol"] * 9) + "]"
    for i in range(1, levels):
        text = f"&l{i} [{text}," + ",".join([f"*l{i - 1}"] * 8) + "]"
    return text


def test_an_alias_bomb_in_an_override_is_refused_before_it_expands():
    error = load_error(f"model.attention_pattern={_alias_bomb()}")
    assert error.key == "model.attention_pattern"
    assert "aliases expand to more than" in error.message


def test_an_alias_bomb_in_a_file_is_refused_before_it_expands(tmp_path):
    path = write(tmp_path / "bomb.yaml", f"model:\n  attention_pattern: {_alias_bomb()}\n")
    error = load_error(path=path)
    assert str(path) in str(error) and "aliases expand to more than" in str(error)


def test_an_alias_that_contains_itself_is_refused(tmp_path):
    error = load_error(path=write(tmp_path / "loop.yaml", "model:\n  attention_pattern: &p [local, *p]\n"))
    assert "refers to a node that contains it" in str(error)


def test_ordinary_aliases_still_work(tmp_path):
    cfg = load(path=write(tmp_path / "alias.yaml", "model:\n  n_layers: &n 4\n  n_heads: *n\n"))
    assert (cfg.model.n_layers, cfg.model.n_heads) == (4, 4)


SECRET = "root:$6$saltsalt$SECRETHASH0123:19000:0:99999:7:::\n*secretalias:x\n"


@pytest.mark.parametrize(
    "content",
    [SECRET, SECRET.splitlines()[0] + "\n", "SECRET_KEY: hunter2\n", "*secretalias\n", b"\xff\xfeSECRETHASH\x00"],
    ids=["shadow", "shadow-line", "env-file", "alias-only", "binary"],
)
def test_a_base_that_is_no_config_is_refused_without_quoting_it(tmp_path, content):
    secret = tmp_path / "secret"
    if isinstance(content, bytes):
        secret.write_bytes(content)
    else:
        secret.write_text(content)
    error = load_error(path=write(tmp_path / "child.yaml", f"base: {secret}\n"))
    message = str(error)
    assert "\n" not in message and str(secret) in message
    for fragment in ("SECRETHASH", "secretalias", "SECRET_KEY", "hunter2", "root:"):
        assert fragment not in message, message


def test_a_misspelled_section_in_a_file_is_still_suggested(tmp_path):
    error = load_error(path=write(tmp_path / "typo.yaml", "modle:\n  n_layers: 2\n"))
    assert error.key == "modle" and "did you mean model?" in error.message


def test_a_config_path_longer_than_the_file_system_allows_is_one_line():
    error = load_error(path=Path("x" * 300 + ".yaml"))
    assert "File name too long" in str(error)


def test_a_config_file_too_large_to_be_one_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * 200_000)
    assert "a config file is at most" in str(load_error(path=big))


def test_the_document_separator_and_val_source_keys():
    cfg = load('data.document_separator="\\n\\n"', "data.val_source=files:val/*.txt")
    assert cfg.data.document_separator == "\n\n" and cfg.data.val_source == "files:val/*.txt"
    assert load().data.document_separator is None and load().data.val_source is None
    assert load_error('data.document_separator=""').key == "data.document_separator"
    for bad in ("data.val_source=nowhere:x", "data.val_source=builtin:nope", "data.val_source=files:"):
        error = load_error(bad)
        assert error.key == "data.val_source" and str(error).startswith("data.val_source:"), str(error)


# --- data.mixture ---------------------------------------------------------------------------------

MIXTURE = "data.mixture=[{source: 'files:code/*.py', weight: 0.7, name: code}, {source: builtin:stdlib, weight: 0.3}]"


def test_mixture_entries_are_typed_and_fall_back_to_the_data_section():
    cfg = load(MIXTURE, "data.text_field=body")
    code, _ = cfg.data.mixture
    assert (code.source, code.weight, code.name) == ("files:code/*.py", 0.7, "code")
    assert cfg.data.mixture_names == ["code", "source1"]
    assert cfg.data.mixture_source(0).text_field == "body"
    assert cfg.data.mixture_source(0).mixture == ()
    # what config.yaml holds reads back as the same config
    assert from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["data.mixture=[{source: 'files:a', weight: -0.5}]"], "data.mixture[0].weight", ">= 0"),
        (["data.mixture=[{source: 'files:a', weight: .inf}]"], "data.mixture[0].weight", "expected a number"),
        (["data.mixture=[{source: 'files:a', weight: 0}, {source: 'files:b', weight: 0}]"], "data.mixture", "all zero"),
        (["data.mixture=[{source: 'files:a'}, {source: 'nope:b'}]"], "data.mixture[1].source", "must start with"),
        (["data.mixture=[{source: 'files:a'}, {source: 'hf:'}]"], "data.mixture[1].source", "names no dataset"),
        (["data.mixture=[{source: 'files:a', name: x}, {source: 'files:b', name: x}]"], "data.mixture", "named 'x'"),
        (["data.mixture=[{source: 'files:a', name: 'a b'}]"], "data.mixture[0].name", "names metrics"),
        (["data.mixture=[{weight: 1}]"], "data.mixture[0].source", "required"),
        (["data.mixture=[{source: 'files:a', wieght: 1}]"], "data.mixture[0].wieght", "data.mixture[0].weight?"),
        (["data.mixture=[{source: 'files:a'}]", "data.source=files:b"], "data.mixture", "data.source"),
        (["data.mixture=[{source: 'files:a'}]", "data.val_source=files:b"], "data.mixture", "val_source"),
        (["data.mixture={source: 'files:a'}"], "data.mixture", "a list of"),
        (
            ["data.mixture=[{source: 'files:a', weight: 1e308}, {source: 'files:b', weight: 1e308}]"],
            "data.mixture",
            "sum",
        ),
        (["data.mixture=[{source: 'files:a'}, {source: 'builtin:seq2seq'}]"], "data.mixture[1].source", "pairs"),
        (
            ["data.mixture=[{source: 'hf:a'}]", "data.input_field=a", "data.target_field=b"],
            "data.input_field",
            "mixture",
        ),
    ],
    ids=[
        "negative-weight",
        "infinite-weight",
        "all-zero",
        "bad-source",
        "empty-hf-name",
        "duplicate-names",
        "unsafe-name",
        "no-source",
        "misspelled-key",
        "with-data-source",
        "with-val-source",
        "not-a-list",
        "weights-sum-to-infinity",
        "pairs-source",
        "pair-fields",
    ],
)
def test_mixture_mistakes_name_the_key(overrides, key, fragment):
    error = load_error(*overrides)
    assert error.key == key
    assert fragment in str(error) and "\n" not in str(error)


@pytest.mark.slow
def test_mixture_mistake_exits_2_with_one_line():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "train.py", "data.mixture=[{source: 'files:a', weight: -1}]", "--dry-run"],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "data.mixture[0].weight" in result.stderr


# --- model families and their objectives ---------------------------------------------------------

FAMILY_DEFAULTS = [
    (["model.arch=decoder"], "causal", {}),
    (["model.arch=encoder"], "mlm", {"mask_rate": 0.15, "mask_token_fraction": 0.8, "random_token_fraction": 0.1}),
    (["model.arch=encoder_decoder"], "span", {"noise_density": 0.15, "mean_span_length": 3.0}),
    (["model.arch=encoder", "data.mask_rate=0.3"], "mlm", {"mask_rate": 0.3, "mask_token_fraction": 0.8}),
]


@pytest.mark.parametrize("overrides, objective, keys", FAMILY_DEFAULTS, ids=[" ".join(c[0]) for c in FAMILY_DEFAULTS])
def test_each_family_gets_its_objective_and_defaults(overrides, objective, keys):
    cfg = load_config(None, overrides)
    assert cfg.data.objective == objective
    assert {k: getattr(cfg.data, k) for k in keys} == keys
    # the resolved config reloads to itself: saved runs resume with the same objective
    assert load_config(None, [f"data.objective={objective}", *overrides]) == cfg


def test_encoder_decoder_depths():
    cfg = load_config(None, ["model.arch=encoder_decoder", "model.n_layers=3"])
    assert (cfg.model.n_encoder_layers, cfg.model.n_layers) == (3, 3)
    cfg = load_config(None, ["model.arch=encoder_decoder", "model.n_encoder_layers=5"])
    assert cfg.model.n_encoder_layers == 5


FAMILY_MISTAKES = [
    (["data.mask_rate=0.2"], "data.mask_rate", "objective=mlm"),
    (["model.arch=encoder_decoder", "data.mask_rate=0.2"], "data.mask_rate", "trains span"),
    (["model.arch=encoder", "data.noise_density=0.2"], "data.noise_density", "objective=span"),
    (["model.n_encoder_layers=2"], "model.n_encoder_layers", "encoder_decoder"),
    (["model.arch=encoder", "data.mask_rate=0"], "data.mask_rate", "(0, 1)"),
    (["model.arch=encoder", "data.mask_rate=1"], "data.mask_rate", "(0, 1)"),
    (["model.arch=encoder", "data.mask_token_fraction=0.95"], "data.random_token_fraction", "at most 1"),
    (["model.arch=encoder_decoder", "data.mean_span_length=0.5"], "data.mean_span_length", ">= 1"),
    (["model.arch=encoder", "data.objective=span"], "data.objective", "it trains mlm"),
    (["model.arch=encoder_decoder", "data.objective=seq2seq"], "data.source", "gives text"),
    (["data.source=hf:x", "data.input_field=a"], "data.target_field", "go together"),
    (["data.input_field=a", "data.target_field=b"], "data.input_field", "hf: or files:"),
    (["model.arch=encoder", "data.source=hf:x", "data.input_field=a", "data.target_field=b"], "data.source", "pairs"),
    (["model.arch=encoder_decoder", "model.n_experts=4"], "model.n_experts", "dense"),
    (["model.n_shared_experts=2"], "model.n_shared_experts", "model.n_experts"),
    # a validation source of the other kind than the training source (text against pairs)
    (["data.val_source=builtin:seq2seq"], "data.val_source", "input/target pairs, and data.source"),
    (["data.source=builtin:seq2seq", "data.val_source=builtin:recall"], "data.val_source", "input/target pairs"),
    (["data.source=builtin:seq2seq", "data.document_separator=x"], "data.document_separator", "input/target pairs"),
    (
        ["model.arch=encoder", "model.window=8", "model.attention_impl=cudnn", "model.dtype=bfloat16"],
        "model.attention_impl",
        "two-sided",
    ),
]


@pytest.mark.parametrize("overrides, key, words", FAMILY_MISTAKES, ids=[" ".join(c[0]) for c in FAMILY_MISTAKES])
def test_family_mistakes_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(f"{key}:") and words in str(e.value)


def test_pairs_rows_set_the_models_context():
    pairs = ["data.source=hf:x", "data.input_field=a", "data.target_field=b", "data.seq_len=48"]
    prefix = load_config(None, [*pairs, "data.target_len=16"])  # input, then target, in one decoder row
    assert (prefix.data.objective, prefix.model.max_seq_len) == ("prefix", 64)
    seq2seq = load_config(None, ["model.arch=encoder_decoder", *pairs])  # target_len defaults to seq_len
    assert (seq2seq.data.objective, seq2seq.data.target_len, seq2seq.model.max_seq_len) == ("seq2seq", 48, 48)
    with pytest.raises(ConfigError, match=r"^data.seq_len: rows of 96 tokens \(prefix\) exceed model.max_seq_len"):
        load_config(None, [*pairs, "model.max_seq_len=64"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.source=builtin:seq2seq", "data.val_source=builtin:recall"], "data.val_source"),
        (["data.source=builtin:seq2seq:max_len=1000000"], "data.source"),
        (
            ["data.mixture=[{source: builtin:stdlib, weight: 1e308}, {source: builtin:recall, weight: 1e308}]"],
            "data.mixture",
        ),
    ],
    ids=["val-source-kind", "unbounded-option", "weights-sum-to-infinity"],
)
def test_the_dry_run_refuses_what_the_run_refuses_in_one_line(overrides, key):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "train.py", *overrides, "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: config: {key}:"), result.stderr
