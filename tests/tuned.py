"""The rtrain command with tuning constants set from `tuning.json` in the current directory.

Tuning constants (the hang timeout's floor, the pressure trend's window, the sample interval,
...) are the code's, not settings: a config file that names one is refused
(supervisor/config.py, `KEYS`). A test still needs some of them in seconds rather than minutes,
so this launcher, which the harness runs instead of `python -m rtrain`, passes them to
`load_config` as code does. Without a `tuning.json` (or a $TUNING_FILE) it is the rtrain
command unchanged.

`tuning.json` holds the config's shape: {"sample_interval_s": 0.1, "hang": {"floor_s": 1}}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

TUNING = "tuning.json"
TUNING_FILE = "TUNING_FILE"  # names a tuning.json elsewhere (a Slurm job runs in the repository)


def flat(tuning: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"hang": {"floor_s": 1}} -> {"hang.floor_s": 1}, as load_config's overrides name them."""
    out: dict[str, Any] = {}
    for key, value in tuning.items():
        if isinstance(value, dict) and not prefix and key != "settings":
            out.update(flat(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def split(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config in the file's shape, split into its settings (for rtrain.toml) and its tuning
    constants (for tuning.json)."""
    from rtrain.supervisor.config import KEYS

    settings: dict[str, Any] = {}
    constants: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in KEYS:
            settings[key] = value
        elif isinstance(value, dict):  # a table: [restart], [hang], ...
            for sub, v in value.items():
                into = settings if f"{key}.{sub}" in KEYS else constants
                into.setdefault(key, {})[sub] = v
        else:
            constants[key] = value
    return settings, constants


def write(directory: Path, tuning: dict[str, Any]) -> Path:
    """Write `tuning` where the command run in `directory` reads it."""
    path = Path(directory) / TUNING
    path.write_text(json.dumps(tuning))
    return path


def install(tuning: dict[str, Any]) -> None:
    """Have every later load_config in this process apply `tuning` under the command line."""
    from rtrain.supervisor import config

    load = config.load_config
    constants = flat(tuning)

    def tuned(cli: dict[str, Any], config_file: Path | None, cwd: Path) -> config.Config:
        return load({**cli, **constants}, config_file, cwd)

    config.load_config = tuned


def main() -> None:
    # Run as a script, this folder came first on sys.path: its modules are not rtrain's.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    path = Path(os.environ.get(TUNING_FILE) or TUNING)
    if path.is_file():
        install(json.loads(path.read_text()))
    from rtrain.supervisor.cli import main as rtrain

    rtrain()


if __name__ == "__main__":
    main()
