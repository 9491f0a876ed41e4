"""Every documented choice of every enum-like config key trains a few steps, or is refused by the
platform check in one line naming the key. The choices are read from the schema's Literal
annotations, so a choice added to the schema is covered without touching this file."""

import dataclasses
import math
import types
import typing
from pathlib import Path

import jax
import pytest
from conftest import tiny_run_overrides, write_corpus

from transformer import limits, sharding
from transformer.config import Config, ConfigError
from transformer.config_loader import load_config
from transformer.data import prepare
from transformer.train.loop import train

STEPS = 2

PAIRS = "builtin:seq2seq:train_docs=200,val_docs=20,max_len=6"
# What a choice needs besides itself to mean anything (or to be a valid config at all).
COMPANIONS = {
    "model.attention_pattern": ["model.window=4"],
    "model.attention_impl=cudnn": ["model.dtype=bfloat16"],  # the schema refuses cudnn in float32
    "faults.corrupt_kind": ["faults.corrupt_step=1"],  # the kind is used only when the fault fires
    "model.depth_scaling": ["model.parametrization=mup"],  # depth scaling sits on µP's width rules
    # groups scored by their two best: four experts in two groups, two chosen
    "model.router_group_score": ["model.n_experts=4", "model.top_k=2", "model.router_groups=2"],
    "optim.muon.ns": ["optim.name=muon"],  # Muon's keys are refused under other optimisers
    "optim.muon.scale": ["optim.name=muon"],
    "optim.name=schedule_free_adamw": ["optim.schedule=constant"],  # it refuses a decaying schedule
    "optim.soap.precondition_every": ["optim.name=soap"],  # SOAP's keys are refused under other optimisers
    # an objective trains its family, on text or on pairs
    "data.objective=mlm": ["model.arch=encoder"],
    "data.objective=span": ["model.arch=encoder_decoder"],
    "data.objective=prefix": [f"data.source={PAIRS}", "data.seq_len=8"],
    "data.objective=seq2seq": ["model.arch=encoder_decoder", f"data.source={PAIRS}", "data.seq_len=8"],
}
# Choices this platform cannot run: the platform check must refuse exactly these, in one line.
REFUSED = {
    "cpu": {"model.attention_impl=cudnn", "model.dtype=float16"},
}


def _literal_values(tp: typing.Any) -> list:
    """The values a field may take if its annotation is a choice: Literal[...], optional or not, or
    a tuple of them (given as a one-item list)."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return list(typing.get_args(tp))
    if origin is tuple:
        return [[v] for v in _literal_values(typing.get_args(tp)[0])]
    if origin in (typing.Union, types.UnionType):
        return [v for arg in typing.get_args(tp) for v in _literal_values(arg)]
    return []


def schema_choices(cls: type = Config, prefix: str = "") -> list[tuple[str, typing.Any]]:
    """(dotted key, value) for every choice of every enum-like field of the schema."""
    out = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key, tp = prefix + field.metadata.get("key", field.name), hints[field.name]
        if dataclasses.is_dataclass(tp):
            out += schema_choices(tp, key + ".")
        else:
            out += [(key, value) for value in _literal_values(tp)]
    return out


CHOICES = schema_choices()


def _override(key: str, value) -> str:
    text = f"[{','.join(value)}]" if isinstance(value, list) else str(value)
    return f"{key}={text}"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("choices") / "docs.jsonl", seed=0, n=60)


@pytest.fixture(scope="module")
def data_for(corpus, tmp_path_factory):
    """The prepared data of a config, shared by all choices (none of them is a data key)."""
    cache: dict = {}

    def get(cfg: Config):
        key = (cfg.data, cfg.train.batch_size, cfg.train.seed)
        if key not in cache:
            cache[key] = prepare(cfg.data, cfg.train.batch_size, cfg.train.seed, log=lambda _: None)
        return cache[key]

    return get


def _companions(key: str, value) -> list[str]:
    return COMPANIONS.get(_override(key, value), COMPANIONS.get(key, []))


def _sets(choice: tuple[str, typing.Any]) -> dict[str, str]:
    """What a choice sets, key to value: its own and its companions'."""
    own = _override(*choice).partition("=")
    return {own[0]: own[2]} | {c.partition("=")[0]: c.partition("=")[2] for c in _companions(*choice)}


def _clash(row: list[tuple[str, typing.Any]], choice: tuple[str, typing.Any]) -> bool:
    """Whether `choice` (or a companion) sets a key of the row to another value."""
    wanted = _sets(choice)
    return any(wanted.get(k, v) != v for c in row for k, v in _sets(c).items())


def _overrides(corpus: Path, cache: Path, choices: list[tuple[str, typing.Any]]) -> list[str]:
    """The tiny run with these choices made (and what each needs besides)."""
    extra = []
    for key, value in choices:
        extra += [_override(key, value), *_companions(key, value)]
    return tiny_run_overrides(
        corpus,
        cache,
        "data.val_windows=2",
        "train.batch_size=2",
        f"train.steps={STEPS}",
        f"train.eval_every={STEPS}",
        "optim.warmup_steps=1",
        *extra,
    )


def _refusal(choices: list[tuple[str, typing.Any]]) -> ConfigError | None:
    """Why the schema or the platform refuses these choices together, or None."""
    try:
        limits.check_platform(load_config(None, _overrides(Path("docs.jsonl"), Path("cache"), choices)))
    except ConfigError as e:
        return e
    return None


def covering_rows() -> list[list[tuple[str, typing.Any]]]:
    """Few configs that together make every choice the platform accepts at least once (one key
    per config at most once): each compile is the test's cost, so one config carries one choice of
    many keys. A choice refused on its own is left out (see the refusal test)."""
    # the choices that bring companions first: they constrain a row most, the rest fill in around them
    left = sorted((c for c in CHOICES if _refusal([c]) is None), key=lambda c: -len(_companions(*c)))
    rows = []
    while left:
        row: list[tuple[str, typing.Any]] = []
        for choice in left:
            # a companion must not change a key the row chose (nor a choice one a companion set);
            # choices whose companions agree (Muon's keys, each with optim.name=muon) share a row
            if choice[0] not in {c[0] for c in row} and not _clash(row, choice) and _refusal([*row, choice]) is None:
                row.append(choice)
        left = [c for c in left if c not in row]
        rows.append(row)
    return rows


ROWS = covering_rows()


def test_the_schema_has_the_documented_choices():
    keys = {key for key, _ in CHOICES}
    assert {"optim.name", "optim.schedule", "model.norm", "model.norm_position", "model.ffn"} <= keys
    assert {"model.position", "model.attention_impl", "model.remat", "monitor.on_spike", "model.dtype"} <= keys
    assert ("optim.name", "adafactor") in CHOICES and ("model.attention_pattern", ["local"]) in CHOICES
    # the cost of the test below: one compile per row (objectives need their families); the floor is
    # optim.name's: Muon's three scales take three rows of optim.name=muon, the other eight optimisers one each
    assert len(ROWS) <= 11


@pytest.mark.parametrize("key, value", CHOICES, ids=[_override(k, v) for k, v in CHOICES])
def test_every_choice_is_trained_below_or_refused_by_the_platform_in_one_line(key, value):
    error = _refusal([(key, value)])
    refused = REFUSED.get(jax.default_backend())
    if error is None:
        assert refused is None or _override(key, value) not in refused, "the platform check let it through"
        assert any((key, value) in row for row in ROWS)
        return
    assert refused is None or _override(key, value) in refused, str(error)
    assert error.key.startswith(key) and "\n" not in str(error) and "; use " in str(error), str(error)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[",".join(_override(k, v) for k, v in row) for row in ROWS])
def test_every_accepted_choice_trains(row, corpus, data_for, tmp_path):
    cfg = load_config(None, _overrides(corpus, tmp_path / "cache", row))
    data = data_for(cfg)
    cfg = cfg.with_vocab(data.vocab_size)
    losses: list[float] = []
    mesh = sharding.make_mesh(cfg, jax.devices()[:1])
    train(cfg, data, None, mesh, log=lambda _: None, on_metrics=lambda s, m: losses.append(m["loss"]))
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
