"""Comparison reports: the numbers are the runs' own, the LR sensitivity and the verdict follow
their definitions, the plots are real PNGs, and `eval.py --compare` writes it all."""

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, logged, read_events

from transformer.config_loader import from_dict
from transformer.report import build, lr_sensitivity, mean_std
from transformer.report.paired import comparisons
from transformer.report.render import write_report

PNG = b"\x89PNG\r\n\x1a\n"


# --- hand-made runs --------------------------------------------------------------------------------


def fake_run(
    directory, name, *, norm="pre", lr=1e-3, seed=0, losses, val=(), events=(), stats=None, batch=4, d_model=32
):
    """A run directory as the trainer writes it: config.yaml, metrics.jsonl, events.jsonl."""
    run = directory / name
    run.mkdir(parents=True)
    cfg = from_dict(
        {
            "model": {"d_model": d_model, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "norm_position": norm},
            "optim": {"lr": lr},
            "train": {"seed": seed, "batch_size": batch, "steps": len(losses)},
            "data": {"seq_len": 8},
        }
    )
    (run / "config.yaml").write_text(cfg.to_yaml())
    with open(run / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            loss = loss if math.isfinite(loss) else str(loss)  # as the trainer writes non-finite values
            f.write(
                json.dumps({"step": step, "loss": loss, "grad_norm": 1.0 + step / 100, "tokens_per_s": 1000.0 + step})
                + "\n"
            )
            if step in dict(val):
                f.write(
                    json.dumps(
                        {"step": step, "val_loss": dict(val)[step], "val_bits_per_byte": dict(val)[step] / math.log(2)}
                    )
                    + "\n"
                )
            if stats and step % 2 == 0:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "attn_logit_max": [step, 2 * step],
                            "residual_rms": [1.0, 2.0],
                            "attn_entropy": [0.5, 0.4],
                        }
                    )
                    + "\n"
                )
    with open(run / "events.jsonl", "w") as f:
        f.write(json.dumps({"event": "start", "step": 0}) + "\n")
        for kind, step in events:
            f.write(json.dumps({"event": kind, "step": step}) + "\n")
        if not any(kind == "stopped" for kind, _ in events):
            f.write(json.dumps({"event": "end", "step": len(losses)}) + "\n")
    return run


def sweep_dir(directory, runs: dict[str, dict]):
    members = [
        {
            "name": n,
            "variant": n.rsplit("-s", 1)[0],
            "seed": r["seed"],
            "values": {"model.norm_position": r["norm"], "optim.lr": r["lr"]},
            "labels": {},
        }
        for n, r in runs.items()
    ]
    write_manifest(directory, ["model.norm_position", "optim.lr"], members)


def write_manifest(directory, keys: list[str], members: list[dict]) -> None:
    """The sweep manifest of hand-made members, comparing the first key."""
    manifest = {"source": "x.yaml", "keys": keys, "compare": keys[0], "members": members}
    (directory / "sweep.json").write_text(json.dumps(manifest))


def test_lr_sensitivity_on_hand_made_curves():
    # grid of 4 learning rates; initial losses 5; the third diverged (nan), the fourth ended above its initial loss
    losses, initial = [3.0, 2.0, math.nan, 6.0], [5.0, 5.0, 5.0, 5.0]
    # capped: 3, 2, 5, 5 -> mean 3.75, best 2
    assert lr_sensitivity(losses, initial) == pytest.approx(1.75)
    assert lr_sensitivity([2.0, 2.0], [5.0, 5.0]) == 0.0  # flat in the learning rate: perfectly insensitive
    assert lr_sensitivity([math.inf, math.nan], [5.0, 4.0]) == pytest.approx(0.5)  # all diverged: capped at initial


def test_mean_std_over_seeds():
    assert mean_std([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))
    assert mean_std([1.0]) == (1.0, None)
    assert mean_std([1.0, math.nan, 3.0])[0] == 2.0
    assert math.isnan(mean_std([])[0])


def test_report_numbers_equal_the_runs_own_metrics(tmp_path):
    losses = list(np.linspace(5.0, 1.5, 30))
    a = fake_run(
        tmp_path,
        "pre-s0",
        losses=losses,
        val=[(15, 2.2), (30, 1.6)],
        events=[("spike", 3), ("spike", 7), ("rollback", 2), ("level_shift", 8)],
        stats=True,
    )
    fake_run(tmp_path, "pre-s1", seed=1, losses=list(np.linspace(5.0, 1.4, 30)), val=[(30, 1.5)])
    # a shorter run sets the common token budget: 20 steps x 4 rows x 8 tokens = 640
    fake_run(
        tmp_path, "post-s0", norm="post", losses=[5.0, 4.0, 9.0, math.nan] + [8.0] * 16, events=[("divergence", 4)]
    )
    report = build(tmp_path)
    s = report.summaries["pre-s0"]
    loss = logged(a, "loss")
    assert s.final_train_loss == loss[30]
    assert s.initial_loss == loss[1]
    assert s.best_val_loss == min(logged(a, "val_loss").values()) == 1.6
    assert s.best_val_bpb == pytest.approx(1.6 / math.log(2))
    assert s.spikes == len(read_events(a, "spike")) == 2  # level shifts are not spikes
    assert s.rollbacks == 1
    assert s.max_grad_norm == max(logged(a, "grad_norm").values())
    assert s.max_attn_logit == 60  # the largest per-layer value over all statistics steps
    assert s.tokens_per_s == np.median(list(logged(a, "tokens_per_s").values()))
    assert not s.diverged and s.status == "finished"
    # the last 10% of the budget, tokens in (576, 640], holds steps 19 and 20
    assert report.budget == 640
    assert s.loss_at_budget == pytest.approx((loss[19] + loss[20]) / 2)
    post = report.summaries["post-s0"]
    assert post.diverged and post.loss_at_budget == 8.0
    # seeds aggregate into one row per variant: the report groups by the varied keys
    assert report.keys == ["model.norm_position"]
    assert set(report.variants) == {"norm_position=pre", "norm_position=post"}
    mean, std = report.aggregate("final_train_loss")["norm_position=pre"]
    assert mean == pytest.approx(1.45) and std == pytest.approx(np.std([1.5, 1.4], ddof=1))


def test_report_files_plots_and_verdict_on_a_sweep(tmp_path):
    """Post-LN fails at the higher learning rates in every seed: the verdict says Pre-LN, with the
    paired evidence; the plots are PNGs that decode to non-empty images."""
    runs = {}
    for seed in (0, 1, 2):
        for lr in (1e-3, 1e-2, 1e-1):
            runs[f"pre,lr-{lr:g}-s{seed}"] = dict(norm="pre", lr=lr, seed=seed)
            runs[f"post,lr-{lr:g}-s{seed}"] = dict(norm="post", lr=lr, seed=seed)
    for name, r in runs.items():
        bad = r["norm"] == "post" and r["lr"] >= 1e-2
        final = 2.0 + 0.1 * r["seed"] + (4.0 if bad else 0.0) + (0.3 if r["lr"] == 1e-3 else 0.0)
        fake_run(
            tmp_path,
            name,
            norm=r["norm"],
            lr=r["lr"],
            seed=r["seed"],
            losses=list(np.linspace(5.0, final, 8)),
            val=[(8, final)],
            stats=True,
            events=[("spike", 3)] if bad else [],
        )
    sweep_dir(tmp_path, runs)
    path = write_report(tmp_path, log=lambda _: None)
    report = build(tmp_path)
    sens = report.sensitivities()
    # pre: capped finals 2.3+s, 2+s, 2+s -> sensitivity 0.1; post: 2.3+s, 5 (capped), 5 -> 2.1 - ... exact values:
    for seed in (0, 1, 2):
        assert sens[("pre",)][seed] == pytest.approx(
            lr_sensitivity([2.3 + 0.1 * seed, 2 + 0.1 * seed, 2 + 0.1 * seed], [5.0] * 3)
        )
        assert sens[("post",)][seed] == pytest.approx(lr_sensitivity([2.3 + 0.1 * seed, 5.0, 5.0], [5.0] * 3))
    verdict = report.verdict()
    assert verdict.startswith("pre was more stable than post") and "all 3 paired settings" in verdict, verdict
    md = path.read_text()
    assert verdict in md and "| norm_position | lr | seeds |" in md
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 4  # loss, grad norm, val loss, layers, lr
    from matplotlib.image import imread

    for name in ("loss", "grad_norm", "layers", "lr"):
        png = tmp_path / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG
        image = imread(png)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image[..., :3].std() > 0.01  # not blank


def test_verdict_is_only_as_strong_as_the_seeds_allow(tmp_path):
    runs = {}
    for norm, finals in (("pre", [2.0, 2.0]), ("post", [2.0, 2.2])):
        for lr, final in zip((1e-3, 1e-2), finals):
            runs[f"{norm},lr-{lr:g}-s0"] = dict(norm=norm, lr=lr, seed=0)
            fake_run(tmp_path, f"{norm},lr-{lr:g}-s0", norm=norm, lr=lr, losses=[5.0, final], val=[(2, final)])
    sweep_dir(tmp_path, runs)
    verdict = build(tmp_path).verdict()
    assert verdict.startswith("Weak evidence: pre") and "repeat over seeds" in verdict, verdict


def test_verdict_without_lr_grid_counts_spikes_and_divergence(tmp_path):
    fake_run(tmp_path, "a", norm="pre", losses=[5.0, 2.0])
    fake_run(tmp_path, "b", norm="post", losses=[5.0, 6.0], events=[("spike", 1), ("divergence", 2)])
    report = build(tmp_path)  # no sweep.json: the varied key is found from the configs
    assert report.keys == ["model.norm_position"]
    verdict = report.verdict()
    assert "pre was more stable than post" in verdict and verdict.startswith("Weak evidence"), verdict


@pytest.mark.slow
def test_eval_compare_cli(tiny_sweep_or_fake):
    out = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--compare", str(tiny_sweep_or_fake)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "| norm_position |" in out.stdout and "verdict:" in out.stdout
    assert (tiny_sweep_or_fake / "report.html").is_file()


@pytest.fixture
def tiny_sweep_or_fake(tmp_path):
    fake_run(tmp_path, "a", norm="pre", losses=[5.0, 2.0], val=[(2, 2.1)])
    fake_run(tmp_path, "b", norm="post", losses=[5.0, 3.0], val=[(2, 3.1)])
    return tmp_path


@pytest.mark.slow
def test_eval_compare_refuses_a_directory_without_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--compare", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "no runs" in out.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("sweep")
def test_report_of_a_real_sweep_matches_its_runs(tiny_sweep):
    """On runs the trainer wrote: every row's numbers are those of its metrics.jsonl."""
    report = build(tiny_sweep)
    assert len(report.runs) == 4 and all(s.status == "finished" for s in report.summaries.values())
    for run in report.runs:
        s = report.summaries[run.name]
        loss = logged(tiny_sweep / run.name, "loss")
        assert s.final_train_loss == loss[max(loss)]
        assert s.best_val_loss == min(logged(tiny_sweep / run.name, "val_loss").values())
        end = read_events(tiny_sweep / run.name, "end")[-1]
        assert s.final_val_loss == pytest.approx(end["val_loss"])
        assert math.isfinite(s.max_attn_logit) and s.params > 0
        # the default run's downstream task, as each member logged it last
        acc = logged(tiny_sweep / run.name, "eval/stdlib_next_line/acc")
        assert s.final_tasks["stdlib_next_line/acc"] == acc[max(acc)]
    md = (tiny_sweep / "report.md").read_text()
    for run in report.runs:
        assert f"{report.summaries[run.name].final_train_loss:.4f}" in md
    assert "final stdlib_next_line/acc_norm" in md
    for name in ("loss", "grad_norm", "val_loss", "layers", "lr", "eval_stdlib_next_line_acc"):
        assert (tiny_sweep / "plots" / f"{name}.png").read_bytes()[:8] == PNG


def test_verdict_pairs_across_keys_zipped_with_the_compared_label(tmp_path):
    """`attention: [mha, mqa]` zipped with n_kv_heads [4, 1]: n_kv_heads never matches across levels,
    so the cells are paired by the other keys and the seed alone, in the verdict and in the paired
    differences."""
    members = []
    for attention, kv, spikes, final in (("mha", 4, 0, 2.0), ("mqa", 1, 3, 2.5)):
        for task in ("a", "b"):
            for seed in (0, 1):
                name = f"{attention}-{task}-s{seed}"
                fake_run(tmp_path, name, seed=seed, losses=[5.0, final], events=[("spike", 1)] * spikes)
                members.append(
                    {
                        "name": name,
                        "variant": f"{attention}-{task}",
                        "seed": seed,
                        "values": {"model.n_kv_heads": kv},
                        "labels": {"attention": attention, "task": task},
                    }
                )
    manifest = {
        "source": "x",
        "keys": ["attention", "model.n_kv_heads", "task"],
        "compare": "attention",
        "members": members,
    }
    (tmp_path / "sweep.json").write_text(json.dumps(manifest))
    report = build(tmp_path)
    verdict = report.verdict()
    assert verdict.startswith("mha was more stable than mqa") and "in all 4 paired settings" in verdict, verdict
    (paired,) = comparisons(report)
    assert (paired.level, paired.base, paired.final.n) == ("mqa", "mha", 4)
    assert paired.final.mean == pytest.approx(0.5)


# --- learning-rate transfer --------------------------------------------------------------------------


def test_the_best_learning_rate_is_the_parabolas_vertex_and_an_edge_is_said():
    from transformer.report.stats import best_lr

    vertex = 4e-3
    points = {lr: 2.0 + (math.log(lr) - math.log(vertex)) ** 2 for lr in (1e-3, 3e-3, 1e-2, 3e-2)}
    assert best_lr(points) == (pytest.approx(vertex), False)
    assert best_lr({1e-3: 1.0, 3e-3: 2.0, 1e-2: 3.0}) == (1e-3, True)


def _transfer_sweep(tmp_path, optimum: dict[int, float], seed_optima: dict[int, dict[int, float]] | None = None):
    """A sweep of d_model x lr x 2 seeds whose final losses are a parabola in log lr around each
    width's `optimum` (seed 1 a constant 0.1 above seed 0), or each seed's own
    (`seed_optima[seed][d_model]`)."""
    members = []
    seeds = (0, 1) if seed_optima is None else tuple(seed_optima)
    for d_model, best in optimum.items():
        for lr in (1e-3, 3e-3, 1e-2, 3e-2):
            for seed in seeds:
                centre = best if seed_optima is None else seed_optima[seed][d_model]
                final = 2.0 + 0.1 * (math.log(lr) - math.log(centre)) ** 2 + 0.1 * seed
                name = f"d{d_model}-lr{lr}-s{seed}"
                fake_run(tmp_path, name, lr=lr, seed=seed, d_model=d_model, losses=[5.0, 4.0, final])
                values = {"model.d_model": d_model, "optim.lr": lr}
                members.append(
                    {"name": name, "variant": name.rsplit("-s", 1)[0], "seed": seed, "values": values, "labels": {}}
                )
    write_manifest(tmp_path, ["model.d_model", "optim.lr"], members)
    return build(tmp_path)


def test_lr_transfer_names_each_widths_best_lr_and_whether_it_moved(tmp_path):
    from transformer.report.stats import transfer, transfer_lines

    report = _transfer_sweep(tmp_path, {32: 8e-3, 64: 2.5e-3})
    best = transfer(report, "model.d_model")[()]
    assert best[32] == (pytest.approx(8e-3), False) and best[64] == (pytest.approx(2.5e-3), False)
    (line,) = transfer_lines(report)
    shift = math.log(2.5e-3 / 8e-3) / math.log(3.0)  # the grid's median step is x3
    # both seeds' curves have the same optimum: a zero-width interval around the shift
    interval = f"{shift:+.1f} grid steps, 95% interval over 2 seeds {shift:+.1f} to {shift:+.1f}"
    assert line == f"d_model: best lr 0.008 at 32, 0.0025 at 64; the optimum moved by {interval}."
    assert transfer(report, "model.n_layers") == {}  # not varied
    for run in (
        tmp_path / "d64-lr0.03-s0",
        tmp_path / "d64-lr0.03-s1",
        tmp_path / "d64-lr0.01-s0",
        tmp_path / "d64-lr0.01-s1",
    ):
        (run / "events.jsonl").write_text('{"event": "start", "step": 0}\n')  # not finished: two lrs left at 64
    partial = build(tmp_path)
    assert transfer(partial, "model.d_model") == {}  # one size with three learning rates says nothing


def test_lr_transfer_is_judged_by_the_interval_of_the_seeds_own_shifts(tmp_path):
    from transformer.report.stats import mean_interval, seed_shifts, t95, transfer_lines

    assert t95(1) == 12.706 and t95(30) == 2.042 and abs(t95(31) - 2.0395) < 1e-3 and abs(t95(1000) - 1.9623) < 1e-3
    mean, lo, hi = mean_interval([1.0, 2.0, 3.0])
    assert (mean, hi - mean, mean - lo) == (
        2.0,
        pytest.approx(4.303 / math.sqrt(3)),
        pytest.approx(4.303 / math.sqrt(3)),
    )
    # three seeds whose optima fall from 32 to 64 by about 1.5, 0.6 and 1.2 grid steps: the mean
    # moves more than a step, but not every seed does, so the interval leaves it open
    step = math.log(3.0)
    optima = {s: {32: 1e-2, 64: 1e-2 * math.exp(-k * step)} for s, k in ((0, 1.5), (1, 0.6), (2, 1.2))}
    report = _transfer_sweep(tmp_path, {32: 1e-2, 64: 1e-2}, optima)
    (shifts,) = seed_shifts(report, "model.d_model", step).values()
    assert shifts == pytest.approx([-1.5, -0.6, -1.2], abs=0.05)
    (line,) = transfer_lines(report)
    assert "whether the optimum moved a grid step is open (-1.1 grid steps, 95% interval over 3 seeds" in line, line


def test_lr_transfer_that_holds_is_said_to_stay_and_is_drawn_in_the_report(tmp_path):
    report = _transfer_sweep(tmp_path, {32: 4e-3, 64: 4.5e-3})
    from transformer.report.stats import transfer_lines

    assert transfer_lines(report) == [
        "d_model: best lr 0.004 at 32, 0.0045 at 64; the optimum stayed within one grid step"
        " (+0.1 grid steps, 95% interval over 2 seeds +0.1 to +0.1)."
    ]
    write_report(tmp_path, log=lambda _: None)
    md = (tmp_path / "report.md").read_text()
    assert "## Learning-rate transfer" in md and "stayed within one grid step" in md
    assert (tmp_path / "plots" / "lr_transfer.png").read_bytes().startswith(PNG)


def test_each_level_at_its_best_learning_rate_with_paired_intervals_and_steps_to_reach(tmp_path):
    """pre (the first level) is best at 3e-3 and ends at 3.0 (seed 0) and 3.1 (seed 1) on its
    training curve after 20 steps; post is best at 1e-2 and its curve of the same seed gets there at
    step 10: a 2x speedup. (Against the seeds' mean, 3.05, pre's seed 1 would never arrive: each seed
    is compared with its own.) Final (validation) losses 3.0/3.1 against 2.5/2.7 by seed: Δ -0.5 and
    -0.4, whose 95% interval over two seeds is -0.45 ± 12.706 * 0.0707 / sqrt(2)."""
    from transformer.report.tuned import tuned_rows

    best = {"pre": 3e-3, "post": 1e-2}
    curves = {"pre": [5 - 0.1 * s for s in range(1, 21)], "post": [max(2.4, 5 - 0.2 * s) for s in range(1, 21)]}
    finals = {("pre", 0): 3.0, ("pre", 1): 3.1, ("post", 0): 2.5, ("post", 1): 2.7}
    members = []
    for norm in ("pre", "post"):
        for lr in (1e-3, 3e-3, 1e-2):
            for seed in (0, 1):
                name = f"{norm}-lr{lr}-s{seed}"
                final = finals[(norm, seed)] if lr == best[norm] else 4.0
                curve = [x + 0.1 * seed for x in curves[norm]]
                fake_run(tmp_path, name, norm=norm, lr=lr, seed=seed, losses=curve, val=[(20, final)])
                values = {"model.norm_position": norm, "optim.lr": lr}
                members.append({"name": name, "variant": name.rsplit("-s", 1)[0], "seed": seed, "values": values})
    write_manifest(tmp_path, ["model.norm_position", "optim.lr"], [{**m, "labels": {}} for m in members])
    header, rows = tuned_rows(build(tmp_path))
    assert header[:3] == ["norm_position", "best lr", "final loss (95% CI)"]
    half = 12.706 * np.std([-0.5, -0.4], ddof=1) / math.sqrt(2)
    pre, post = rows
    assert pre[:2] == ["pre", "0.003"] and post[:2] == ["post", "0.01 (grid edge)"]
    assert post[3] == f"{-0.45:+.4f} [{-0.45 - half:+.4f}, {-0.45 + half:+.4f}] (n=2)"
    assert pre[3] == "+0.0000 [+0.0000, +0.0000] (n=2)"
    assert pre[4:] == ["20 [20, 20] (2/2 seeds)", "1.00x"] and post[4:] == ["10 [10, 10] (2/2 seeds)", "2.00x"]
    # a level that never gets there is said to, not given a speed
    slow = tmp_path / "slow"
    slow.mkdir()
    for i, m in enumerate(members):
        norm, lr, seed = m["values"]["model.norm_position"], m["values"]["optim.lr"], m["seed"]
        curve = curves["pre"] if norm == "pre" else [4.0] * 20
        fake_run(slow, m["name"], norm=norm, lr=lr, seed=seed, losses=curve, val=[(20, 3.0 + i / 100)])
    write_manifest(slow, ["model.norm_position", "optim.lr"], [{**m, "labels": {}} for m in members])
    assert tuned_rows(build(slow))[1][1][-1] == "not reached"


def test_stability_statistics_against_the_learning_rate_are_the_runs_own(tmp_path):
    """Wortsman et al.'s figures: each run's max attention logit, min attention entropy and max
    |output log Z| (the extremes of what it logged) against the learning rate, with log Z over tokens."""
    members = []
    for lr in (1e-3, 1e-2):
        for seed in (0, 1):
            name = f"pre-lr{lr:g}-s{seed}"
            run = fake_run(tmp_path, name, lr=lr, seed=seed, losses=[5.0, 4.0, 3.5, 3.0], stats=True)
            if lr == 1e-3 and seed == 0:  # a non-finite value, as the trainer writes it, is passed over
                with open(run / "metrics.jsonl", "a") as f:
                    f.write(
                        json.dumps({"step": 3, "attn_entropy": ["nan", 0.45], "attn_logit_max": ["inf", 1.0]}) + "\n"
                    )
            with open(run / "metrics.jsonl", "a") as f:
                for step, log_z in ((2, -1.5 * lr * 1e3), (4, 2.0 + seed)):
                    f.write(json.dumps({"step": step, "log_z_mean": log_z}) + "\n")
            values = {"model.norm_position": "pre", "optim.lr": lr}
            members.append({"name": name, "variant": name[:-3], "seed": seed, "values": values, "labels": {}})
    write_manifest(tmp_path, ["optim.lr", "model.norm_position"], members)
    report = build(tmp_path)
    s = report.summaries["pre-lr0.01-s1"]
    assert (s.max_attn_logit, s.min_attn_entropy, s.max_abs_log_z) == (8.0, 0.4, 15.0)  # 2*4, min(0.5, 0.4), |-15|
    assert report.summaries["pre-lr0.001-s1"].max_abs_log_z == 3.0  # max(|-1.5|, 3)
    flagged = report.summaries["pre-lr0.001-s0"]
    assert flagged.min_attn_entropy == 0.4 and flagged.max_attn_logit == math.inf  # an infinite logit is the news
    write_report(tmp_path, log=lambda _: None)
    for stem in ("attn_logit_lr", "attn_entropy_lr", "log_z_lr", "log_z"):
        assert (tmp_path / "plots" / f"{stem}.png").read_bytes()[:8] == PNG


def test_a_report_by_another_varied_key(tmp_path):
    """`eval.py --compare DIR --by KEY`: the same runs compared by another key they vary, into
    report-by-KEY.* beside the sweep's own report; a key they do not vary is one line, exit 2."""
    runs = {
        f"{norm},lr-{lr:g}-s{seed}": dict(norm=norm, lr=lr, seed=seed)
        for norm in ("pre", "post")
        for lr in (1e-3, 1e-2)
        for seed in (0, 1)
    }
    for name, r in runs.items():
        final = 2.0 + (0.5 if r["lr"] == 1e-2 else 0.0) + 0.01 * r["seed"]
        fake_run(tmp_path, name, norm=r["norm"], lr=r["lr"], seed=r["seed"], losses=[5.0, final], val=[(2, final)])
    sweep_dir(tmp_path, runs)
    path = write_report(tmp_path, log=lambda _: None, by="optim.lr")
    assert path.name == "report-by-lr.md" and (tmp_path / "report-by-lr.json").is_file()
    assert (tmp_path / "plots-by-lr" / "loss.png").is_file() and not (tmp_path / "report.md").exists()
    (paired,) = json.loads((tmp_path / "report-by-lr.json").read_text())["paired"]
    assert paired["level"] == "0.01" and paired["final"]["mean"] == pytest.approx(0.5)
    out = subprocess.run(
        [sys.executable, "eval.py", "--compare", str(tmp_path), "--by", "model.n_layers"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "eval.py: error: --compare: --by: 'model.n_layers' is not a key these runs vary (model.norm_position, optim.lr)"
    ]


def test_the_report_never_writes_through_a_planted_link(tmp_path):
    """A run directory received from others may hold links where the report goes: report.md linked to
    a file elsewhere is replaced, not written through; plots/ linked to a directory elsewhere is
    refused in one line (exit 2), with nothing written there."""
    victim, elsewhere = tmp_path / "victim.txt", tmp_path / "elsewhere"
    victim.write_text("DATA")
    elsewhere.mkdir()
    runs = tmp_path / "runs"
    for seed in (0, 1):
        fake_run(runs, f"pre-s{seed}", seed=seed, losses=[5.0, 3.0], val=[(2, 3.0)])
        fake_run(runs, f"post-s{seed}", norm="post", seed=seed, losses=[5.0, 3.1], val=[(2, 3.1)])
    (runs / "report.md").symlink_to(victim)
    write_report(runs, log=lambda _: None)
    assert victim.read_text() == "DATA" and not (runs / "report.md").is_symlink()
    (runs / "report.md").unlink()
    shutil.rmtree(runs / "plots")
    (runs / "plots").symlink_to(elsewhere)
    out = subprocess.run([sys.executable, "eval.py", "--compare", str(runs)], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "plots is a symbolic link: refusing to write" in line and not any(elsewhere.iterdir())
