"""The launch's side of the mirror: start the uploader process, turn its messages into events,
and give it time to send the newest checkpoint when the run ends.

The uploader (`mirror/uploader.py`) is a child of rtrain but not of the attempt: its pid is left
out of the attempt's process tree (`pids`), so it is neither swept at an attempt's end nor
counted as the child's CPU or memory. Its messages are read by a thread into a queue and
emitted from the loop's thread at each watch sample (`poll`), so events keep one writer.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rtrain.supervisor.config import Config
from rtrain.supervisor.core import isolated, ownfiles
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.core.untrusted_text import safe
from rtrain.supervisor.mirror.uploader import Spec
from rtrain.supervisor.proc.reaper import own
from rtrain.supervisor.proc.spawn import pdeathsig_preexec
from rtrain.supervisor.records.events import EventLog

LOG_NAME = "mirror.log"


def open_for(config: Config, run_dir: Path, ckpt_dir: Path, events: EventLog,
             say: Callable[[str], None], *, new_run: bool) -> Mirroring | None:
    """The run's mirror, probed (a small object written, read back and deleted), or None when
    no mirror is set. A mirror that cannot be used is a start-up error: the user finds out
    before training starts, not after a week of checkpoints that went nowhere. Except an
    endpoint that does not answer when a run that already trained is launched again (a
    requeue during a store's outage): training goes on and the uploader catches up."""
    if config.mirror is None:
        return None
    from rtrain.supervisor.mirror.store import MirrorError, Timeouts, Unreachable, open_mirror

    timeouts = Timeouts.of(config)
    answered = True
    try:
        mirror = open_mirror(config.mirror, file_mode=config.file_mode, timeouts=timeouts)
        mirror.probe()
    except Unreachable as e:
        if new_run:
            raise UsageError(str(e)) from None
        # Each call gave up after its timeouts: the resume's look at the mirror would only wait
        # as long again, so this launch resumes from the local checkpoints without asking.
        answered = False
        say(f"{e}; training goes on, uploads will catch up (resuming from local checkpoints)")
        events.emit("mirror_failed", reason=str(e), step=None, retry_in_s=None,
                    given_up=False)
    except MirrorError as e:
        raise UsageError(str(e)) from None  # it names the mirror and what to change
    spec = Spec(ckpt_dir=ckpt_dir, url=config.mirror, keep_remote=config.keep_remote,
                milestone_every=config.milestone_every, parallel=config.mirror_parallel,
                file_mode=config.file_mode, connect_timeout_s=timeouts.connect_s,
                read_timeout_s=timeouts.read_s)
    return Mirroring(spec, run_dir, events, say, mirror, answered=answered)


class Mirroring:
    def __init__(self, spec: Spec, run_dir: Path, events: EventLog,
                 say: Callable[[str], None], mirror: Any, *, answered: bool = True) -> None:
        self.spec, self.run_dir, self.events, self.say = spec, run_dir, events, say
        self.mirror = mirror  # mirror.store.Mirror, for the resume's download
        self.answered = answered  # the launch's probe got answers (else: no look at resume)
        self.display = mirror.display  # the URL without credentials
        self.proc: subprocess.Popen[bytes] | None = None
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._final: dict[str, Any] | None = None
        self._failing = False

    def start(self) -> None:
        if self.proc is not None:
            return
        # Its stderr (tracebacks); never through a link planted at the name (RefusedFile).
        log = ownfiles.open_own(self.run_dir / LOG_NAME, os.O_WRONLY | os.O_APPEND,
                                create=True, mode=self.spec.file_mode).fd
        try:
            self.proc = subprocess.Popen(
                # Isolated: no module of the working directory or PYTHONPATH is imported.
                isolated.module_argv("rtrain.supervisor.mirror.uploader", self.spec.dumps()),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                # Its own session: a Ctrl-C at the terminal reaches rtrain, which decides.
                start_new_session=True, preexec_fn=pdeathsig_preexec(os.getpid()))
        finally:
            os.close(log)
        own(self.proc)
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True,
                         name="rtrain-mirror-reader").start()

    def pids(self) -> list[int]:
        """The uploader's pid while it runs: not part of any attempt."""
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []

    def _read(self, stream: IO[bytes]) -> None:
        for line in stream:
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not ours (a library printing to stdout): its stderr has the story
            if isinstance(message, dict):
                self._messages.put(message)
        self._messages.put(None)

    def poll(self) -> None:
        """Emit what the uploader said since the last poll."""
        while True:
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return
            if message is not None:
                self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        kind, get = message.get("kind"), message.get
        if kind == "final":
            self._final = message
        elif kind == "standby":
            self.say(f"mirror: standing by ({get('reason')})")
        elif kind == "started":
            self._failing = False
        elif kind == "uploaded":
            if self._failing:
                self.say(f"mirror {self.display}: uploads resumed")
            self._failing = False
            self.events.emit("mirror_uploaded", step=get("step"), bytes=get("bytes"),
                             seconds=get("seconds"), files=get("files"))
        elif kind == "failed":
            reason, retry, given_up = str(get("reason")), get("retry_in_s"), bool(get("given_up"))
            if not self._failing or given_up:  # once per outage on the console
                self.say(reason  # names the mirror
                         + (f" (retrying in {retry:g} s)" if isinstance(retry, (int, float))
                            and not given_up else ""))
            self._failing = not given_up and retry is not None
            self.events.emit("mirror_failed", reason=reason, step=get("step"), retry_in_s=retry,
                             given_up=given_up)
        elif kind == "refused":
            name, reason = str(get("name")), str(get("reason"))
            self.say(f"mirror {self.display}: not uploading {safe(name)}: {safe(reason)}")
            self.events.emit("mirror_refused", step=get("step"), name=name, reason=reason)
        elif kind == "other_run":
            self.say(safe(str(get("reason"))))
            self.events.emit("mirror_other_run", steps=get("steps", []), newest=get("newest"),
                             reason=str(get("reason")))
        elif kind == "superseded":
            self.events.emit("mirror_superseded", steps=get("steps", []))
        elif kind == "pruned":
            self.events.emit("mirror_pruned", steps=get("steps", []))

    def finish(self, wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """The run ends: let the uploader send what is still waiting, for at most `wait_s`, and
        record whether the newest checkpoint made it (`mirror_final`)."""
        if self.proc is None:
            return
        deadline = clock() + wait_s
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b"finish\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        while self.proc.poll() is None and clock() < deadline:
            time.sleep(0.05)
            self.poll()
        timed_out = self.proc.poll() is None
        self.close()
        self.poll()
        final = self._final or {}
        step = final.get("step")
        if timed_out:
            made_it, why = False, f"not finished after {wait_s:g} s"
        elif not final:
            made_it, why = False, f"the uploader ended with status {self.proc.returncode}"
        else:
            made_it = bool(final.get("made_it"))
            why = str(final.get("reason") or (
                "uploaded" if made_it else "the mirror could not be reached"))
        self.events.emit("mirror_final", step=step, made_it=made_it, reason=why)
        self.say(f"mirror {self.display}: " + (
            f"newest checkpoint (step {step}) is on the mirror" if made_it and step is not None
            else "no checkpoint of this run to upload" if made_it
            else f"newest checkpoint{f' (step {step})' if step is not None else ''} is NOT on "
                 f"the mirror: {safe(why)}"))

    def close(self) -> None:
        """Stop the uploader now (a half-sent checkpoint has no manifest: it does not exist)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
