"""The supervision loop and its optional features (supervisor/launch/feature.py, the list in
supervisor/features.py): the loop runs a whole launch with none of them, and a feature is its
folder and its line — deleted from the package as it ships, the rest still launches, crashes,
resumes and finishes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from importlib import import_module
from pathlib import Path

import pytest
from scripted_loop import Script, crash, run, success

from rtrain.supervisor import features
from rtrain.supervisor.config import load_config
from rtrain.supervisor.launch.feature import Feature
from rtrain.supervisor.launch.loop import LaunchSpec, launch
from rtrain.supervisor.records.events import read_events

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = [name.split(".")[2] for name in features.FEATURES]
# Features that other parts still reach into by name: the CLI's `inspect/prune s3://...` (mirror),
# `rtrain status`'s snapshot listing and the worker's part format (memtier), the config's
# [[hooks]] table (hooks). Every other feature deletes cleanly (the test below does it).
ENTANGLED = {"mirror", "memtier", "hooks"}

# A training script that reports what rtrain gave it: the attempt's environment names, and the
# step it resumed from.
CHILD = textwrap.dedent("""\
    import json, os, sys
    import torch
    import rtrain

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, every=2, keep=None)
    start = ck.restore()
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({"resumed": start, "env": dict(os.environ)}) + "\\n")
    for step in range(start, 6):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ck.maybe_save(step + 1)
    ck.close()
""")


def test_each_listed_feature_makes_a_feature_and_each_feature_folder_is_listed():
    for name in features.FEATURES:
        assert callable(import_module(name).make), name
    listed = {Path(*name.split(".")[2:]).with_suffix(".py") for name in features.FEATURES}
    on_disk = {p.relative_to(ROOT / "supervisor")
               for p in (ROOT / "supervisor").glob("*/feature.py")}
    assert on_disk - {Path("launch/feature.py")} == listed  # launch/: the protocol itself


def test_a_feature_overrides_only_what_it_uses_and_the_protocol_does_nothing_by_default():
    base = Feature()
    assert base.environment(None, {}) == {} and base.attempt_end(None, None) == {}
    assert base.spawn(None, None, lambda: False) is None and base.pids() == []


def test_the_scripted_loop_runs_with_no_feature(tmp_path):
    script = Script([crash(), success()])
    config = load_config({"run_dir": tmp_path / "run"}, None, tmp_path)
    spec = LaunchSpec(command=["train.py"], config=config, echo=False, cwd=tmp_path,
                      features=())
    assert launch(spec, script.seams()) == 0
    kinds = [e["kind"] for e in read_events(tmp_path / "run" / "events.jsonl")]
    assert kinds == ["launch", "exit", "classification", "decision", "launch", "exit",
                     "decision", "finished"]
    # With every feature, the same script: the same records, and the one feature that emits
    # on its own says the relaunch starts fresh (nothing was saved to resume from).
    code, events = run(tmp_path / "all", Script([crash(), success()]))
    assert code == 0 and [e["kind"] for e in events] == [*kinds[:4], "cannot_resume",
                                                         *kinds[4:]]


@pytest.mark.slow
# The default tier launches for real with every feature folder but the entangled ones deleted
# (test_deleting_a_feature_folder_...), and runs the loop with no feature at all, scripted.
@pytest.mark.soak
def test_a_whole_launch_with_no_feature_crashes_resumes_and_finishes(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(CHILD)
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("RTRAIN_FAULTS", "crash@step=3,attempt=0")
    config = load_config({"run_dir": tmp_path / "run"}, None, tmp_path)
    spec = LaunchSpec(command=[sys.executable, "train.py", str(out)], config=config,
                      echo=False, cwd=tmp_path, features=())
    assert launch(spec) == 0
    attempts = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["resumed"] for a in attempts] == [0, 2]  # resumed from the step-2 checkpoint
    for a in attempts:  # no feature gave the attempt its variables
        env = a["env"]
        assert "RTRAIN_RUN_ID" not in env and "RTRAIN_MEMORY_DIR" not in env
        # (torch sets inductor's own default when it imports; never the run dir's cache)
        assert "compile-cache" not in env.get("TORCHINDUCTOR_CACHE_DIR", "")
    events = read_events(tmp_path / "run" / "events.jsonl")
    assert [e["failure"] for e in events if e["kind"] == "classification"] == ["crash"]
    assert events[-1]["kind"] == "finished"
    assert not (tmp_path / "run" / "compile-cache").exists()


@pytest.mark.slow
def test_deleting_a_feature_folder_and_its_line_leaves_a_package_that_launches(shipped,
                                                                              tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(shipped.wheel) as z:
        z.extractall(site)
    sup = site / "rtrain" / "supervisor"
    registry = sup / "features.py"
    text = registry.read_text()
    gone = [f for f in FOLDERS if f not in ENTANGLED]
    for folder in gone:
        subprocess.run(["rm", "-r", str(sup / folder)], check=True)
        text, n = re.subn(rf'^ *"rtrain\.supervisor\.{folder}\.feature",.*\n', "", text,
                          flags=re.M)
        assert n == 1, folder
    registry.write_text(text)
    (tmp_path / "train.py").write_text(CHILD)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(site), "RTRAIN_FAULTS": "crash@step=3,attempt=0"}
    r = subprocess.run([sys.executable, "-m", "rtrain", "launch", "--run-dir", "run", "train.py",
                        str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=150, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    attempts = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["resumed"] for a in attempts] == [0, 2]
    assert "RTRAIN_RUN_ID" not in attempts[0]["env"]  # the trackers were deleted
    assert "RTRAIN_MEMORY_DIR" in attempts[0]["env"]  # the memory tier was not
    # What stayed of the package imports nothing that was deleted.
    probe = ("import pkgutil, rtrain.supervisor as s\n"
             "for m in pkgutil.walk_packages(s.__path__, 'rtrain.supervisor.'):\n"
             "    __import__(m.name)\n")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
