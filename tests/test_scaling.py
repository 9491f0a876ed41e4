"""Does a difference hold at scale, and is it more than noise: the ladder's expansion, the fit of loss
against compute, the compute-equivalent gain, the paired differences' intervals and p-values (their
coverage measured on synthetic seeds), and the report's sections."""

import json
import math

import numpy as np
import pytest
from test_report import fake_run

from transformer import rundir
from transformer.config_loader import from_dict
from transformer.model import non_embedding_params
from transformer.report import build
from transformer.report.paired import Paired, comparisons, t_pvalue
from transformer.report.render import write_report
from transformer.report.scaling import Curve, Fit, FitRefused, fit_power_law, scaling, target_name, trend_line
from transformer.report.stats import T95
from transformer.sweep import SweepError, expand
from transformer.train.preflight import work_per_step

BASE = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2}, "data": {"seq_len": 32}}
BASE |= {"train": {"steps": 10, "batch_size": 4}}


def power_law(compute, E=1.5, A=30.0, alpha=0.15):
    return E + A * np.asarray(compute, dtype=np.float64) ** -alpha


def synthetic(compute, loss_of, seeds=3, noise=0.0, rng=None) -> Curve:
    """A variant's curve: at each compute, each seed's loss `loss_of(C)` plus normal noise."""
    rng = rng or np.random.default_rng(0)
    names = [f"r{i}" for i in range(len(compute))]
    losses = {
        n: {s: float(loss_of(c)) + noise * float(rng.normal()) for s in range(seeds)} for n, c in zip(names, compute)
    }
    return Curve(dict(zip(names, map(float, compute))), losses)


# --- the fit -----------------------------------------------------------------------------------------


def test_the_fit_recovers_known_parameters_from_noisy_curves():
    rng = np.random.default_rng(1)
    compute = np.repeat(np.geomspace(1e10, 1e14, 7), 4)
    found = [fit_power_law(compute, power_law(compute) + rng.normal(0, 0.003, compute.shape)) for _ in range(5)]
    assert np.median([f.alpha for f in found]) == pytest.approx(0.15, rel=0.1)
    assert np.median([f.E for f in found]) == pytest.approx(1.5, abs=0.05)
    exact = fit_power_law(compute, power_law(compute))
    assert (exact.E, exact.alpha) == pytest.approx((1.5, 0.15), rel=1e-6) and exact.A == pytest.approx(30.0, rel=1e-5)
    assert exact.compute_for(float(power_law(3e12))) == pytest.approx(3e12, rel=1e-6)
    assert exact.compute_for(1.4) == math.inf  # below the floor: never reached


def test_fewer_points_than_parameters_is_refused_in_words():
    with pytest.raises(FitRefused, match="3 parameters and the points have 2 distinct computes"):
        fit_power_law(np.array([1e10, 1e10, 1e11]), np.array([3.0, 3.1, 2.5]))
    two = {"a": synthetic([1e10, 1e11], power_law), "b": synthetic([1e10, 1e11], power_law)}
    with pytest.raises(FitRefused, match="the ladder has 2 rungs: not fitted"):
        scaling(two, "a", draws=10)


def test_a_curve_shifted_by_a_compute_factor_gains_that_factor_at_every_rung_and_target():
    """The variant reaches at C what the baseline reaches at 2.5 C: its gain is 2.5 everywhere, and
    it neither grows nor shrinks with compute."""
    compute = np.geomspace(1e10, 1e13, 5)
    curves = {"base": synthetic(compute, power_law), "better": synthetic(compute, lambda c: power_law(2.5 * c))}
    found = scaling(curves, "base", draws=50)
    gains = found.gains["better"]
    assert set(gains) == {*found.rungs, target_name(1e13), target_name(1e13 * 10**0.75)}
    assert all(g.value == pytest.approx(2.5, rel=1e-5) for g in gains.values())
    assert found.targets == [(pytest.approx(1e13), False), (pytest.approx(1e13 * 10**0.75), True)]
    assert "holds across compute" in trend_line("better", "base", found.trend["better"])


def test_a_gain_that_grows_with_compute_is_said_to_grow():
    """The variant's exponent is steeper: its compute factor grows with scale."""
    compute = np.geomspace(1e10, 1e13, 5)
    curves = {
        "base": synthetic(compute, power_law, noise=0.002),
        "steeper": synthetic(compute, lambda c: power_law(c, alpha=0.2, A=90.0), noise=0.002),
    }
    found = scaling(curves, "base", draws=100)
    line = trend_line("steeper", "base", found.trend["steeper"])
    assert "grows with compute" in line, line
    g = found.gains["steeper"]
    assert g[found.rungs[-1]].value > g[found.rungs[0]].value


def test_the_gains_interval_covers_the_truth_on_synthetic_ladders():
    """95% bootstrap intervals of the gain at the largest rung's compute over 60 synthetic ladders
    (5 rungs, 3 seeds, 0.01-nat noise, a true factor of 1.5). Measured: 98% for the fit's targets,
    78-93% for the rungs' own gains, whose means rest on three seeds (the module says so)."""
    rng = np.random.default_rng(0)
    compute = np.geomspace(1e10, 1e13, 5)
    covered = 0
    for i in range(60):
        curves = {
            "a": synthetic(compute, power_law, noise=0.01, rng=rng),
            "b": synthetic(compute, lambda c: power_law(1.5 * c), noise=0.01, rng=rng),
        }
        g = scaling(curves, "a", draws=60, seed=i).gains["b"][target_name(1e13)]
        covered += g.low <= 1.5 <= g.high
    assert 0.85 <= covered / 60 <= 1.0


# --- paired differences ------------------------------------------------------------------------------


def test_the_t_test_matches_the_t_table():
    for df, t in enumerate(T95, 1):
        assert t_pvalue(t, df) == pytest.approx(0.05, abs=2e-4)
    assert t_pvalue(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| > 1) = 1/2
    assert t_pvalue(0.0, 4) == pytest.approx(1.0) and t_pvalue(math.inf, 3) == 0.0


def test_paired_intervals_and_p_values_are_calibrated_on_synthetic_seeds():
    """200 synthetic comparisons of 4 paired seeds: the 95% interval covers the true difference in
    90-99% of them, and with no true difference p < 0.05 in 1-10%."""
    rng = np.random.default_rng(3)
    covered = false_alarms = 0
    for _ in range(200):
        covered += (p := Paired.of(list(0.05 + rng.normal(0, 0.03, 4)))).low <= 0.05 <= p.high
        false_alarms += Paired.of(list(rng.normal(0, 0.03, 4))).p < 0.05
    assert 0.90 <= covered / 200 <= 0.99
    assert 0.01 <= false_alarms / 200 <= 0.10


def test_the_paired_verdict_is_worded_by_its_evidence():
    clear = Paired.of([-0.10, -0.12, -0.11, -0.09])
    assert clear.resolved and clear.verdict("swiglu", "relu").startswith("swiglu ended lower than relu")
    noisy = Paired.of([-0.02, 0.01, -0.03])
    line = noisy.verdict("swiglu", "relu")
    assert "no detectable difference" in line and f"about {noisy.seeds_needed} seeds" in line
    # the seeds named are the fewest whose interval at the observed spread excludes the observed mean
    sd, mean = np.std([-0.02, 0.01, -0.03], ddof=1), abs(np.mean([-0.02, 0.01, -0.03]))
    n = noisy.seeds_needed
    assert T95[n - 2] * sd / math.sqrt(n) < mean <= T95[n - 3] * sd / math.sqrt(n - 1)
    assert "repeat over seeds" in Paired.of([0.1]).verdict("a", "b")


# --- the ladder --------------------------------------------------------------------------------------


def shaped(d_model: int, n_layers: int):
    """BASE at a shape with 16-wide MHA heads."""
    heads = d_model // 16
    model = {"d_model": d_model, "n_layers": n_layers, "n_heads": heads, "n_kv_heads": heads}
    return from_dict({**BASE, "model": model})


def test_a_ladder_expands_to_the_nearest_shapes_and_the_token_budgets():
    s = expand(
        {
            **BASE,
            "sweep": {
                "grid": {"model.ffn": ["relu", "swiglu"]},
                "seeds": [0, 1],
                "ladder": {
                    "params": [2.0e4, 1.0e5],
                    "aspect": 16,
                    "head_dim": 16,
                    "tokens_per_param": 20,
                    "lr": [[1e-3, 3e-3], [1e-3]],
                },
            },
        }
    )
    rungs = s.ladder.rungs
    assert [(r.d_model, r.n_layers, r.n_heads) for r in rungs] == [(32, 2, 2), (48, 3, 3)]
    for r, target in zip(rungs, (2.0e4, 1.0e5)):  # no depth's shape is nearer the target in ratio
        cfg = shaped(r.d_model, r.n_layers)
        assert r.params == non_embedding_params(cfg.model)
        assert (
            r.steps == math.ceil(20 * r.params / work_per_step(cfg)[0]) and r.flops == r.steps * work_per_step(cfg)[1]
        )
        for depth in set(range(1, 7)) - {r.n_layers}:
            other = shaped(16 * depth, depth)
            assert abs(math.log(non_embedding_params(other.model) / target)) > abs(math.log(r.params / target))
    assert len(s.members) == 2 * 2 * (2 + 1)  # ffn x seeds x (2 + 1 learning rates)
    assert s.compare == "model.ffn" and s.keys[0] == "rung"
    big = [m for m in s.members if m.labels["rung"] == rungs[1].name]
    assert {m.config.model.d_model for m in big} == {48} and {m.config.train.steps for m in big} == {rungs[1].steps}
    assert s.members[0].labels["rung"] == rungs[0].name  # every variant at a rung before the next rung


def test_an_isoflop_ladder_crosses_sizes_with_budgets():
    s = expand(
        {
            **BASE,
            "sweep": {
                "ladder": {
                    "shapes": [{"d_model": 32, "n_layers": 2}, {"d_model": 64, "n_layers": 2}],
                    "flops": [1e11, 1e12],
                    "warmup": 0.1,
                }
            },
        }
    )
    assert len(s.ladder.rungs) == 4 and {r.budget for r in s.ladder.rungs} == {1e11, 1e12}
    for r, m in zip(s.ladder.rungs, s.members):
        per_step = work_per_step(m.config)[1]
        assert r.steps == math.ceil(r.budget / per_step) and m.config.optim.warmup_steps == round(0.1 * r.steps)
        assert m.labels == {"rung": r.name, "budget": r.budget}


@pytest.mark.parametrize(
    ("ladder", "message"),
    [
        (
            {"params": [1e5], "shapes": [{"d_model": 32, "n_layers": 2}], "tokens_per_param": 5},
            "exactly one of params or shapes",
        ),
        ({"params": [1e5], "tokens_per_param": 5, "flops": [1e12]}, "exactly one of tokens_per_param or flops"),
        ({"params": [1e5], "tokens_per_param": 5, "lrs": [1e-3]}, r"did you mean sweep.ladder.lr\?"),
        ({"params": [2e4, 2.1e4], "tokens_per_param": 5, "aspect": 16, "head_dim": 16}, "come out as one shape"),
        (
            {"params": [1e5, 1e6], "tokens_per_param": 5, "lr": [[1e-3], [1e-3], [1e-3]]},
            "one list per size: 2 sizes, 3 lists",
        ),
        ({"params": ["many"], "tokens_per_param": 5}, "expected a positive number, got 'many'"),
        ({"shapes": [{"d_model": 32}], "tokens_per_param": 5}, "d_model, n_layers and optionally n_heads"),
        ({"params": [1e5], "tokens_per_param": 5, "warmup": 2}, r"share of the steps in \[0, 1\)"),
    ],
)
def test_ladder_mistakes_are_one_line_naming_the_key(ladder, message):
    with pytest.raises(SweepError, match=message):
        expand({**BASE, "sweep": {"ladder": ladder}})


def test_a_size_the_ladder_must_derive_is_refused_when_fixed_or_swept():
    with pytest.raises(SweepError, match=r"model\.d_ff: the base config sets it, so it would stay fixed at every rung"):
        expand(
            {
                **BASE,
                "model": {**BASE["model"], "d_ff": 128},
                "sweep": {"ladder": {"params": [1e5], "tokens_per_param": 5}},
            }
        )
    zipped = {"zip": [{"model.ffn": ["relu", "swiglu"], "model.d_ff": [128, 96]}]}
    with pytest.raises(SweepError, match=r"model\.d_ff: the sweep varies it"):
        expand({**BASE, "sweep": {**zipped, "ladder": {"params": [1e5], "tokens_per_param": 5}}})


def test_a_ladder_swept_again_by_the_grid_is_refused():
    with pytest.raises(SweepError, match=r"optim\.lr is swept twice"):
        expand(
            {
                **BASE,
                "sweep": {
                    "grid": {"optim.lr": [1e-3]},
                    "ladder": {"params": [1e5], "tokens_per_param": 5, "lr": [1e-3]},
                },
            }
        )


# --- the report ----------------------------------------------------------------------------------------


def _ladder_dir(tmp_path, gain: float = 2.0):
    """A ladder's sweep directory of hand-made runs: two norm placements at four widths, two seeds,
    two learning rates (the worse 0.3 nats behind); `post` reaches at C what `pre` reaches at gain*C."""
    members = []
    for d in (32, 64, 96, 128):
        for norm in ("pre", "post"):
            for lr in (1e-3, 1e-2):
                for seed in (0, 1):
                    name = f"{norm}-d{d}-lr{lr:g}-s{seed}"
                    run = fake_run(tmp_path, name, norm=norm, lr=lr, seed=seed, d_model=d, losses=[6.0] * (d // 8))
                    compute = (d // 8) * work_per_step(rundir.read_config(run))[1]
                    final = (
                        float(power_law(compute * (gain if norm == "post" else 1.0))) + 0.3 * (lr == 1e-3) + 0.01 * seed
                    )
                    _set_final(run, final, d // 8)
                    values = {"model.d_model": d, "train.steps": d // 8, "optim.lr": lr, "model.norm_position": norm}
                    members.append(
                        {
                            "name": name,
                            "variant": name[:-3],
                            "seed": seed,
                            "values": values,
                            "labels": {"rung": f"d{d}"},
                        }
                    )
    keys = ["rung", "model.d_model", "train.steps", "optim.lr", "model.norm_position"]
    manifest = {"source": "x.yaml", "keys": keys, "compare": "model.norm_position", "members": members}
    (tmp_path / "sweep.json").write_text(json.dumps(manifest))


def _set_final(run, final: float, steps: int) -> None:
    """The run's last training and validation loss set to `final`."""
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": steps, "loss": final, "val_loss": final}) + "\n")


def test_a_ladders_report_has_the_fit_the_gains_and_the_paired_differences(tmp_path):
    _ladder_dir(tmp_path, gain=2.0)
    report = build(tmp_path)
    found, *by_rung = comparisons(report)  # post vs pre, paired by rung, learning rate and seed; then rung by rung
    assert found.final.n == 16 and found.final.mean < 0 and found.equal_tokens is None
    assert [c.within for c in by_rung] == ["rung=d32", "rung=d64", "rung=d96", "rung=d128"]
    assert all(c.final.n == 4 and c.final.mean < 0 for c in by_rung)
    path = write_report(tmp_path, log=lambda _: None)
    md, html = path.read_text(), (tmp_path / "report.html").read_text()
    for title in ("## Paired differences over seeds", "## Scaling: loss against compute"):
        assert title in md and title[3:] in html
    assert "only 2 seed(s) per variant: a bootstrap over so few understates the spread" in md
    data = json.loads((tmp_path / "report.json").read_text())
    (entry,) = data["scaling"]
    assert entry["baseline"] == "pre" and entry["rungs"] == ["d32", "d64", "d96", "d128"]
    gains = entry["gains"]["post"]
    assert all(g["value"] == pytest.approx(2.0, rel=0.02) for name, g in gains.items()), gains
    assert data["paired"][0]["final"]["n"] == 16 and "post ended lower than pre" in data["paired"][0]["verdict"]
    assert (tmp_path / "plots" / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_ladder_on_the_command_line(tmp_path):
    """--dry-run lists every rung and the ladder's total compute, running nothing; a mistake in the
    ladder is one line and exit 2."""
    import subprocess
    import sys

    import yaml
    from conftest import ROOT

    def train(path, *args):
        cmd = [sys.executable, str(ROOT / "train.py"), str(path), *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)

    ladder = {"params": [2.0e4, 1.0e5], "aspect": 16, "head_dim": 16, "tokens_per_param": 2}
    path = tmp_path / "ladder.yaml"
    path.write_text(yaml.safe_dump({**BASE, "sweep": {"seeds": [0, 1], "ladder": ladder}}))
    out = train(path, "--dry-run")
    assert out.returncode == 0, out.stderr
    s = expand({**BASE, "sweep": {"seeds": [0, 1], "ladder": ladder}})
    rungs = [line for line in out.stdout.splitlines() if line.startswith("  N")]
    assert [line.split(":")[0].strip() for line in rungs] == [r.name for r in s.ladder.rungs]
    total = 2 * sum(r.flops for r in s.ladder.rungs)
    assert (
        out.stdout.strip().splitlines()[-1]
        == f"ladder total: {total:.3g} model FLOPs over 4 runs (the base variant's count)"
    )
    assert not list(tmp_path.glob("runs*"))
    path.write_text(yaml.safe_dump({**BASE, "sweep": {"ladder": {**ladder, "tokens_per_params": 2}}}))
    out = train(path, "--dry-run")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "train.py: error: config: sweep.ladder.tokens_per_params: unknown key (did you mean sweep.ladder.tokens_per_param?)"
    ], out.stderr


def test_a_ladder_keeps_mqa_and_a_mup_base_and_refuses_a_warmup_longer_than_a_rung():
    mqa = {**BASE, "model": {**BASE["model"], "n_heads": 4, "n_kv_heads": 1, "head_dim": None}}
    s = expand(
        {**mqa, "sweep": {"ladder": {"params": [2e4, 1e5], "aspect": 16, "head_dim": 8, "tokens_per_param": 20}}}
    )
    assert {m.config.model.n_kv_heads for m in s.members} == {1} and len({r.n_heads for r in s.ladder.rungs}) == 2
    mup = {**BASE, "model": {**BASE["model"], "parametrization": "mup"}}
    s = expand(
        {**mup, "sweep": {"ladder": {"params": [2e4, 1e5], "aspect": 16, "head_dim": 16, "tokens_per_param": 20}}}
    )
    assert {m.config.model.mup_base_d_model for m in s.members} == {32}  # the base's width, not each rung's own
    assert {m.config.model.d_model for m in s.members} == {32, 48}
    with pytest.raises(SweepError, match=r"optim\.warmup_steps \(50\) is not below rung N\w+'s \d+ steps"):
        expand(
            {**BASE, "sweep": {"ladder": {"params": [2e4, 1e5], "aspect": 16, "head_dim": 16, "tokens_per_param": 0.1}}}
        )


def test_the_gain_survives_overflow_a_missing_seed_and_a_variant_without_a_fit():
    assert Fit(2.0, 1.0, 0.001).compute_for(2.4) == math.inf  # 10^398: beyond a float, not an error
    compute = np.geomspace(1e10, 1e13, 5)
    base, other = synthetic(compute, power_law), synthetic(compute, lambda c: power_law(2 * c))
    del other.losses["r2"][0], other.losses["r2"][1]  # one seed left at one rung
    found = scaling({"a": base, "b": other}, "a", draws=40)
    assert all(math.isfinite(g.high) for g in found.gains["b"].values())
    short = Curve({"r0": 1e10, "r1": 1e11}, {"r0": {0: 3.0}, "r1": {0: 2.5}})
    found = scaling({"a": base, "b": other, "c": short}, "a", draws=20)
    assert "c" not in found.fits and "2 distinct computes" in found.refused["c"] and "b" in found.gains
