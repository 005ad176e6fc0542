"""Attempt 0: commit checkpoints 1 and 2, then report a non-finite loss. Later attempts: print
where they resumed from and the lr knob, then finish."""

import json
import os
import sys

import rtrain
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.supervisor.core.protocol import ENV_CKPT_DIR, ENV_RESUME_FROM, ENV_SETTINGS

if os.environ["RTRAIN_ATTEMPT"] == "0":
    for step in (1, 2):
        p = PendingCheckpoint(os.environ[ENV_CKPT_DIR], step)
        p.write_json("state.json", {"step": step})
        p.commit({"epoch": 0, "samples_seen": step})
    rtrain.write_exit_record("nonfinite", "loss is NaN for 5 consecutive steps", step=2)
    sys.exit(1)
print(json.dumps({"resume_from": os.environ.get(ENV_RESUME_FROM),
                  "settings": json.loads(os.environ[ENV_SETTINGS])}), flush=True)
