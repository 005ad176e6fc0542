"""`rtrain status`: where a run stands, read from its files alone.

Reads events.jsonl, state.json, the lock file and the checkpoint dir; takes no lock and writes
nothing, so it is safe beside a live supervisor. Events are the newest truth (state.json is
written at decisions only); state.json fills in what events do not carry (budgets, the status
of a run whose log was moved aside).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import parts, quarantine
from rtrain.checkpoint.verify import Level, Status
from rtrain.supervisor.ckpt import keepcopy
from rtrain.supervisor.ckpt.foreign import select_resume_any_format
from rtrain.supervisor.commands.human_units import human_bytes, human_duration, human_rate
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.core.event_schema import KINDS, Kind
from rtrain.supervisor.core.pid_alive import pid_alive
from rtrain.supervisor.core.untrusted_text import safe
from rtrain.supervisor.memtier import shmdir
from rtrain.supervisor.records import recovery
from rtrain.supervisor.records.lock import HOLDER_MAX, LOCK_NAME
from rtrain.supervisor.records.runstate import STATE_FILE, load_state
from rtrain.supervisor.records.timeline import Timeline, failure_kind, read_timeline


@dataclass(kw_only=True)
class RunSummary:
    run_dir: Path
    ckpt_dir: Path
    status: str
    """running, finished, gave_up or preempted (state.json, else the last closing event)."""
    reason: str = ""
    supervisor_pid: int | None = None
    """pid written in the lock file by the live (or killed) supervisor; None: none holds it."""
    supervisor_alive: bool | None = None
    """Whether that pid runs; None when it is on another host and cannot be told."""
    attempts: int = 0
    """Attempts launched."""
    attempt: int | None = None
    """Number of the newest attempt launched."""
    failures: dict[str, int] = field(default_factory=dict)
    """Classified endings by kind, e.g. {"oom_gpu": 2}."""
    budgets_used: dict[str, int] = field(default_factory=dict)
    level: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    checkpoint: Path | None = None
    """Newest checkpoint that verifies quick."""
    checkpoint_step: int | None = None
    checkpoint_age_s: float | None = None
    """Seconds since that checkpoint was committed (its manifest's `created`)."""
    skipped_saves: int = 0
    """Saves the worker skipped (full disk, storage errors): `save_skipped` events."""
    failure_saves: int = 0
    """Checkpoints committed as an exception ended the worker (`checkpoint_at_failure`)."""
    last_failure_save: dict[str, Any] | None = None
    """The last of them: attempt, step, exception."""
    last_skipped: dict[str, Any] | None = None
    """The last skipped save: step, reason."""
    unsaved: str | None = None
    """Set when the run's last ending left its final state in no checkpoint."""
    bad_checkpoints: list[tuple[str, str]] = field(default_factory=list)
    """Newer checkpoints that failed quick verification: (name, reason)."""
    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    rss_bytes: int | None = None
    gpu_used: int | None = None
    gpu_total: int | None = None
    heartbeat_age_s: float | None = None
    """Seconds since the last heartbeat_summary event."""
    last_failure: dict[str, Any] | None = None
    """The last classification event: attempt, kind, reason."""
    stuck: dict[str, Any] | None = None
    """The last hang's `stuck_ranks` event: attempt, summary (which rank is behind and where
    each rank is), behind (ranks), flight_recorder (the NCCL dumps kept)."""
    last_decision: dict[str, Any] | None = None
    """The last decision event: attempt, action, reason, backoff_s."""
    forgiven: int = 0
    """Failures forgiven after progress (budgets_used counts those since the last progress)."""
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    """Quarantined checkpoints (state.json): path, step, reason, in_force (False once the step
    was saved again)."""
    failure_rate: str | None = None
    """The last failure_rate alarm (too many failures in an hour), if any."""
    cadence: dict[str, Any] | None = None
    """Under every="auto": the last interval chosen (the `cadence` event): attempt,
    step, every_steps, reason, save_stall_s, step_time_s, mtbf_s, mtbf_source, loss_factor,
    expected_loss_s."""
    recovery: dict[str, Any] | None = None
    """The last `recovery` event's fields: what the last relaunched failure cost, phase by
    phase (records/recovery.py)."""
    time_lost_s: float = 0.0
    """What the run's failures cost in all: the sum of their recoveries' `lost_s`."""
    restart_s: float | None = None
    """Seconds from the last failed attempt's exit to the next launch (the restart cost)."""
    mirror: dict[str, Any] | None = None
    """With a mirror: uploaded_step, uploaded_age_s, behind_steps (newest local checkpoint
    minus the newest uploaded), failing (the last failure since an upload), final (made_it,
    step, reason at the run's end), downloaded_step (a resume came from it)."""
    standby: dict[str, Any] | None = None
    """The warm standby, from its newest event (none: no standby event in the run): state
    (ready, discarded, failed, used), pid, rss_bytes, modules, reason; warm_starts: attempts
    started in a standby."""
    cannot_resume: dict[str, Any] | None = None
    """While the watched dir holds no checkpoint: the last `cannot_resume` notice
    (files, suggest, message) of the checkpoint dir the newest launch watches."""
    foreign_copy: dict[str, Any] | None = None
    """rtrain's copy of a foreign file the script rewrites in place (ckpt/keepcopy.py): source,
    step, verified_at (unix time), bytes (its disk cost), how (reflink, copy_file_range, copy)."""
    restored: dict[str, Any] | None = None
    """The last time that copy was put back (`foreign_restored`): path, reason, step,
    verified_at, time."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Ranks the newest attempt found slower than the others (`straggler` events): rank, host,
    ratio, step, detail."""
    memory_tier: dict[str, Any] | None = None
    """The memory tier, once the run has a `memory_tier` event: state (on, off, dropped),
    every, stall_s, write_s, reason (the newest attempt's event); snapshot_step and
    snapshot_age_s (the newest snapshot in shared memory now, if any); persisted (snapshots
    rtrain committed), last_persisted (step, why), resumes (launches by tier read from)."""
    slurm: dict[str, Any] | None = None
    """Under Slurm, from the newest launch: job_id, restart_count, end_time (the job's time
    limit ends, unix time), stop_at (rtrain stops the attempt then; null: not armed), margin_s."""


def finite(value: Any) -> bool:
    """A real number (an old run dir may hold nan or infinity where a number belongs)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def json_safe(obj: Any) -> Any:
    """`obj` with nan and infinity replaced by None: JSON has neither, and a run dir written
    before such values were refused may hold them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _pick(event: dict[str, Any] | None, *names: str) -> dict[str, Any] | None:
    return None if event is None else {n: event.get(n) for n in names}


def _ckpt_dir(run_dir: Path, timeline: Timeline) -> Path:
    # The first launch fixed where the run's checkpoints go; later ones resume from there.
    launch = timeline.first_launch
    where = launch.get("ckpt_dir") if launch else None
    return run_dir / where if isinstance(where, str) and where else run_dir / "checkpoints"


def _lock_holder(run_dir: Path) -> tuple[int | None, bool | None]:
    # Read, never flock: even a brief test-lock could make a launch starting at that moment
    # refuse as "already supervised". A released lock is truncated, so content means a holder
    # that is alive or was killed.
    # Through ownfiles: a FIFO planted at the name must not hang status, nor a link lead out.
    try:
        raw = ownfiles.read_own(run_dir / LOCK_NAME, limit=HOLDER_MAX, what="lock")
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError, RecursionError):
        return None, None
    pid = info.get("pid") if isinstance(info, dict) else None
    if isinstance(pid, bool) or not isinstance(pid, int):
        return None, None
    if info.get("host") not in (None, socket.gethostname()):
        return pid, None
    return pid, pid_alive(pid)


def _status(state: Any, timeline: Timeline) -> tuple[str, str]:
    if state is not None:
        return state.status.value, state.reason
    closing = timeline.last(Kind.FINISHED, Kind.GIVE_UP, Kind.LAUNCH)
    if closing is None or closing["kind"] == Kind.LAUNCH:
        return "running", ""
    return (("finished" if closing["kind"] == Kind.FINISHED else "gave_up"),
            closing.get("reason", ""))


def summarize(run_dir: Path, *, key: bytes | None = None, now: float | None = None,
              timeline: Timeline | None = None) -> RunSummary:
    """Everything `rtrain status` shows. `key` checks manifest signatures; `now` is unix time;
    `timeline`: the run's events.jsonl already read (the report's)."""
    run_dir = Path(run_dir)
    # lexists: a link or a FIFO at either name is a run's file refused by name when read
    # (ownfiles), not "no run here".
    if not os.path.lexists(run_dir / "events.jsonl") and not os.path.lexists(
            run_dir / STATE_FILE):
        raise UsageError(f"no rtrain run in {run_dir}: pass the --run-dir used with rtrain "
                         "launch")
    if timeline is None:
        timeline = read_timeline(run_dir / "events.jsonl")
    state = load_state(run_dir)
    status, reason = _status(state, timeline)
    pid, alive = _lock_holder(run_dir)
    launch = timeline.last(Kind.LAUNCH)
    s = RunSummary(run_dir=run_dir, ckpt_dir=_ckpt_dir(run_dir, timeline), status=status,
                   reason=reason, supervisor_pid=pid, supervisor_alive=alive,
                   attempts=timeline.launches,
                   attempt=launch.get("attempt") if launch else None)
    s.failures = dict(timeline.failures)
    if state is not None:
        hist = state.history
        s.budgets_used, s.level = dict(hist.budgets_used), hist.level
        s.forgiven = hist.forgiven
        s.quarantined = [{**q, "in_force": quarantine.checkpoint_id(q["path"]) == q["id"]}
                         for q in hist.quarantined]
        s.settings = dict(hist.settings or {})
        if not timeline.launches:
            s.attempts = hist.attempt
    alarm = timeline.last(Kind.FAILURE_RATE)
    s.failure_rate = alarm.get("detail") if alarm else None
    if timeline.settings is not None:
        s.level, s.settings = timeline.level or 0, dict(timeline.settings)

    now = time.time() if now is None else now
    # The launch's own selection (every format, passing over what a worker could not load),
    # so status names the checkpoint the next launch would resume from.
    bad = state.history.bad_checkpoints if state is not None else ()
    selection = select_resume_any_format(s.ckpt_dir, Level.QUICK, key, exclude=bad)
    if selection.chosen is not None:
        step = selection.chosen.step  # -1: a foreign file whose name states no step
        s.checkpoint, s.checkpoint_step = selection.chosen.path, step if step >= 0 else None
        created = (selection.chosen.manifest or selection.chosen.info or {}).get("created")
        if finite(created):
            s.checkpoint_age_s = max(0.0, now - created)
    s.failure_saves = timeline.failure_saves
    s.last_failure_save = _pick(timeline.last_failure_save, "attempt", "step", "exception")
    skipped = timeline.saves
    s.skipped_saves, s.unsaved = skipped.count, skipped.unsaved
    if skipped.count:
        s.last_skipped = {"step": skipped.last_step, "reason": skipped.last_reason}
    s.bad_checkpoints = [(v.path.name, v.describe()) for v in selection.skipped
                         if v.status is not Status.QUARANTINED]  # listed below, from state.json

    beat = timeline.last(Kind.HEARTBEAT_SUMMARY)
    if beat is not None:
        # rss and GPU memory come with the summary written at an attempt's end.
        for name in ("samples_per_s", "rss_bytes", "gpu_used", "gpu_total"):
            setattr(s, name, beat.get(name) if finite(beat.get(name)) else None)
        s.loss = beat.get("loss")  # nan stays: a non-finite loss is news
        s.heartbeat_age_s = max(0.0, now - beat["time"])
    # An exit event's last_step can be newer than the last summary (up to ~30 s of steps).
    s.step = timeline.step
    last_failure = timeline.last(Kind.CLASSIFICATION)
    if last_failure is not None:
        s.last_failure = {"attempt": last_failure.get("attempt"),
                          "kind": failure_kind(last_failure),
                          "reason": last_failure.get("reason", "")}
    s.stuck = _pick(timeline.last(Kind.STUCK_RANKS), "attempt", "summary", "behind",
                    "flight_recorder")
    s.last_decision = _pick(timeline.last(Kind.DECISION), "attempt", "action", "reason",
                            "backoff_s")
    if timeline.mirror is not None:
        s.mirror = _mirror(timeline.mirror, s.checkpoint_step, now)
    if timeline.recoveries:
        last = timeline.recoveries[-1]
        s.recovery = {k: last.get(k) for k in KINDS[Kind.RECOVERY].fields}
        s.time_lost_s = sum(c.lost_s for c in recovery.costs_by_kind(timeline.recoveries))
    cadence = timeline.last(Kind.CADENCE)
    if cadence is not None:
        s.cadence = {k: cadence.get(k) for k in KINDS[Kind.CADENCE].fields}
        s.restart_s = _restart_s(timeline)
    s.standby = _standby(timeline, launch)
    s.cannot_resume = _cannot_resume(timeline, launch, s.checkpoint)
    kept = keepcopy.load(run_dir)
    s.foreign_copy = asdict(kept) if kept is not None else None
    s.restored = _pick(timeline.last(Kind.FOREIGN_RESTORED), "path", "reason", "step",
                       "verified_at", "time")
    s.stragglers = _stragglers(timeline, launch)
    s.memory_tier = _memory_tier(timeline, s.ckpt_dir, key, now)
    job = launch.get("slurm") if launch else None
    if isinstance(job, dict):
        s.slurm = {k: job.get(k) for k in ("job_id", "restart_count", "end_time", "stop_at",
                                           "margin_s")}
    return s


def _cannot_resume(timeline: Timeline, launch: dict[str, Any] | None,
                   checkpoint: Path | None) -> dict[str, Any] | None:
    """The notice stands while the dir it was about is the one watched and is still empty."""
    last = timeline.last(Kind.CANNOT_RESUME)
    if last is None or checkpoint is not None:
        return None
    if launch is not None and launch.get("ckpt_dir") != last.get("ckpt_dir"):
        return None  # relaunched with another --ckpt-dir
    return {k: last.get(k) for k in ("reason", "files", "suggest", "message")}


def _stragglers(timeline: Timeline, launch: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The newest attempt's stragglers: a relaunch compares its ranks afresh."""
    if launch is None:
        return []
    return [{k: e.get(k) for k in ("rank", "host", "ratio", "step", "detail")}
            for e in timeline.stragglers if e.get("attempt") == launch.get("attempt")]


def _memory_tier(timeline: Timeline, ckpt_dir: Path, key: bytes | None,
                 now: float) -> dict[str, Any] | None:
    last = timeline.last(Kind.MEMORY_TIER)
    if last is None:
        return None
    out = _pick(last, "state", "every", "stall_s", "write_s", "reason") or {}
    where = shmdir.path_for(ckpt_dir)
    snap, _ = shmdir.newest(where, key)
    if snap is None:  # under torchrun: the newest step whole across the ranks' parts
        snap = parts.newest_whole(where, key)
    created = (snap.manifest or {}).get("created") if snap is not None else None
    out["snapshot_step"] = snap.step if snap is not None else None
    out["snapshot_age_s"] = max(0.0, now - created) if finite(created) else None
    out["persisted"] = timeline.snapshots_persisted
    out["last_persisted"] = _pick(timeline.last(Kind.SNAPSHOT_PERSISTED), "step", "why")
    out["resumes"] = dict(timeline.resumes)
    out["peer"] = _pick(timeline.last(Kind.PEER_COPY), "state", "peer", "step", "reason")
    return out


def _memory_row(m: dict[str, Any]) -> str:
    if m.get("state") != "on":
        text = f"{m.get('state')}: {m.get('reason')}"
    else:
        text = f"a snapshot every {m.get('every')} step(s)"
        if finite(m.get("stall_s")):
            text += f" (stall {m['stall_s'] * 1e3:.0f} ms)"
    if m.get("snapshot_step") is not None:
        age = (f", {human_duration(m['snapshot_age_s'])} ago"
               if m.get("snapshot_age_s") is not None else "")
        text += f"; newest snapshot step {m['snapshot_step']}{age}"
    if m.get("persisted"):
        last = m.get("last_persisted") or {}
        text += (f"; {m['persisted']} committed by rtrain (the last: step {last.get('step')}, "
                 f"{last.get('why')})")
    resumes = m.get("resumes") or {}
    if resumes:
        text += "; resumes read from " + ", ".join(f"{k} {n}" for k, n in sorted(
            resumes.items()))
    peer = m.get("peer") or {}
    if peer:  # several nodes: the peer copies' last news
        text += {"replicating": f"; copying node {peer.get('peer')}'s parts",
                 "gathered": f"; gathered step {peer.get('step')} from {peer.get('peer')}",
                 }.get(str(peer.get("state")),
                       f"; peer copy from {peer.get('peer')} failed: {peer.get('reason')}")
    return text


def _standby(timeline: Timeline, launch: dict[str, Any] | None) -> dict[str, Any] | None:
    last = timeline.last(Kind.STANDBY_READY, Kind.STANDBY_DISCARDED, Kind.STANDBY_FAILED)
    if last is None:
        return None
    warm = sum(1 for a in timeline.attempts.values()
               if a.launch is not None and a.launch.get("standby") is True)
    state = {Kind.STANDBY_READY.value: "ready", Kind.STANDBY_DISCARDED.value: "discarded",
             Kind.STANDBY_FAILED.value: "failed"}[last["kind"]]
    if state == "ready" and launch is not None and launch.get("pid") == last.get("pid"):
        state = "used"  # the newest attempt runs in it; the next one is not ready yet
    out = {"state": state, "warm_starts": warm,
           **{k: last.get(k) for k in ("pid", "rss_bytes", "modules", "reason")}}
    return {k: v for k, v in out.items() if v is not None}


def _standby_row(sb: dict[str, Any], *, running: bool) -> str:
    started = f"{sb['warm_starts']} attempt(s) started warm"
    state = sb["state"]
    if state == "ready" and running:
        rss = sb.get("rss_bytes")
        mem = f", rss {human_bytes(rss)}" if finite(rss) else ""
        mods = ", ".join(str(m) for m in sb.get("modules") or []) or "nothing"
        return f"ready (pid {sb.get('pid')}{mem}; imported {mods}); {started}"
    if state in ("discarded", "failed"):
        return f"{state}: {sb.get('reason', '')}; {started}"
    return started


def _restart_s(timeline: Timeline) -> float | None:
    """From the newest exit to the launch after it: what a relaunch took last time."""
    for number in sorted(timeline.attempts, reverse=True):
        record = timeline.attempts[number]
        before = timeline.attempts.get(number - 1)
        if before is not None and before.exit is not None:
            gap = record.launch.get("time", 0) - before.exit.get("time", 0)
            return gap if finite(gap) and gap >= 0 else None
    return None


def _cadence_rows(c: dict[str, Any], restart_s: float | None) -> list[tuple[str, str]]:
    rows = [("save cadence", str(c.get("reason") or "-"))]
    lost, step_time = c.get("expected_loss_s"), c.get("step_time_s")
    if finite(lost) and finite(step_time) and step_time > 0:
        restart = (f" + {human_duration(restart_s)} restart" if restart_s is not None
                   else " + the restart")
        rows.append(("", f"expected work lost per failure: {lost / step_time:,.0f} steps "
                         f"({human_duration(lost)}){restart}"))
    return rows


def _mirror(m: Any, local_step: int | None, now: float) -> dict[str, Any]:
    behind = (local_step - m.uploaded_step if local_step is not None
              and m.uploaded_step is not None and local_step > m.uploaded_step
              else (0 if local_step is None or m.uploaded_step is not None else None))
    final = m.final
    return {"uploaded_step": m.uploaded_step,
            "uploaded_age_s": (max(0.0, now - m.uploaded_at) if finite(m.uploaded_at)
                               else None),
            "behind_steps": behind, "uploads": m.uploads, "failures": m.failures,
            "failing": _pick(m.failing, "reason", "step", "retry_in_s"),
            "final": _pick(final, "made_it", "step", "reason"),
            "downloaded_step": m.downloaded.get("step") if m.downloaded else None}


def _stale(s: RunSummary) -> str | None:
    """Why a run marked running is not being supervised, if it is not."""
    if s.status != "running" or s.supervisor_alive:
        return None
    if s.supervisor_pid is None:
        who = "no rtrain holds it"
    elif s.supervisor_alive is False:
        who = f"its rtrain (pid {s.supervisor_pid}) is gone"
    else:
        return None  # held from another host: cannot tell from here
    return f"{who}; run the same rtrain launch again to continue"


def _pairs(obj: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in obj.items()) or "-"


def render_text(s: RunSummary) -> str:
    """A compact summary for a person: one labelled line per topic, empty topics left out."""
    head = f"run {safe(s.run_dir)}: {s.status}"
    if s.attempt is not None:
        head += f", attempt {s.attempt}"
    if s.supervisor_pid is not None and s.supervisor_alive is not False:
        head += f" (rtrain pid {s.supervisor_pid})"
    rows: list[tuple[str, str]] = []
    if stale := _stale(s):
        rows.append(("warning", stale))
    if s.unsaved:
        rows.append(("warning", s.unsaved))
    if s.cannot_resume:
        rows.append(("warning", str(s.cannot_resume.get("message") or "")))
    if s.reason:
        rows.append(("reason", s.reason))
    progress = [f"step {s.step:,}"] if s.step is not None else []
    if isinstance(s.loss, (int, float)):
        progress.append(f"loss {s.loss:.4g}")
    if s.samples_per_s:
        progress.append(f"{human_rate(s.samples_per_s)} samples/s")
    if s.heartbeat_age_s is not None:
        progress.append(f"as of {human_duration(s.heartbeat_age_s)} ago")
    if progress:
        rows.append(("progress", ", ".join(progress)))
    memory = [f"rss {human_bytes(s.rss_bytes)}"] if s.rss_bytes is not None else []
    if s.gpu_used is not None:
        total = f" / {human_bytes(s.gpu_total)}" if s.gpu_total is not None else ""
        memory.append(f"gpu {human_bytes(s.gpu_used)}{total}")
    if memory:
        rows.append(("memory", ", ".join(memory)))
    rows.append(("rung", f"{s.level} ({_pairs(s.settings)})"))
    age = (f", committed {human_duration(s.checkpoint_age_s)} ago"
           if s.checkpoint_age_s is not None else "")
    # A step the name does not state (ckpt.pt: read from its pickle) is said.
    step = (f"step {s.checkpoint_step}, " if s.checkpoint is not None
            and s.checkpoint_step is not None and str(s.checkpoint_step) not in
            s.checkpoint.name else "")
    rows.append(("checkpoint", f"{s.checkpoint.name} ({step}verified quick){age}"
                 if s.checkpoint else f"none verified in {s.ckpt_dir}"))
    if s.foreign_copy is not None:
        rows.append(("kept copy", keepcopy.describe(keepcopy.Kept(**s.foreign_copy))))
    if r := s.restored:
        rows.append(("restored", f"{Path(r['path']).name} at {_clock(r['time'])}: it was "
                                 f"{r['reason']}; rtrain's copy"
                                 + (f" of step {r['step']}" if r.get("step") is not None
                                    else "") + " went back"
                     if isinstance(r.get("time"), (int, float)) else r["reason"]))
    if s.cadence is not None:
        rows += _cadence_rows(s.cadence, s.restart_s)
    if s.mirror is not None:
        rows += _mirror_rows(s.mirror)
    rows += [("straggler" if i == 0 else "", str(e.get("detail") or ""))
             for i, e in enumerate(s.stragglers)]
    if s.memory_tier is not None:
        rows.append(("memory tier", _memory_row(s.memory_tier)))
    if s.standby is not None:
        rows.append(("standby", _standby_row(s.standby, running=s.status == "running")))
    if s.slurm is not None:
        rows.append(("slurm", _slurm_row(s.slurm, running=s.status == "running")))
    if f := s.last_failure_save:
        rows.append(("at failure", f"{s.failure_saves} checkpoint(s) saved as the worker failed; "
                                   f"the last of step {f['step']} (attempt {f['attempt']}, "
                                   f"{f['exception']})"))
    if s.last_skipped:
        rows.append(("saves", f"{s.skipped_saves} skipped; the last at step "
                              f"{s.last_skipped['step']}: {s.last_skipped['reason']}"))
    rows += [("", f"{name} skipped: {why}") for name, why in s.bad_checkpoints]
    failures = ", ".join(f"{k} {n}" for k, n in s.failures.items()) or "none"
    rows.append(("attempts", f"{s.attempts} launched; failures: {failures}"))
    if s.budgets_used or s.forgiven:
        # Charged per relaunch, so a failure that ended the run, or came after a newer
        # checkpoint, is a failure above and no charge here: say "relaunches" to tell them apart.
        rows.append(("budgets", (", ".join(f"{k} {n}" for k, n in s.budgets_used.items())
                                 or "none") + " relaunches charged since the last progress "
                                              f"({s.forgiven} earlier ones forgiven)"))
    rows += [("", f"{Path(q['path']).name} quarantined: {q['reason']}"
                  + ("" if q["in_force"] else " (since saved again)")) for q in s.quarantined]
    if s.failure_rate:
        rows.append(("failure rate", f"WARNING: {s.failure_rate}"))
    if r := s.recovery:
        more = (f"; failures cost {recovery.seconds(s.time_lost_s)} in all"
                if s.failures and sum(s.failures.values()) > 1 else "")
        rows.append(("last recovery", recovery.describe(r) + more))
    if f := s.last_failure:
        rows.append(("last failure", f"attempt {f['attempt']}: {f['kind']}: {f['reason']}"))
    if st := s.stuck:
        dumps = st.get("flight_recorder") or []
        more = f" ({len(dumps)} NCCL flight recorder dump(s) kept)" if dumps else ""
        rows.append(("stuck ranks", f"attempt {st.get('attempt')}: {st.get('summary')}{more}"))
    if d := s.last_decision:
        wait = f" (backoff {d['backoff_s']:.3g} s)" if finite(d.get("backoff_s")) \
            and d["backoff_s"] else ""
        rows.append(("last decision", f"attempt {d['attempt']}: {d['action']}: "
                                      f"{d['reason']}{wait}"))
    width = max(len(label) for label, _ in rows)
    # Reasons and settings quote checkpoint, script and log content: escaped (`safe`).
    return "\n".join([head] + [f"  {label + (':' if label else ''):<{width + 1}} {safe(text)}"
                                for label, text in rows])


def _slurm_row(job: dict[str, Any], *, running: bool) -> str:
    """The job, and while the run runs, its time limit and the stop planned before it."""
    text = f"job {job.get('job_id')} (requeued {job.get('restart_count') or 0} times)"
    end, stop, margin = job.get("end_time"), job.get("stop_at"), job.get("margin_s")
    if running and finite(end):
        text += f"; time limit at {_clock(end)}"
        text += (f", saving and stopping at {_clock(stop)} ({margin:g} s before)"
                 if finite(stop) and finite(margin) else ", no stop planned before it")
    return text


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _mirror_rows(m: dict[str, Any]) -> list[tuple[str, str]]:
    if m["uploaded_step"] is None:
        text = "nothing uploaded yet"
    else:
        age = (f" {human_duration(m['uploaded_age_s'])} ago"
               if m["uploaded_age_s"] is not None else "")
        text = f"step {m['uploaded_step']:,} uploaded{age}"
    if m["behind_steps"]:
        text += f"; {m['behind_steps']:,} steps behind the newest local checkpoint"
    elif m["behind_steps"] == 0 and m["uploaded_step"] is not None:
        text += "; up to date"
    rows = [("mirror", text)]
    if f := m["failing"]:
        rows.append(("", f"failing: {f['reason']}"))
    if f := m["final"]:
        rows.append(("", f"at the end: step {f['step']} " + (
            "made it to the mirror" if f["made_it"] else f"did NOT make it ({f['reason']})")))
    if m["downloaded_step"] is not None:
        rows.append(("", f"resumed from the mirror's step {m['downloaded_step']}"))
    return rows


def to_json(s: RunSummary) -> dict[str, Any]:
    """The summary as JSON-able data for scripts (paths as strings)."""
    out = asdict(s)
    for name in ("run_dir", "ckpt_dir", "checkpoint"):
        out[name] = None if out[name] is None else str(out[name])
    out["bad_checkpoints"] = [{"name": n, "reason": r} for n, r in s.bad_checkpoints]
    out["stale"] = _stale(s)
    return json_safe(out)
