"""Weights & Biases as a second home for a run's scalars (`logging.wandb`, off by default): the same
tags TensorBoard gets, the resolved config, one W&B run per run directory (resumed with it), and one
group per sweep. Imported by the training loop; `wandb` itself only when a mode is on."""

from __future__ import annotations

import configparser
import hashlib
import netrc
import os
import urllib.parse
from pathlib import Path

from transformer.config import Config, ConfigError
from transformer.rundir import ScalarSink

SWEEP_MANIFEST = "sweep.json"  # transformer/sweep/expansion.py's MANIFEST: a member's parent directory holds it


WANDB_HOST = "https://api.wandb.ai"  # the server W&B logs to unless WANDB_BASE_URL or its settings name another


def _wandb_settings() -> dict[str, str]:
    """The [default] section of W&B's settings files (global, then this directory's), as wandb reads them."""
    home = os.environ.get("WANDB_CONFIG_DIR") or "~/.config/wandb"
    parser = configparser.ConfigParser()
    try:
        parser.read([Path(home).expanduser() / "settings", Path("wandb") / "settings"])
    except (configparser.Error, OSError, UnicodeDecodeError):
        return {}
    return dict(parser["default"]) if parser.has_section("default") else {}


def _missing_wandb_key() -> str | None:
    """None where W&B would find an API key without asking (no wandb import, no network): WANDB_API_KEY,
    an identity token file, its settings, or the netrc entry `wandb login` writes; else where it looked."""
    settings = _wandb_settings()
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.get("api_key"):
        return None
    host = os.environ.get("WANDB_BASE_URL") or settings.get("base_url") or WANDB_HOST
    path = Path(os.environ.get("NETRC") or "~/.netrc").expanduser()
    if not os.environ.get("NETRC") and not path.exists() and Path("~/_netrc").expanduser().exists():
        path = Path("~/_netrc").expanduser()
    try:
        entry = netrc.netrc(str(path)).authenticators(urllib.parse.urlsplit(host).netloc)
    except (OSError, netrc.NetrcParseError):
        entry = None
    if entry is not None and entry[2]:
        return None
    return f"none was found for {host} (in WANDB_API_KEY or {path})"


def check_credentials(cfg: Config) -> None:
    """`logging.wandb.mode: online` needs an API key W&B finds without asking; checked when a run
    starts (and by --dry-run), before any work, and not when a saved config is read: a run directory
    copied to a machine without a key must still be evaluated and compared."""
    missing = _missing_wandb_key() if cfg.logging.wandb.mode == "online" else None
    if missing is not None:
        raise ConfigError(
            "logging.wandb.mode",
            f"online needs a W&B API key, and {missing}: run `wandb login`, or use logging.wandb.mode=offline "
            "(`wandb sync` uploads later)",
        )


def scalar_sinks(cfg: Config, workdir: Path | None, lead: bool) -> list[ScalarSink]:
    """The extra sinks a run's scalars go to: a W&B run when `logging.wandb.mode` is not disabled."""
    if cfg.logging.wandb.mode == "disabled" or workdir is None or not lead:
        return []
    return [WandbSink(cfg, workdir)]


def sweep_group(workdir: Path) -> str | None:
    """A sweep member's group: its sweep's directory name."""
    return workdir.resolve().parent.name if (workdir.parent / SWEEP_MANIFEST).is_file() else None


class WandbSink:
    def __init__(self, cfg: Config, workdir: Path):
        import wandb

        w = cfg.logging.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            group=w.group or sweep_group(workdir),
            name=workdir.resolve().name,
            # the same W&B run across resumes of one run directory
            id=hashlib.sha1(str(workdir.resolve()).encode()).hexdigest()[:16],
            resume="allow",
            dir=str(workdir),
            mode=w.mode,
            config=cfg.to_dict(),
            settings=wandb.Settings(console="off", silent=True),
        )

    def scalars(self, step: int, tags: list[tuple[str, float]]) -> None:
        self.run.log(dict(tags), step=step)

    def close(self) -> None:
        self.run.finish()
