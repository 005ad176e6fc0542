"""Typed configuration for `rtrain launch`, resolved in one place (`load_config`).

Sources: `--config FILE`, else `rtrain.toml` (top level, or its `[rtrain]` table), else
`[tool.rtrain]` in `pyproject.toml`, all looked up in the current directory. Precedence:
command line > file > defaults.

The dataclasses below are the schema: each field's name, default and meaning are defined there
once (the attribute docstring after it), and everything else is built from them:
`proc.watch.WatchConfig.from_config` and `proc.heartbeat.HangPolicy.from_config` for the
supervisor's runtime, RTRAIN_* variables for the worker, docs/reference.md
(scripts/gen_reference.py) for the manual.

Only the fields named in `KEYS` are settings: what a user has a reason to set, and all a config
file or the command line may name. The other fields are the code's tuning constants (the
pressure trend's window, the hang timeout's multiple and floor, the mirror's timeouts, ...):
their defaults hold for every run, a file that names one is refused with the value rtrain
uses, and only code (the tests, benchmarks) passes them to `load_config`.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.config_file import find_config
from rtrain.supervisor.core.errors import ConfigError, did_you_mean
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE, parse_mode
from rtrain.supervisor.decide.ladder import DEFAULT_LADDER, Rung, parse_ladder
from rtrain.supervisor.hooks.hook_spec import HookSpec, parse_hooks

# Budget names: oom_gpu, oom_host and memory_pressure share "oom" (each spent unit is one
# ladder step).
# Preemption never spends budget and startup failures are never retried, so neither has one.
DEFAULT_BUDGETS = {"crash": 3, "oom": 6, "hang": 3, "nonfinite": 2, "lost_device": 2, "data": 1}
# A handler cannot be installed for these: the child could never save before it dies.
UNCATCHABLE = ("SIGKILL", "SIGSTOP")
# The signals `stop_signal` may name: each one's default action ends a process, and each is
# sent to ask a process to end (by a terminal, a scheduler: Slurm --signal, SGE and LSF
# warnings, SIGXCPU at a soft CPU limit, SIGPWR at a power failure), never as a side effect of
# ordinary work. The others are refused: SIGCHLD, SIGCONT, SIGWINCH and SIGURG arrive for other
# reasons (each subprocess that ends, a resumed job, a resized terminal, out-of-band data), so
# every one would stop the attempt as a free preemption; the fault signals (SIGSEGV, SIGBUS,
# SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS), SIGPIPE, the timers (SIGALRM, SIGVTALRM, SIGPROF),
# SIGIO and SIGXFSZ mean something else to the process and its libraries; SIGUSR2 and SIGURG
# are rtrain's own (the stack dump, the memory relief request).
ALLOWED_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGXCPU", "SIGPWR")
_RTRAIN_OWN = {"SIGUSR2": "the signal on which rtrain has the worker dump its stacks "
                          "(RTRAIN_DUMP_SIGNAL)",
               "SIGURG": "the signal with which rtrain asks the worker to free memory "
                         "(RTRAIN_RELIEVE_SIGNAL)"}
DEFAULT_MAX_RESTARTS = 20

KEYS = (
    "run_dir", "ckpt_dir", "resume", "verify", "settings", "ladder",
    "grace_s", "stop_signal", "requeue",
    "restart.max_restarts", "restart.budgets", "restart.give_up_on_rate", "backoff.enabled",
    "hang.timeout_s", "slurm.stop_before_limit", "pressure.enabled", "straggler.exclude_node",
    "standby", "preload", "metrics_file", "hooks", "file_mode",
    "mirror", "keep_remote", "milestone_every",
)
"""The settings: the keys a config file may name, each with a reason a user would set it
(docs/reference.md). A dotted key is one of a table's."""


def _fail_unknown(key: str, known: list[str], where: str, elsewhere: dict[str, str]) -> None:
    if key in elsewhere:
        raise ConfigError(f"key {key!r} does not belong in {where}; put it under {elsewhere[key]}")
    did = did_you_mean(key, known, otherwise=f" (known keys: {', '.join(known)})")
    raise ConfigError(f"unknown key {key!r} in {where}{did}")


def _number(where: str, value: Any, *, low: float = 0.0, integer: bool = False,
            above: bool = False) -> None:
    """Raise unless `value` is a number >= low (> low when `above`), an int when `integer`."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigError(f"{where} must be {'an integer' if integer else 'a number'} "
                          f"(got {value!r})")
    if not math.isfinite(value):  # nan compares false with everything: it would pass below
        raise ConfigError(f"{where} must be a finite number (got {value!r})")
    if value < low or (above and value == low):
        raise ConfigError(f"{where} must be {'above' if above else 'at least'} {low:g} "
                          f"(got {value!r})")


def _bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false (got {value!r})")


@dataclass(kw_only=True, slots=True)
class RestartConfig:
    """`[restart]`: how many failures the run may survive, and when a loop is a loop.

    Every relaunch after a failure that did not advance the newest verified checkpoint is
    charged to its kind's budget and to `max_restarts` (one that did is not charged); once the
    run has made progress since (a newer verified checkpoint and `forgive_after_steps` steps or
    `forgive_after_s` seconds of training), the charges are forgiven. So the limits count
    failures without progress in between, and a run that keeps advancing never runs out.
    """

    max_restarts: int | None = None
    """Relaunches after failures of any kind, all together, without progress in between
    (default 20). Set (here or `--max-restarts`), it also raises every per-kind budget not set
    in [restart.budgets] to the same number: N means N relaunches for any failure. Raise it for
    a long run on flaky hardware; lower it to fail fast."""
    crash_loop_k: int = 3
    """Give up when K consecutive attempts end without a newer verified checkpoint (0: never)."""
    budgets: dict[str, int] = field(default_factory=dict)
    """Relaunches per failure kind without progress in between: crash, oom (= ladder steps:
    oom_gpu, oom_host, memory_pressure), hang, nonfinite, lost_device, data. Keys left out
    keep their default (or max_restarts). Set one to allow more of a failure you expect
    (lost_device on unreliable GPUs) or none of one you do not (hang = 0)."""
    forgive_after_steps: int = 20
    """Progress that forgives earlier failures: a newer verified checkpoint and this many steps
    trained since the last failure (or forgive_after_s, whichever comes first)."""
    forgive_after_s: float = 600.0
    """... or this many seconds spent training since the last failure."""
    trained_s: float = 60.0
    """A script that sends no heartbeats and is killed from outside (SIGKILL, SIGTERM, ...)
    after running this long trained before it was killed: that attempt is no part of a crash
    loop, the budgets count it. A script with heartbeats trained when it passed the step it
    resumed from."""
    quarantine_after: int = 2
    """Quarantine a checkpoint after this many consecutive attempts resumed from it and failed
    the same way before committing a newer one; resume falls back to the one before (0: never).
    It is at most crash_loop_k, so the fallback gets its attempt."""
    max_failures_per_hour: int = 10
    """More failures than this in an hour is reported (failure_rate event, status, hooks) even
    when the run makes progress (0: never)."""
    give_up_on_rate: bool = False
    """Give up when more than `max_failures_per_hour` (10) failures come within an hour, even
    where each made progress (by default that is only reported): where a flapping node should
    end the job rather than spend its allocation."""
    user_set: frozenset[str] = field(default=frozenset(), init=False)
    """Which of max_restarts and the budgets the configuration set (for messages)."""

    def __post_init__(self) -> None:
        if self.max_restarts is not None:
            _number("[restart] max_restarts", self.max_restarts, integer=True)
        _bool("[restart] give_up_on_rate", self.give_up_on_rate)
        if not isinstance(self.budgets, dict):
            raise ConfigError("[restart.budgets] must be a table, e.g. crash = 3")
        for key, value in self.budgets.items():
            if key not in DEFAULT_BUDGETS:
                _fail_unknown(key, list(DEFAULT_BUDGETS), "[restart.budgets]", {})
            _number(f"[restart.budgets] {key}", value, integer=True)
        self.user_set = frozenset({*self.budgets, *(["max_restarts"]
                                                     if self.max_restarts is not None else [])})
        # An explicit max_restarts is what the user asked for: budgets they did not set never
        # cap it below (torchrun's --max-restarts N means N restarts for any failure).
        unset = DEFAULT_BUDGETS if self.max_restarts is None else dict.fromkeys(
            DEFAULT_BUDGETS, self.max_restarts)
        self.budgets = {**unset, **self.budgets}
        if self.max_restarts is None:
            self.max_restarts = DEFAULT_MAX_RESTARTS

    def knob(self, name: str) -> str:
        """How a person sets the limit `name` ("max_restarts" or a budget), with its value and
        where it came from, for the give-up message."""
        if name == "max_restarts":
            where = "set" if name in self.user_set else "the default"
            return (f"max_restarts = {self.max_restarts} ({where}; --max-restarts N or "
                    "[restart] max_restarts)")
        if name in self.user_set:
            return f"[restart.budgets] {name} = {self.budgets[name]}"
        if "max_restarts" in self.user_set:
            return (f"max_restarts = {self.max_restarts} (--max-restarts or [restart] "
                    f"max_restarts; it sets every budget not in [restart.budgets], {name} too)")
        return f"[restart.budgets] {name} = {self.budgets[name]} (the default)"


@dataclass(kw_only=True, slots=True)
class BackoffConfig:
    """`[backoff]`: wait before a relaunch after a failure without progress, growing while
    attempts make none; a failure after progress relaunches at once."""

    enabled: bool = True
    """Wait before a relaunch after a failure without progress, growing while attempts make
    none (1 s, doubling up to 300 s, with jitter); a failure after progress relaunches at
    once. false never waits: for benchmarks and tests, or where a scheduler spaces restarts
    already (`--no-backoff`)."""
    initial_s: float = 1.0
    """Wait after the first failure of a streak without progress."""
    factor: float = 2.0
    """Each further relaunch without progress waits this many times longer (at least 1)."""
    max_s: float = 300.0
    """Cap on the wait, before jitter."""
    jitter: float = 0.25
    """Up to this fraction of the wait is taken off at random, so many jobs do not relaunch in
    lockstep (0 to 1)."""

    def __post_init__(self) -> None:
        _bool("[backoff] enabled", self.enabled)


@dataclass(kw_only=True, slots=True)
class HangConfig:
    """`[hang]`: when silence means the child is stuck."""

    timeout_s: float = 1800.0
    """No sign of life for this long is a hang (`--hang-timeout`): for a plain script (no
    heartbeats), no output and no CPU progress; for a script that sends heartbeats, no
    heartbeat until the timeout is learned (start-up: imports, compilation, warm-up steps).
    Raise it for a script that is silent for longer by design (a long evaluation without
    output); lower it to catch a hang sooner."""
    multiple: float = 10.0
    """Heartbeat scripts: the learned timeout is this multiple of the longest step interval."""
    warmup_steps: int = 20
    """Step heartbeats (at most five a second) to see before step intervals count and the
    timeout is learned; the first steps compile and warm caches."""
    floor_s: float = 60.0
    """The learned timeout is never shorter than this."""
    ceiling_s: float = 3600.0
    """The learned timeout is never longer than this."""
    save_allowance_s: float = 600.0
    """While the worker says a checkpoint is being saved, at least this long from the save's
    start counts as alive."""
    grace_s: float = 15.0
    """A hung child (or one whose GPU was lost): from the stop signal to SIGKILL. A save at the
    hang that has begun gets `save_allowance_s` instead."""

    def __post_init__(self) -> None:
        _number("[hang] timeout_s", self.timeout_s, above=True)


@dataclass(kw_only=True, slots=True)
class SlurmConfig:
    """`[slurm]`: saving before the job's time limit (supervisor/timelimit/decide.py)."""

    stop_before_limit: bool = True
    """Under Slurm, stop the attempt before the job's time limit (as on a preemption signal:
    the child saves and exits 75; with `requeue` the job goes back to the queue). The limit's
    end is the scheduler's EndTime. Turn it off where the script handles the limit itself."""
    margin_s: float = 60.0
    """The least time before the limit at which the stop is sent; also the margin until a stop
    or a save has been measured."""
    margin_factor: float = 2.0
    """The margin is at least this many times the longest need measured in the run: a stop
    signal to the child's exit, or a save plus a step."""

    def __post_init__(self) -> None:
        _bool("[slurm] stop_before_limit", self.stop_before_limit)


@dataclass(kw_only=True, slots=True)
class PressureConfig:
    """`[pressure]`: degrade before the OOM. While an attempt runs, the growth of each memory's
    peaks is projected to its limit; when the time left is shorter than relief and the stop
    take on this run (measured, `margin` to spare), or usage stays above a hard line for
    `sustain_s`, the child is first asked to relieve it in-process (RTRAIN_RELIEVE_SIGNAL: free
    caches, step the micro-batch down); when that does not make room (or there is no time to
    try it), the child is asked to save and exit, and the next attempt runs one rung down the
    ladder with no step lost (failure kind `memory_pressure`, charged to the oom budget)."""

    enabled: bool = True
    """Watch memory while an attempt runs and, when it is about to run out, have the script
    free memory or step down the ladder before the OOM kill. Turn it off where memory use
    swings near the limit by design and the forecast misreads it."""
    fraction: float = 0.95
    """The hard line for host memory: at this share of its limit for `sustain_s`, pressure
    whatever the trend. The limit is the run's memory cgroup's (working set: usage minus
    inactive file cache) where it has one, else the machine's memory (total minus available).
    Above 0.92 by default: a run flat just under its limit is left alone."""
    gpu_fraction: float = 0.98
    """The hard line for a GPU, a share of its memory (NVML, which counts the caching
    allocator's reserve: a healthy run reads high, hence the higher default; 0: GPUs are not
    watched)."""
    sustain_s: float = 5.0
    """How long usage must stay above the hard line before relief is asked, and again after
    relief before the stop."""
    trend_s: float = 8.0
    """The trend looks at the window peaks of this many recent seconds (0: no trend rule, the
    hard line alone)."""
    peak_window_s: float = 1.0
    """The trend takes one peak per window of this length: longer than a step, a step's
    transient peak is in every window and is no growth."""
    trend_from: float = 0.5
    """The trend acts only once the newest peak is above this share of the limit."""
    margin: float = 2.0
    """Acting (relief answered at a step boundary; the stop: the rest of a step and a save, as
    measured on this run) is counted this many times over against the time left, plus two
    sample intervals."""
    climb_headroom: float = 0.1
    """restore_after_steps climbs back only when the rung above, as measured, peaked at least
    this share of the limit below the threshold."""

    def __post_init__(self) -> None:
        _bool("[pressure] enabled", self.enabled)


@dataclass(kw_only=True, slots=True)
class StragglerConfig:
    """`[straggler]`: name a rank that is consistently slower than the others under torchrun
    (supervisor/straggler/decide.py). Each rank's busy time per step (its step interval less
    its wait at the step boundary for the others) is compared, as a median over the window,
    with the median of the other ranks'. A rank found slow is reported (`straggler` event,
    status, report, metrics, hooks) with the node it runs on; nothing is stopped, and only
    with `exclude_node` is the node left out of the Slurm job at its next requeue."""

    enabled: bool = True
    """Compare the ranks' step times while an attempt runs."""
    factor: float = 1.2
    """A rank whose busy time is at least this multiple of the others' median is a straggler."""
    window_steps: int = 100
    """The comparison covers the last this-many steps."""
    min_samples: int = 5
    """Step heartbeats (at most five a second per rank) each rank needs in the window before
    any rank is judged."""
    exclude_node: bool = False
    """Under Slurm: when a rank on this node was a straggler in the attempt, the next requeue
    (a preemption, the time limit, with `requeue`) excludes this node from the job
    (ExcNodeList), as a failed device does. Off by default: a straggler slows the run, it
    loses no work, and a node excluded is one the job cannot run on again."""

    def __post_init__(self) -> None:
        _bool("[straggler] exclude_node", self.exclude_node)


def _check_preload(value: Any) -> None:
    if not isinstance(value, list):
        raise ConfigError(f"preload must be a list of module names, e.g. [\"torch\"] "
                          f"(got {value!r})")
    for name in value:
        if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
            raise ConfigError(f"preload: {name!r} is not a module name")
        # standby/child_program.py's NEVER_PRELOAD: that file runs alone, importing no rtrain
        if name.split(".")[0] == "rtrain":
            raise ConfigError(f"preload: {name!r} reads the attempt's RTRAIN_* variables when "
                              "imported, so it cannot be imported before the attempt; remove it")


def _check_json(where: str, value: Any) -> None:
    """Settings travel as JSON (`RTRAIN_SETTINGS`): TOML dates and times cannot."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json(f"{where}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(f"{where}[{i}]", v)
    elif not isinstance(value, (str, int, float, bool)) and value is not None:
        raise ConfigError(f"{where} must be a string, number, boolean, list or table "
                          f"(got {type(value).__name__})")
    elif isinstance(value, float) and not math.isfinite(value):
        # JSON has no nan or infinity: the child, events.jsonl and state.json could not carry it
        raise ConfigError(f"{where} must be a finite number (got {value!r})")


@dataclass(kw_only=True, slots=True)
class Config:
    """Everything `rtrain launch` needs to know, validated; built by `load_config`."""

    run_dir: Path = Path("rtrain-run")
    """Where the run's record lives: events.jsonl, state.json, attempts/, the lock
    (`--run-dir`). Set it to keep runs apart, on storage that outlives the node."""
    ckpt_dir: Path | None = None
    """The checkpoint directory rtrain verifies and resumes from (`--ckpt-dir`; unset:
    <run_dir>/checkpoints). Set it to the folder your script already saves into."""
    resume: str = "auto"
    """auto (newest checkpoint that verifies), never, or a checkpoint path that must verify
    (`--resume`): never starts over, a path pins the start (a fine-tune from a known step)."""
    verify: str = "full"
    """Verification level for resume selection: quick (sizes) or full (content hashes). quick
    spares hashing every file at each launch: for very large checkpoints on trusted storage."""
    requeue: bool = False
    """On a preemption signal or at the time limit, requeue the Slurm job instead of exiting
    75 (`--requeue`): for a batch job that should come back by itself."""
    grace_s: float = 30.0
    """After the stop signal, how long the child may take to save and exit before SIGKILL
    (`--grace`). Raise it when a save takes longer (a large model, slow storage); keep it
    below the scheduler's own notice. A hung child, which will not save, gets a short one."""
    stop_signal: str = "SIGTERM"
    """Signal forwarded to the child to ask it to save and exit: one of SIGTERM, SIGINT,
    SIGHUP, SIGQUIT, SIGUSR1, SIGXCPU, SIGPWR ("SIG" may be left out). Set it to the signal
    your scheduler sends ahead of a stop (Slurm `--signal=USR1@120`)."""
    sample_interval_s: float = 1.0
    """How often memory and progress are sampled (at least 0.01 s). Shorter sees fast memory
    growth sooner, at more of rtrain's CPU."""
    gpu_release_wait_s: float = 10.0
    """Before a relaunch, how long to wait for the old child's GPU memory to be freed (a
    `gpu_not_released` event says it was not)."""
    memory_pressure_fraction: float = 0.9
    """A SIGKILL counts as a host OOM when memory use reached this fraction of the total."""
    restore_after_steps: int = 500
    """After this many healthy steps on a degraded rung, climb back one rung at the next
    relaunch, when the rung above fits by its recorded memory peak ([pressure]
    climb_headroom; 0: never climb)."""
    lr_factor_on_nonfinite: float = 0.5
    """After a non-finite loss, multiply the `lr` knob (or `lr_scale`) by this factor."""
    restart: RestartConfig = field(default_factory=RestartConfig)
    """`[restart]` table."""
    backoff: BackoffConfig = field(default_factory=BackoffConfig)
    """`[backoff]` table."""
    hang: HangConfig = field(default_factory=HangConfig)
    """`[hang]` table."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    """`[slurm]` table."""
    pressure: PressureConfig = field(default_factory=PressureConfig)
    """`[pressure]` table."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """`[straggler]` table."""
    settings: dict[str, Any] = field(default_factory=dict)
    """`[settings]`: the knobs the script reads and the ladder changes, with their first
    values (e.g. batch_size = 64)."""
    ladder: tuple[Rung, ...] = DEFAULT_LADDER
    """`[[ladder]]`: what a memory failure steps down, rung by rung. Set it to name your
    script's own knobs (micro-batch, resolution, offload) and their limits."""
    metrics_file: Path | None = None
    """Write Prometheus metrics here (`--metrics-file`; unset: none): point it into a
    node_exporter textfile-collector folder to graph steps, restarts and failures."""
    summary_every_s: float = 5.0
    """How often a `heartbeat_summary` event records step, loss and samples/s while a child
    runs (the points of `rtrain report`'s curves); each attempt's first step is always kept."""
    hooks: tuple[HookSpec, ...] = ()
    """`[[hooks]]`: commands run with an event's JSON on stdin: to be paged at a give-up or a
    hang (Slack, email, PagerDuty)."""
    log_cap_mb: float = 64.0
    """Each attempt log (stdout.log, stderr.log) keeps at most about this many MiB: its first
    half and its newest output, with a line saying how much was cut between (0: no cap)."""
    file_mode: int = DEFAULT_FILE_MODE
    """Mode of the files rtrain writes (state, events, lock, checkpoints); directories it
    creates get the same plus x where readable. "0640" or "0660" share a run with a group."""
    mirror: str | None = None
    """Copy every committed checkpoint to this fsspec URL (`--mirror`): s3://bucket/prefix,
    gs://..., file:///mnt/nfs/ckpts or a plain path; resume also looks there (unset: none).
    Set it where the local disk can be lost with the node (spot instances, scratch)."""
    keep_remote: int = 3
    """The mirror keeps the newest this many checkpoints (0: all), plus milestones
    (`--keep-remote`): raise it to keep more history in the bucket."""
    milestone_every: int = 0
    """The mirror also keeps forever every checkpoint whose step is a multiple of this (0: none);
    a milestone is uploaded even when newer checkpoints came before its turn. Set it to keep
    checkpoints for later evaluation, e.g. every 10000 steps."""
    mirror_parallel: int = 4
    """Files of one checkpoint uploaded at once (large files go in parts on their own)."""
    mirror_connect_timeout_s: float = 5.0
    """Each remote call to the mirror waits at most this long to connect (S3)."""
    mirror_read_timeout_s: float = 5.0
    """... and this long for each answer once its request is sent; a call is tried 4 times at
    most, so an endpoint that accepts connections and never answers fails a call in about 4x
    this (20 s), and a launch says so and trains from its local checkpoints."""
    mirror_final_wait_s: float = 60.0
    """When the run ends (finished, stopped, gave up), how long rtrain waits for the newest
    checkpoint to reach the mirror before it exits. Under preemption the platform's grace must
    cover the save time plus this wait."""
    standby: bool = True
    """Keep a warm standby interpreter with the heavy modules imported while an attempt
    trains; the next attempt starts in it, seconds sooner. For `python SCRIPT` and
    `-m MODULE` launches, and under `--nproc-per-node` on one node, where it forks every rank
    of the next attempt; not over several nodes nor for a command of your own. Turn it off
    (`--no-standby`) to spare its memory on a tight machine."""
    preload: list[str] | None = None
    """Modules the standby imports, e.g. ["torch", "transformers"]. None: the script's
    module-level imports (and its own modules') from outside its directory and the standard
    library, plus torch._dynamo when they import torch (its first optimizer would). Set it when
    the script imports a heavy module late (inside a function) and the standby misses it."""
    standby_idle_cores: float = 0.75
    """The launch's zygote (standby/slot.py) is started beside an attempt's start, rather than
    at its first heartbeat, once at least this many cores' worth of CPU went unused since the
    attempt started (standby/idle.py): then it imports where it slows nothing. 0: always beside
    the start; more than the cores: never."""

    def __post_init__(self) -> None:
        if not isinstance(self.resume, str) or not self.resume:
            raise ConfigError(f"resume must be auto, never or a checkpoint path "
                              f"(got {self.resume!r})")
        if self.verify not in ("quick", "full"):
            raise ConfigError(f"verify must be 'quick' or 'full' (got {self.verify!r})")
        _bool("requeue", self.requeue)
        _number("grace_s", self.grace_s)
        if self.mirror is not None and (not isinstance(self.mirror, str) or not self.mirror):
            raise ConfigError(f"mirror must be a URL or a path (got {self.mirror!r})")
        _number("keep_remote", self.keep_remote, integer=True)
        _number("milestone_every", self.milestone_every, integer=True)
        _bool("standby", self.standby)
        _number("standby_idle_cores", self.standby_idle_cores)
        if self.preload is not None:
            _check_preload(self.preload)
        name = self.stop_signal.upper() if isinstance(self.stop_signal, str) else ""
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in signal.Signals.__members__:
            raise ConfigError(f"stop_signal {self.stop_signal!r} is not a signal on this system; "
                              "use a name such as SIGTERM or SIGUSR1")
        if name in UNCATCHABLE:
            raise ConfigError(f"stop_signal {name} cannot be caught, so the child could not save "
                              "before it stops; use a name such as SIGTERM or SIGUSR1")
        if name in _RTRAIN_OWN:
            raise ConfigError(f"stop_signal {name} is {_RTRAIN_OWN[name]}; use one of "
                              f"{', '.join(ALLOWED_STOP_SIGNALS)}")
        if name not in ALLOWED_STOP_SIGNALS:
            raise ConfigError(f"stop_signal {name} is not a request to end: it arrives for other "
                              "reasons, and each time would stop the attempt as a preemption; "
                              f"use one of {', '.join(ALLOWED_STOP_SIGNALS)}")
        self.stop_signal = name
        self.file_mode = parse_mode(self.file_mode)
        if not isinstance(self.settings, dict):
            raise ConfigError("[settings] must be a table of knob = value")
        for key, value in self.settings.items():
            _check_json(f"[settings] {key}", value)


_SECTIONS: dict[str, type] = {"restart": RestartConfig, "backoff": BackoffConfig,
                              "hang": HangConfig, "slurm": SlurmConfig,
                              "pressure": PressureConfig, "straggler": StragglerConfig}
_TOP = [f.name for f in fields(Config)]


def _where_is(key: str) -> dict[str, str]:
    """For a misplaced key, the table it belongs in (e.g. max_restarts -> [restart])."""
    return {f.name: f"[{sec}]" for sec, cls in _SECTIONS.items() for f in fields(cls)
            if f.name == key and f.init}


def _field(key: str) -> bool:
    """Whether `key` ("hang.floor_s", "log_cap_mb") names a field of the schema."""
    section, _, name = key.rpartition(".")
    cls = _SECTIONS.get(section) if section else Config
    return cls is not None and name in {f.name for f in fields(cls) if f.init}


def _default(key: str) -> Any:
    """The value rtrain holds the field `key` at."""
    section, _, name = key.rpartition(".")
    return getattr(_SECTIONS[section]() if section else Config(), name)


def _settings_only(raw: dict[str, Any]) -> None:
    """Refuse what a config file may not name: a constant (saying the value rtrain holds it
    at), or a key that is neither (naming the setting it resembles, or its table)."""
    table = {k.rpartition(".")[2]: f"[{k.partition('.')[0]}]" for k in KEYS if "." in k}
    for key, value in raw.items():
        if key in _SECTIONS and isinstance(value, dict):
            known = sorted(k.partition(".")[2] for k in KEYS if k.startswith(key + "."))
            for sub in value:
                if f"{key}.{sub}" not in KEYS:
                    elsewhere = {sub: "the top level" if sub in KEYS else table.get(sub, "")}
                    _refuse(f"{key}.{sub}", f"[{key}] {sub}", known, f"[{key}]", elsewhere)
        elif key not in KEYS and key not in _SECTIONS:  # a section not a table: _build says so
            known = sorted({k.partition(".")[0] for k in KEYS})
            _refuse(key, key, known, "the top level", {key: table.get(key, "")})


def _refuse(key: str, name: str, known: list[str], where: str,
            elsewhere: dict[str, str]) -> None:
    if _field(key):
        value = _default(key)
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise ConfigError(f"{name} is not a setting: rtrain holds it at {shown} "
                          "(docs/reference.md lists the settings); remove it")
    _fail_unknown(key.rpartition(".")[2], known, where, {k: v for k, v in elsewhere.items() if v})


def _build(raw: dict[str, Any], cwd: Path) -> Config:
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _TOP:
            _fail_unknown(key, _TOP, "the top level", _where_is(key))
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"[{key}] must be a table")
            known = [f.name for f in fields(_SECTIONS[key]) if f.init]
            for sub in value:
                if sub not in known:
                    elsewhere = {sub: "the top level"} if sub in _TOP else _where_is(sub)
                    _fail_unknown(sub, known, f"[{key}]", elsewhere)
            kwargs[key] = _SECTIONS[key](**value)
        elif key == "ladder":
            kwargs[key] = parse_ladder(value)
        elif key == "hooks":
            kwargs[key] = parse_hooks(value)
        elif key in ("run_dir", "ckpt_dir", "metrics_file"):
            if not isinstance(value, (str, Path)) or not str(value):
                raise ConfigError(f"{key} must be a directory path (got {value!r})")
            kwargs[key] = cwd / Path(value).expanduser()
        else:
            kwargs[key] = value
    if isinstance(kwargs.get("resume"), Path):
        kwargs["resume"] = str(kwargs["resume"])
    if isinstance(kwargs.get("resume"), str) and kwargs["resume"] not in ("auto", "never"):
        kwargs["resume"] = str(cwd / Path(kwargs["resume"]).expanduser())
    cfg = Config(**kwargs)
    cfg.run_dir = cwd / cfg.run_dir
    if cfg.ckpt_dir is None:
        cfg.ckpt_dir = cfg.run_dir / "checkpoints"
    return cfg


def _cli_to_raw(overrides: dict[str, Any]) -> dict[str, Any]:
    """CLI values to the file's nested shape. Keys: "max_restarts" (unique names are found in
    their table), "backoff.enabled" (dotted), "settings" (merged knob by knob). None = not given."""
    raw: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, sub = key.rpartition(".")
        if not section and key not in _TOP and _where_is(key):
            section, sub = _where_is(key)[key].strip("[]"), key
        if section:
            raw.setdefault(section, {})[sub] = value
        else:
            raw[key] = value
    return raw


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(cli_overrides: dict[str, Any], config_file: Path | None, cwd: Path) -> Config:
    """Resolve the configuration. Precedence: command line > config file > defaults (the
    dataclass defaults above); tables merge key by key, so `--max-restarts` keeps the file's
    budgets. Errors name their source and say what to change. The file may name only `KEYS`;
    `cli_overrides` may name any field (the CLI passes settings; tests pass constants)."""
    source, file_raw = find_config(config_file, cwd)
    try:
        _settings_only(file_raw)
        _build(file_raw, cwd)  # validated alone first, so its errors name the file
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    try:
        return _build(_merge(file_raw, _cli_to_raw(cli_overrides)), cwd)
    except ConfigError as err:
        raise ConfigError(f"command line: {err}") from None
