"""The worker's side of supervision, torch-free: stop flag in, heartbeats and exit record out.

Signals. Under rtrain (RTRAIN_STATUS set) the handled stop signal is RTRAIN_STOP_SIGNAL (default
SIGTERM). Run by hand, SIGTERM (kill, scancel, Kubernetes) and SIGUSR1 (Slurm's
`--signal=USR1@T` when a batch script runs the training directly) both request a stop, because no
supervisor is there to translate them. SIGINT is never taken: Ctrl-C still interrupts at once.
Handlers only set a flag; the training loop checks `should_stop()` at a step boundary, saves and
exits 75. `install()` replaces any handler already set for those signals.

Memory pressure. Under rtrain, RTRAIN_RELIEVE_SIGNAL (default SIGURG, `protocol.RELIEVE_SIGNAL`)
asks the process to free memory: the handler only sets a flag, and at the next step boundary
(`Checkpointer.maybe_save`, or the script's own `relieve_pressure(step)`) the callbacks given to
`on_pressure` run (the Checkpointer's: gc and the CUDA cache; OOMBackoff's: a smaller
micro-batch; the script's own: shrink its caches) and a `relieved` heartbeat says what they
did. If the pressure stays, the supervisor then sends the stop signal for a rung down.

Stacks. Under rtrain, faulthandler writes all threads' stacks to $RTRAIN_STATUS/stacks-<pid>.txt
on RTRAIN_DUMP_SIGNAL (default SIGUSR2, `protocol.DUMP_SIGNAL`); the supervisor sends it before
stopping a hung child.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import logging
import os
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rtrain.supervisor.core import filemode, ownfiles
from rtrain.supervisor.core.atomic_write import write_atomic
from rtrain.supervisor.core.protocol import (
    DUMP_SIGNAL,
    ENV_ATTEMPT,
    ENV_CONTROL_TOKEN,
    ENV_DUMP_SIGNAL,
    ENV_HEARTBEAT,
    ENV_RELIEVE_SIGNAL,
    ENV_STATUS,
    ENV_STOP_SIGNAL,
    MAX_INTERVAL_WARMUP_STEPS,
    RELIEVE_SIGNAL,
    ExitRecord,
    Heartbeat,
    exit_record_name,
    socket_address,
)
from rtrain.worker.stuck import progress

log = logging.getLogger(__name__)

STEP_THROTTLE_S = 0.2  # at most this often a "step" heartbeat; other events always go out
EVENT_SEND_WAIT_S = 2.0  # how long an event waits for room in a full supervisor queue
_TRACEBACK_TAIL = 4000
_clock = time.monotonic  # a seam for tests


class _State:
    def __init__(self) -> None:
        self.installed = False
        self.stop = threading.Event()
        self.stop_signal: str | None = None  # name of the signal that asked, if any
        self.sock: socket.socket | None = None
        self.addr: str | bytes | None = None
        self.token: str | None = None  # RTRAIN_CONTROL_TOKEN, sent with each heartbeat
        self.dump_file: Any = None  # kept open: faulthandler writes to its fd
        self.last_step_send = float("-inf")  # other events must not hold back step heartbeats
        self.steps = 0
        self.last_step_time: float | None = None
        self.max_interval: float | None = None
        self.samples = 0.0  # since the last sent heartbeat
        # Step intervals and boundary waits since the last sent step heartbeat (its `step_s`
        # and `wait_s`: the straggler rule's inputs).
        self.interval_sum = 0.0
        self.intervals = 0
        self.wait_sum = 0.0
        self.samples_since: float | None = None
        self.rate: float | None = None
        self.held: tuple[int | None, float | None, dict[str, Any]] | None = None  # throttled step
        self.said_stop = False  # a "stop" went out: the last word, nothing follows it
        self.relieve = threading.Event()  # a relieve request waits for the next step boundary
        self.on_pressure: list[Callable[[], Callable[[], str | None] | None]] = []  # weak refs
        self.script_start: float | None = None  # mark_script_start: a process started ahead


_state = _State()


def supervised() -> bool:
    """True when an rtrain supervisor started this process."""
    return ENV_STATUS in os.environ


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int | None:
    """The group's size under torchrun (each node's supervisor hears only its own ranks)."""
    size = os.environ.get("WORLD_SIZE")
    return int(size) if size and size.isdigit() else None


def attempt() -> int:
    return int(os.environ.get(ENV_ATTEMPT, "0"))


def _signal(name: str) -> signal.Signals:
    name = name.strip().upper()
    return signal.Signals[name if name.startswith("SIG") else "SIG" + name]


def stop_signals() -> list[signal.Signals]:
    """The signals `install()` turns into a stop request (see the module docstring)."""
    if supervised():
        return [_signal(os.environ.get(ENV_STOP_SIGNAL) or "SIGTERM")]
    return [signal.SIGTERM, signal.SIGUSR1]


def _on_stop_signal(signum: int, frame: object) -> None:
    _state.stop_signal = signal.Signals(signum).name
    _state.stop.set()


def _on_relieve_signal(signum: int, frame: object) -> None:
    _state.relieve.set()


def install() -> None:
    """Set up stop signals, the stack dump and the heartbeat socket; safe to call repeatedly.

    Call it from the main thread (Python allows signal handlers only there); elsewhere the
    signals are skipped with a warning and everything else still works.
    """
    if _state.installed:
        return
    _state.installed = True
    if threading.current_thread() is threading.main_thread():
        for sig in stop_signals():
            signal.signal(sig, _on_stop_signal)
        if supervised():
            relieve = _signal(os.environ.get(ENV_RELIEVE_SIGNAL) or RELIEVE_SIGNAL)
            signal.signal(relieve, _on_relieve_signal)
    else:
        log.warning("rtrain worker installed off the main thread: stop signals not handled")
    status = os.environ.get(ENV_STATUS)
    if status:
        progress.open_board(Path(status), rank())
        dump = _signal(os.environ.get(ENV_DUMP_SIGNAL) or DUMP_SIGNAL)
        _state.dump_file = open_stack_file(Path(status))
        if _state.dump_file is not None:
            faulthandler.register(dump, file=_state.dump_file, all_threads=True, chain=False)
    address = os.environ.get(ENV_HEARTBEAT)
    _state.token = os.environ.get(ENV_CONTROL_TOKEN)  # the attempt's secret: see Heartbeat.token
    if address:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        _state.sock, _state.addr = sock, socket_address(address)
        atexit.register(_send_held)
    heartbeat(event="start", started=script_started())


def open_stack_file(status_dir: Path) -> IO[str] | None:
    """`stacks-<pid>.txt` in the attempt dir, where faulthandler writes this process's stacks
    on the dump signal: the run's file mode, appended to (never truncated) and never through
    a link planted at the name (supervisor/core/ownfiles.py). None, with a warning, when it cannot
    be opened: training goes on without the dump."""
    path = status_dir / f"stacks-{os.getpid()}.txt"
    try:
        opened = ownfiles.open_own(path, os.O_WRONLY | os.O_APPEND, create=True,
                                   mode=filemode.env_mode(os.environ))
    except OSError as e:
        log.warning("no stack dump on a hang: %s", e)
        return None
    return os.fdopen(opened.fd, "a")


def mark_script_start(at: float | None = None) -> None:
    """Say that the training script starts now (unix time `at`) in this process. For a process
    that runs the script later than its own start, such as an interpreter started ahead and
    handed the attempt: call it just before the script runs. Without it the process's start
    counts (`script_started`)."""
    _state.script_start = time.time() if at is None else at


def script_started() -> float | None:
    """Unix time the training script began in this process: `mark_script_start`'s, else the
    process's start (/proc/self/stat, to the clock tick); None where neither is known."""
    if _state.script_start is not None:
        return _state.script_start
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22, starttime, in clock ticks since boot; the name in field 2 may hold spaces.
        ticks = int(stat.rsplit(b")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - max(0.0, age)


def step_entered() -> None:
    """The next step begins (the step boundary returned): kept for the hang report
    (worker/stuck/progress.py). A script that sends its own step heartbeats may call it at the top
    of each step."""
    progress.entered()


def should_stop() -> bool:
    """True once a stop was requested (signal or `request_stop`): save and exit 75."""
    return _state.stop.is_set()


def request_stop() -> None:
    """Stop as on the stop signal: `should_stop()` turns True, and the next
    `Checkpointer.maybe_save` saves and exits 75 (unless `exit_on_stop=False`); rtrain then
    relaunches at once, on the same rung."""
    _state.stop.set()


def on_pressure(callback: Callable[[], str | None]) -> None:
    """Run `callback` at the step boundary after a relieve request (memory pressure). It frees
    what it can and returns a few words saying what (or None). Held weakly: a bound method
    goes away with its object."""
    if any(ref() == callback for ref in _state.on_pressure):
        return  # registered already (e.g. by an earlier Checkpointer)
    ref: Any = (weakref.WeakMethod(callback) if hasattr(callback, "__self__")
                else (lambda: callback))
    _state.on_pressure.append(ref)


def pressure_requested() -> bool:
    """True while a relieve request waits for `relieve_pressure`."""
    return _state.relieve.is_set()


def relieve_pressure(step: int | None = None, settings: dict[str, Any] | None = None
                     ) -> list[str] | None:
    """At a step boundary: if relief was requested, run the `on_pressure` callbacks, collect
    garbage, tell the supervisor (`relieved` heartbeat, with `settings` when given) and return
    what was done; None (and nothing run) without a request."""
    s = _state
    if not s.relieve.is_set():
        return None
    s.relieve.clear()
    done = []
    alive = []
    for ref in s.on_pressure:
        fn = ref()
        if fn is None:
            continue
        alive.append(ref)
        try:
            said = fn()
        except Exception as e:  # relief is best effort: a failing callback must not end training
            # Only the text: a logged exception's traceback would keep this frame, and with it
            # the next callback's object, alive.
            log.warning("memory-pressure callback %r failed: %s", fn, str(e))
            continue
        if said:
            done.append(said)
    s.on_pressure[:] = alive
    freed = gc.collect()
    done.append(f"gc collected {freed} objects")
    log.warning("memory pressure: %s", "; ".join(done))
    heartbeat(step=step, event="relieved", reason="; ".join(done), settings=settings)
    return done


def boundary_wait(seconds: float) -> None:
    """This rank waited `seconds` for the other ranks: at a step-boundary collective (the
    Checkpointer's stop/save agreement) or inside DDP's gradient all-reduce
    (worker/commwait.py). Reported with the next step heartbeat as `wait_s`."""
    if _state.sock is not None:  # nobody to tell otherwise
        _state.wait_sum += max(0.0, seconds)


def heartbeat(
    step: int | None = None,
    loss: float | None = None,
    samples: float | None = None,
    event: str = "step",
    **fields: Any,
) -> None:
    """Report progress. `samples`: samples processed since the previous call (the batch size).

    Cheap enough for every step: without a supervisor it returns at once, and "step" heartbeats
    go out at most every 0.2 s. Pass `loss` as a Python float (`loss.item()` syncs the GPU, so
    call it only where you would anyway). Extra `fields` are `Heartbeat` fields such as
    `next_save_step` or `settings`.
    """
    s = _state
    if s.sock is None:
        return
    now = _clock()
    if event == "step" and step is not None:
        progress.left(step)  # before the throttle: the hang report needs every step
        if s.last_step_time is not None and s.steps >= MAX_INTERVAL_WARMUP_STEPS:
            interval = now - s.last_step_time
            s.max_interval = interval if s.max_interval is None else max(s.max_interval, interval)
        if s.last_step_time is not None:
            s.interval_sum += now - s.last_step_time
            s.intervals += 1
        s.steps += 1
        s.last_step_time = now
    if samples:
        if s.samples_since is None:
            s.samples_since = now
        else:
            s.samples += samples
    if event == "step" and now - s.last_step_send < STEP_THROTTLE_S:
        s.held = (step, loss, fields)  # sent at exit if no later step heartbeat goes out
        return
    # The rate window closes only on step heartbeats (>= 0.2 s apart): events are not steps.
    if event == "step" and s.samples_since is not None and now > s.samples_since and s.samples:
        s.rate = s.samples / (now - s.samples_since)
        s.samples, s.samples_since = 0.0, now
    if event == "stop":
        s.held = None  # "stop" carries the step and must stay the last word
        s.said_stop = True
    if event == "step" and s.intervals:
        fields = {**fields, "step_s": s.interval_sum / s.intervals,
                  "wait_s": s.wait_sum / s.intervals, "host": _hostname()}
        s.interval_sum, s.intervals, s.wait_sum = 0.0, 0, 0.0
    _send(event, step, loss, fields)
    if event == "step":
        s.last_step_send, s.held = now, None


def _send(event: str, step: int | None, loss: float | None, fields: dict[str, Any]) -> None:
    s = _state
    hb = Heartbeat(
        pid=os.getpid(),
        rank=rank(),
        time=time.time(),
        event=event,
        step=step,
        loss=None if loss is None else float(loss),
        samples_per_s=s.rate,
        max_step_interval=s.max_interval,
        world=world_size(),
        token=s.token,
        **fields,
    )
    data = hb.encode()
    deadline: float | None = None
    while True:
        try:
            s.sock.sendto(data, socket.MSG_DONTWAIT, s.addr)
            return
        except BlockingIOError:
            # The supervisor's queue is full (a busy moment on a loaded machine; Linux queues
            # 10 datagrams by default). A step heartbeat is dropped: the next one says more.
            # An event is said once (save_skipped, save_begin, stop, exiting), so it waits a
            # little for room; not forever, since a training step must never hang on it.
            if event == "step":
                return
            now = time.monotonic()  # not _clock: tests freeze that one
            deadline = now + EVENT_SEND_WAIT_S if deadline is None else deadline
            if now >= deadline:
                return
            time.sleep(0.005)
        except OSError:  # nobody listening: the supervisor is gone or never was
            return


_host: str | None = None


def _hostname() -> str:
    global _host
    if _host is None:
        _host = socket.gethostname()
    return _host


def _send_held() -> None:
    """At exit: the last step the throttle held back, so the supervisor knows where it ended;
    then `exiting`, so that the interpreter's teardown is not taken for a hang."""
    s = _state
    if s.sock is not None and s.held is not None:
        step, loss, fields = s.held
        s.held = None
        _send("step", step, loss, fields)
    if s.sock is not None and not s.said_stop:
        _send("exiting", None, None, {})


def write_exit_record(
    kind: str,
    reason: str,
    step: int | None = None,
    exception: BaseException | None = None,
    settings: dict[str, Any] | None = None,
    **extra: Any,
) -> Path | None:
    """Tell the supervisor how this rank is ending (contract 2); None when not supervised.

    Written to a temp name and renamed, so the supervisor never reads half a record.
    """
    status = os.environ.get(ENV_STATUS)
    if not status:
        return None
    tail = None
    if exception is not None:
        tail = "".join(traceback.format_exception(exception))[-_TRACEBACK_TAIL:]
    record = ExitRecord(
        kind=getattr(kind, "value", kind),
        reason=reason,
        pid=os.getpid(),
        rank=rank(),
        step=step,
        exception=None if exception is None else repr(exception),
        traceback_tail=tail,
        settings=settings,
        extra=extra,
        time=time.time(),
    )
    path = Path(status) / exit_record_name(rank())
    write_atomic(path, record.to_json(), mode=filemode.from_env(), durable=False)
    return path
