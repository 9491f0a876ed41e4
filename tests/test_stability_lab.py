"""The stability lab's training studies (issue 34) in their quick forms: each study file's own keys
with a smaller grid, model and run, through train.py, and its report naming what the full study
reports (protocol 1, the gradient profile at init, is tests/test_gradprofile.py's)."""

import json
import subprocess
import sys

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]

SMALL = [
    "sweep.seeds=[0]",
    "model.d_model=32",
    "data.seq_len=32",
    "data.val_windows=4",
    "train.batch_size=4",
    "train.steps=8",
    "train.eval_every=8",
    "checkpoint.every=8",
    "monitor.stats_every=4",
    "optim.warmup_steps=2",
]
LRS = "optim.lr: [1.0e-2, 3.0e-1]"
QUICK = {
    # protocol 2: Pre-LN against Post-LN, with and without warm-up
    "xiong_training": [f"sweep.grid={{model.norm_position: [pre, post], {LRS}}}"],
    # protocol 3: qk-layernorm, the logit statistics against the learning rate
    "wortsman": [f"sweep.grid={{model.qk_norm: [false, true], {LRS}}}"],
    # protocol 3's further interventions: the two forms of weight decay (the study's zip), a warm-up
    "wortsman_interventions": [f"sweep.grid={{optim.warmup_steps: [2], {LRS}}}"],
    # protocol 3's µP: the study's parametrizations, its base at the quick form's narrower width
    "wortsman_mup": [
        "sweep.zip=[{model.parametrization: [standard, mup], model.mup_base_d_model: [null, 32]}]",
        f"sweep.grid={{model.d_model: [32, 64], {LRS}}}",
    ],
    # protocol 4: QK-clip at a threshold the tiny model's logits (~0.06) pass
    "qk_clip": [
        "sweep.zip=[{intervention: [none, qk_clip], model.qk_clip: [null, 0.03]}]",
        f"sweep.grid={{{LRS}}}",
    ],
}
FINDINGS = (
    "**Verdict.**",
    "## Paired differences over seeds",
    "## Learning-rate sensitivity (Wortsman et al. 2023)",
    "## Each at its best learning rate",
    "max attention logit against learning rate",
)


@pytest.mark.slow
@pytest.mark.parametrize("study", QUICK)
def test_quick_form_runs_and_its_report_names_each_finding(study, tmp_path):
    cmd = [sys.executable, "train.py", f"configs/ablations/{study}.yaml", "--workdir", str(tmp_path)]
    small = [o for o in SMALL if o.partition("=")[0] not in " ".join(QUICK[study])]  # a key the study sweeps
    out = subprocess.run([*cmd, *small, *QUICK[study]], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    report = (tmp_path / "report.md").read_text()
    for finding in FINDINGS:
        assert finding in report, (finding, report[:2000])
    assert (tmp_path / "plots" / "attn_logit_lr.png").is_file()
    if study == "qk_clip":  # the clip acted, and the run without it never logs it
        rows = [json.loads(line) for line in (tmp_path / "qk_clip-adamw-lr0.3-s0" / "metrics.jsonl").open()]
        assert sum(r.get("qk_clipped_heads", 0) for r in rows) > 0
        plain = (tmp_path / "none-adamw-lr0.3-s0" / "metrics.jsonl").read_text()
        assert "qk_clipped_heads" not in plain
