"""`rtrain check-resume`: does a training script resume exactly?

The script (one that uses rtrain.Checkpointer and ends by itself) runs, each run with a fresh
checkpoint dir under the work dir and the same settings and environment. The processes that stand
for the original run (the uninterrupted ones and the one stopped) also start from the same
entropy (python's and numpy's global generators, PYTHONHASHSEED); a resumed process draws its
own, as a relaunch does (worker/checkresume/check_order.py says why):

1. straight to its end: the reference (`straight/`);
2. for each stop asked (`--stop`, default both): stopped at step `--at` (default half the
   reference's steps) and resumed to its end, in the same checkpoint dir, as a relaunch would:
   - `kill/`: a save at that step, then SIGKILL to the process group (a lost node);
   - `signal/`: SIGTERM to the process group at that step: the Checkpointer saves at the step
     boundary and exits 75 (preemption);
3. only when a resumed run differs: a second uninterrupted run (`repeat/`), which tells a script
   that does not reproduce itself from one that does not resume.

Each run's final state is in a checkpoint (under check-resume the worker saves the last step at
`close()` or exit); the final checkpoints are verified fully, then compared tensor by tensor
(`compare.py`) and the likely causes named from the worker's evidence (`causes.py`). The work dir
is removed when the script resumes exactly and no --work-dir was given; kept otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, Verdict, verify
from rtrain.supervisor.checkresume import causes as why
from rtrain.supervisor.checkresume.compare import Comparison, compare, read
from rtrain.supervisor.checkresume.runs import Ran, ScriptFailed, run
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.core.protocol import (
    ENV_ATTEMPT,
    ENV_CHECK_RESUME,
    ENV_CKPT_DIR,
    ENV_RESUME_FROM,
    ENV_RUN_DIR,
    ENV_SETTINGS,
)
from rtrain.supervisor.launch.argv_templates import render

STOPS = ("kill", "signal")
_HOW = {"kill": "a save, then SIGKILL", "signal": "SIGTERM (save, exit 75)"}
# The user's own RTRAIN_* that the runs keep: signing. Everything else is the check's to set
# (a run must not resume from the user's checkpoints, inject faults or encrypt).
_KEEP = ("RTRAIN_SIGNING_KEY", "RTRAIN_SIGNING_KEY_FILE", "RTRAIN_ALLOW_SHARED_KEY",
         "RTRAIN_ALLOW_XXH3_SIGNED")
_SHOWN = 5  # differences listed per stop
# The seed of python's and numpy's global generators (and PYTHONHASHSEED, unless the caller set
# one) in every process of the original run: without it each process draws its own from the OS,
# and two uninterrupted runs of a script that never seeds them end in other generator states.
_ENTROPY = 20240601


@dataclass(frozen=True)
class Options:
    script: str
    args: tuple[str, ...] = ()
    at: int | None = None
    stops: tuple[str, ...] = STOPS
    settings: dict[str, Any] = field(default_factory=dict)
    python: str = "python3"
    cwd: Path = Path(".")
    work_dir: Path | None = None
    timeout_s: float = 1800.0
    key: bytes | None = None  # signing key, for verifying the runs' checkpoints


@dataclass(frozen=True)
class StopResult:
    stop: str  # "kill" or "signal"
    stop_step: int  # the checkpoint the resumed run started from
    comparison: Comparison


@dataclass(frozen=True)
class Report:
    script: str
    final_step: int
    stops: tuple[StopResult, ...]
    reproducible: bool | None  # a second uninterrupted run matched (None: not needed)
    causes: tuple[why.Cause, ...]
    work_dir: Path
    kept: bool

    @property
    def exact(self) -> bool:
        return all(s.comparison.identical for s in self.stops)


def check_resume(opts: Options, say: Callable[[str], None] = lambda _: None) -> Report:
    """Run the script as the module docstring says and compare. Raises UsageError (exit 2)
    when the script cannot be checked: it fails, saves nothing, or does not stop."""
    if not (opts.cwd / opts.script).is_file():
        raise UsageError(f"{opts.script}: no such script")
    if opts.at is not None and opts.at < 1:
        raise UsageError(f"--at {opts.at}: a step of 1 or more")
    bad = [s for s in opts.stops if s not in STOPS]
    if bad or not opts.stops:
        raise UsageError(f"--stop {','.join(bad) or '(none)'}: kill, signal or both")
    work, given = _work_dir(opts.work_dir)
    try:
        report = _check(opts, work, say)
    except BaseException:
        say(f"work dir kept: {work} (each run's output.log and checkpoints)")
        raise
    keep = given or not report.exact
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return replace(report, kept=keep)


def _work_dir(given: Path | None) -> tuple[Path, bool]:
    if given is None:
        return Path(tempfile.mkdtemp(prefix="rtrain-check-resume-")), False
    if given.exists() and (not given.is_dir() or any(given.iterdir())):
        raise UsageError(f"--work-dir {given}: not an empty directory")
    given.mkdir(parents=True, exist_ok=True)
    return given.resolve(), True


def _check(opts: Options, work: Path, say: Callable[[str], None]) -> Report:
    straight, ran = _run(opts, work / "straight", "uninterrupted run")
    if straight.step < 2:
        raise ScriptFailed(f"the uninterrupted run ended at step {straight.step}: check-resume "
                           "needs at least 2 steps")
    at = opts.at if opts.at is not None else straight.step // 2
    if at >= straight.step:
        raise UsageError(f"--at {at}: the uninterrupted run ended at step {straight.step}; "
                         "stop before it")
    say(f"uninterrupted run: step {straight.step} in {ran.seconds:.1f} s")
    reference = read(straight.path)
    records = [_evidence(straight)]
    results, restored = [], True
    for stop in opts.stops:
        run_dir = work / stop
        stopped, _ = _run(opts, run_dir, f"run stopped at step {at} by {stop}",
                          order={"stop_at": at, "stop": stop}, log="stop.log",
                          expect=-signal.SIGKILL if stop == "kill" else 75)
        if _evidence(stopped).get("stopped") != stop:
            raise ScriptFailed(f"the run stopped at step {at} by {stop} left no checkpoint of its "
                               f"stop (newest: {stopped.path.name}); its output: "
                               f"{run_dir / 'stop.log'}")
        final, ran = _run(opts, run_dir, f"run resumed from {stopped.path.name}",
                          resume_from=stopped.path, log="resume.log")
        restored &= _evidence(final).get("restored_step") == stopped.step
        records += [_evidence(stopped), _evidence(final)]
        result = StopResult(stop, stopped.step, compare(reference, read(final.path)))
        results.append(result)
        say(f"stopped at step {stopped.step} by {_HOW[stop]}, resumed: step {final.step} in "
            f"{ran.seconds:.1f} s: " + ("identical" if result.comparison.identical else
                                       f"{len(result.comparison.differences)} differences"))
    reproducible = None
    differs = not all(r.comparison.identical for r in results)
    if differs:
        again, _ = _run(opts, work / "repeat", "second uninterrupted run")
        records.append(_evidence(again))
        reproducible = compare(reference, read(again.path)).identical
        say("second uninterrupted run: " + ("identical to the first" if reproducible
                                            else "differs from the first"))
    evidence = why.merge(records, differs=differs, reproducible=reproducible, restored=restored)
    return Report(opts.script, straight.step, tuple(results), reproducible,
                  tuple(why.likely_causes(evidence)), work, True)


def _evidence(v: Verdict) -> dict[str, Any]:
    info = (v.manifest or {}).get("info")
    record = info.get("check_resume") if isinstance(info, dict) else None
    return record if isinstance(record, dict) else {}


def _run(opts: Options, run_dir: Path, what: str, *, order: dict[str, Any] | None = None,
         resume_from: Path | None = None, log: str = "output.log",
         expect: int = 0) -> tuple[Verdict, Ran]:
    """One run of the script in `run_dir`; the newest checkpoint after it, fully verified."""
    ckpt_dir = run_dir / "checkpoints"
    argv, env = command(opts, run_dir, dict(os.environ), order=order, resume_from=resume_from)
    ran = run(argv, cwd=opts.cwd, env=env, log=run_dir / log, timeout_s=opts.timeout_s)
    if ran.returncode != expect:
        if ran.returncode == 0:
            raise ScriptFailed(f"the {what} ran to its end: the script must call "
                               f"ckpt.maybe_save(step) at every step; its output: {ran.log}")
        raise ScriptFailed(f"the {what} of {opts.script} ended with {_exit(ran.returncode)}"
                           f"{': ' + ran.last_line() if ran.last_line() else ''}; its output: "
                           f"{ran.log}")
    found = list_checkpoints(ckpt_dir)
    if not found:
        raise ScriptFailed(f"the {what} of {opts.script} saved no checkpoint where check-resume "
                           "asked (RTRAIN_CKPT_DIR): the script must use rtrain.Checkpointer "
                           f"and call maybe_save(step); its output: {ran.log}")
    v = verify(found[0][1], Level.FULL, opts.key)
    if not v.ok:
        raise ScriptFailed(f"the {what}: {v.path.name} does not verify: {v.reason}")
    return v, ran


def command(opts: Options, run_dir: Path, environ: dict[str, str], *,
            order: dict[str, Any] | None = None,
            resume_from: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one run in `run_dir` (pure): the caller's environment less its
    RTRAIN_* (but signing), the run's dirs and settings, the order, and for a process of the
    original run (not resumed) the entropy they share (worker/checkresume/check_order.py says why a
    resumed run draws its own, as a relaunch does)."""
    ckpt_dir = run_dir / "checkpoints"
    env = {k: v for k, v in environ.items() if not k.startswith("RTRAIN_") or k in _KEEP}
    order = dict(order or {})
    if resume_from is None:
        order["entropy"] = _ENTROPY
        env.setdefault("PYTHONHASHSEED", str(_ENTROPY))
    env.update({ENV_CKPT_DIR: str(ckpt_dir), ENV_RUN_DIR: str(run_dir),
                ENV_SETTINGS: json.dumps(opts.settings),
                ENV_ATTEMPT: "1" if resume_from is not None else "0",
                ENV_CHECK_RESUME: json.dumps(order)})
    if resume_from is not None:
        env[ENV_RESUME_FROM] = str(resume_from)
    values = {**opts.settings, "ckpt_dir": str(ckpt_dir), "run_dir": str(run_dir),
              "checkpoint": str(resume_from or ""), "attempt": env[ENV_ATTEMPT]}
    return [opts.python, opts.script, *render(list(opts.args), values)], env


def _exit(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def render_report(r: Report) -> str:
    """The report as text: one line per run, the first differences, the likely causes."""
    lines = [f"check-resume {r.script}: uninterrupted to step {r.final_step}"]
    for s in r.stops:
        c = s.comparison
        head = f"  stopped at step {s.stop_step} by {_HOW[s.stop]}, resumed to the end: "
        if c.identical:
            lines.append(head + f"identical ({c.compared} tensors and values)")
            continue
        lines.append(head + f"{len(c.differences)} of {c.compared} tensors and values differ")
        lines += [f"    {d.name}: {d.how}" for d in c.differences[:_SHOWN]]
        if len(c.differences) > _SHOWN:
            lines.append(f"    ... and {len(c.differences) - _SHOWN} more")
    if r.exact:
        lines.append("resumes exactly")
    else:
        if r.reproducible is not None:
            lines.append("  a second uninterrupted run: " + (
                "identical to the first" if r.reproducible else "differs from the first"))
        lines.append("does not resume exactly; likely causes:")
        lines += [f"  - {c.reason}" for c in r.causes]
    if r.kept:
        lines.append(f"work dir kept: {r.work_dir} (each run's logs and checkpoints)")
    return "\n".join(lines)


def report_json(r: Report) -> dict[str, Any]:
    return {"script": r.script, "exact": r.exact, "final_step": r.final_step,
            "stops": [{"stop": s.stop, "stop_step": s.stop_step,
                       "identical": s.comparison.identical, "compared": s.comparison.compared,
                       "differences": [{"name": d.name, "how": d.how}
                                       for d in s.comparison.differences]} for s in r.stops],
            "reproducible": r.reproducible,
            "causes": [{"kind": c.kind.value, "reason": c.reason} for c in r.causes],
            "work_dir": str(r.work_dir) if r.kept else None}
