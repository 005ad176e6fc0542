"""The events.jsonl schema: every kind of event, the fields it carries, whether it is fsynced
at once and whether a hook may name it. Data only, shared by the log (records/events.py), the
hook tables of the config (hooks/hook_spec.py) and the readers; docs/reference.md's Events table
is generated from it (scripts/gen_reference.py; tests/test_reference.py fails when it drifts).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """Every kind of event the supervisor records; `KINDS` says what each one carries."""

    LAUNCH = "launch"
    SKIPPED_CHECKPOINT = "skipped_checkpoint"
    CHECKPOINTS_SET_ASIDE = "checkpoints_set_aside"
    FOREIGN_COPY_KEPT = "foreign_copy_kept"
    FOREIGN_RESTORED = "foreign_restored"
    HEARTBEAT_SUMMARY = "heartbeat_summary"
    SIGNAL = "signal"
    EXIT = "exit"
    CLASSIFICATION = "classification"
    STUCK_RANKS = "stuck_ranks"
    DECISION = "decision"
    DEGRADE = "degrade"
    GIVE_UP = "give_up"
    FAILURE_RATE = "failure_rate"
    QUARANTINE = "quarantine"
    DEVICE_FAILED = "device_failed"
    EXCLUDE_NODE = "exclude_node"
    REQUEUE = "requeue"
    WALL_CLOCK_STOP = "wall_clock_stop"
    FINISHED = "finished"
    GPU_NOT_RELEASED = "gpu_not_released"
    LOCK_TAKEOVER = "lock_takeover"
    LEFTOVERS_ENDED = "leftovers_ended"
    LEFTOVERS_SKIPPED = "leftovers_skipped"
    EVENTS_LOST = "events_lost"
    HOOK_FAILED = "hook_failed"
    SAVE_SKIPPED = "save_skipped"
    CADENCE = "cadence"
    CHECKPOINT_AT_FAILURE = "checkpoint_at_failure"
    CONTROL_REFUSED = "control_refused"
    HEARTBEATS_REFUSED = "heartbeats_refused"
    COMPILE_CACHE = "compile_cache"
    FINAL_STATE_UNSAVED = "final_state_unsaved"
    MIRROR_UPLOADED = "mirror_uploaded"
    MIRROR_FAILED = "mirror_failed"
    MIRROR_SUPERSEDED = "mirror_superseded"
    MIRROR_REFUSED = "mirror_refused"
    MIRROR_OTHER_RUN = "mirror_other_run"
    MIRROR_PRUNED = "mirror_pruned"
    MIRROR_FINAL = "mirror_final"
    MIRROR_DOWNLOADED = "mirror_downloaded"
    MEMORY_PRESSURE = "memory_pressure"
    PRESSURE_RELIEVED = "pressure_relieved"
    WORLD_SIZE_CHANGED = "world_size_changed"
    RECOVERY = "recovery"
    STANDBY_READY = "standby_ready"
    STANDBY_DISCARDED = "standby_discarded"
    STANDBY_FAILED = "standby_failed"
    CANNOT_RESUME = "cannot_resume"
    STRAGGLER = "straggler"
    MEMORY_TIER = "memory_tier"
    SNAPSHOT_PERSISTED = "snapshot_persisted"
    SNAPSHOT_SEALED = "snapshot_sealed"
    SNAPSHOT_REFUSED = "snapshot_refused"
    SNAPSHOT_NOT_PERSISTED = "snapshot_not_persisted"
    SNAPSHOT_RESUMED = "snapshot_resumed"
    PEER_COPY = "peer_copy"


@dataclass(frozen=True, kw_only=True, slots=True)
class KindSpec:
    """What one kind of event carries and how it is written."""

    fields: tuple[str, ...]
    """Fields every event of the kind has (older logs may lack some)."""
    optional: tuple[str, ...] = ()
    """Fields written only when they apply (`slurm` under Slurm, ...)."""
    durable: bool = False
    """fsync right after the line is written."""
    hookable: bool = True
    """A `[[hooks]]` table may name it in `on`."""
    meaning: str = ""


# Durable (see the module docstring): `launch`, so an attempt that runs for hours is on record;
# `decision`, on disk before state.json records the same decision; the ends of a run.
KINDS: dict[Kind, KindSpec] = {
    Kind.LAUNCH: KindSpec(
        fields=("attempt", "argv", "settings", "level", "resume_from", "pid", "ckpt_dir",
                "standby", "start_s"),
        optional=("slurm", "spawn_at", "spawn_s", "tier"), durable=True,
        meaning="an attempt was started: in the warm standby (`standby` true) or a new "
                "process; `start_s` from the spawn or the hand-off until it was running; "
                "`tier` where its checkpoint is read from (memory or disk)"),
    Kind.SKIPPED_CHECKPOINT: KindSpec(
        fields=("path", "reason"),
        meaning="resume selection passed over a checkpoint, or a worker could not load it"),
    Kind.CHECKPOINTS_SET_ASIDE: KindSpec(
        fields=("path", "names"),
        meaning="a run started over (--resume never): the earlier run's checkpoints in the "
                "dir were moved into `path`, so the new run owns only its own"),
    Kind.FOREIGN_COPY_KEPT: KindSpec(
        fields=("path", "step", "bytes", "how"), hookable=False,
        meaning="rtrain copied the new verified content of a foreign checkpoint the script "
                "rewrites in place into the run dir (ckpt/keepcopy.py)"),
    Kind.FOREIGN_RESTORED: KindSpec(
        fields=("path", "reason", "step", "verified_at"),
        meaning="a foreign checkpoint failed verification at a relaunch and rtrain put its "
                "copy of the last verified content back"),
    Kind.HEARTBEAT_SUMMARY: KindSpec(
        fields=("attempt", "step", "loss", "samples_per_s"),
        optional=("rss_bytes", "gpu_used", "gpu_total"),
        meaning="training progress, every few seconds and at the attempt's end"),
    Kind.SIGNAL: KindSpec(fields=("name",), meaning="a signal reached the supervisor"),
    Kind.EXIT: KindSpec(
        fields=("attempt", "returncode", "signal", "duration_s", "last_step", "peak_rss_bytes",
                "gpu_used_peak", "gpu_total", "leftovers"),
        optional=("stop_s", "save_s", "step_s", "exited_at", "hang_at", "reported_at"),
        meaning="an attempt ended"),
    Kind.STUCK_RANKS: KindSpec(
        fields=("attempt", "summary", "behind", "ranks", "flight_recorder"),
        meaning="at a hang: which ranks are behind and where each rank is (its step, phase, "
                "code location, the collective it waits in), and the NCCL flight recorder's "
                "dumps kept in the attempt dir"),
    Kind.CLASSIFICATION: KindSpec(fields=("attempt", "failure", "reason"),
                                  meaning="what a failed attempt's failure was"),
    Kind.DECISION: KindSpec(
        fields=("attempt", "action", "reason", "backoff_s", "level", "settings", "exit_code",
                "resume"),
        durable=True, meaning="what the supervisor does after an attempt"),
    Kind.DEGRADE: KindSpec(fields=("attempt", "change", "level", "settings"),
                           meaning="the next attempt runs one rung down the ladder"),
    Kind.GIVE_UP: KindSpec(fields=("reason", "exit_code"), durable=True,
                           meaning="the run gave up"),
    Kind.FAILURE_RATE: KindSpec(fields=("attempt", "detail", "count", "limit"),
                                meaning="more failures in the last hour than allowed"),
    Kind.QUARANTINE: KindSpec(fields=("attempt", "path", "step", "reason"),
                              meaning="a checkpoint was set aside"),
    Kind.DEVICE_FAILED: KindSpec(fields=("attempt", "detail", "devices"), optional=("slurm",),
                                 meaning="a GPU failed its health checks after a failure"),
    Kind.EXCLUDE_NODE: KindSpec(fields=("done", "detail"),
                                meaning="the node was excluded from the Slurm job"),
    Kind.REQUEUE: KindSpec(fields=("done", "detail"), durable=True,
                           meaning="the Slurm job was requeued"),
    Kind.WALL_CLOCK_STOP: KindSpec(
        fields=("attempt", "end_time", "stop_at", "margin_s", "reason"),
        meaning="the attempt was stopped before the Slurm job's time limit"),
    Kind.FINISHED: KindSpec(fields=("reason",), durable=True, meaning="the run finished"),
    Kind.GPU_NOT_RELEASED: KindSpec(fields=("pids",),
                                    meaning="GPU memory still held when relaunching"),
    Kind.LOCK_TAKEOVER: KindSpec(fields=("previous",), durable=True,
                                 meaning="the run lock of a dead supervisor was taken over"),
    Kind.LEFTOVERS_ENDED: KindSpec(fields=("pids", "commands", "found"), hookable=False,
                                   meaning="processes an earlier supervisor left were killed"),
    Kind.LEFTOVERS_SKIPPED: KindSpec(
        fields=("pids", "commands", "reasons"), hookable=False,
        meaning="live processes procs.json names were left running: nothing proves an rtrain "
                "of this run started them (procs.json unsigned or forged, no mark in their "
                "environment)"),
    Kind.EVENTS_LOST: KindSpec(fields=("count", "reason"), hookable=False,
                               meaning="events were dropped while the disk was full"),
    Kind.HOOK_FAILED: KindSpec(fields=("command", "event", "event_seq", "reason"),
                               optional=("returncode", "stderr"), hookable=False,
                               meaning="a hook failed, timed out or could not start"),
    Kind.SAVE_SKIPPED: KindSpec(fields=("attempt", "step", "rank", "reason"),
                                meaning="the worker could not write a checkpoint"),
    Kind.CADENCE: KindSpec(
        fields=("attempt", "step", "every_steps", "reason", "save_stall_s", "step_time_s",
                "mtbf_s", "mtbf_source", "loss_factor", "expected_loss_s"),
        hookable=False, meaning="every=\"auto\" chose the save interval (after a save)"),
    Kind.CHECKPOINT_AT_FAILURE: KindSpec(
        fields=("attempt", "step", "rank", "exception"),
        meaning="an exception ended the worker and it saved its last completed step first"),
    Kind.CONTROL_REFUSED: KindSpec(
        fields=("attempt", "rank", "reason"),
        meaning="the worker refused requests on its control FIFO that did not carry the "
                "attempt's token (someone other than rtrain asked for a save at a hang)"),
    Kind.HEARTBEATS_REFUSED: KindSpec(
        fields=("attempt", "count", "senders"),
        meaning="rtrain refused datagrams on the attempt's heartbeat socket whose sender was "
                "another user or a process outside the attempt (`senders`: `pid P (why)`)"),
    Kind.COMPILE_CACHE: KindSpec(
        fields=("attempt", "rank", "outcome", "detail"),
        meaning="the worker loaded the checkpoint's compile cache (outcome `loaded`) or "
                "ignored it (`ignored`, detail says why: unsigned, another torch or device, "
                "too large, unreadable); the first step then compiles cold"),
    Kind.FINAL_STATE_UNSAVED: KindSpec(
        fields=("last_step", "checkpoint_step", "skipped_saves", "reason"), durable=True,
        meaning="the run stops with its last steps in no checkpoint"),
    Kind.MIRROR_UPLOADED: KindSpec(fields=("step", "bytes", "seconds", "files"),
                                   meaning="a checkpoint reached the mirror (manifest last)"),
    Kind.MIRROR_FAILED: KindSpec(
        fields=("reason", "step", "retry_in_s", "given_up"),
        meaning="an upload, listing or download failed (retried unless given_up)"),
    Kind.MIRROR_SUPERSEDED: KindSpec(
        fields=("steps",), meaning="checkpoints the mirror skips: a newer one went first"),
    Kind.MIRROR_REFUSED: KindSpec(
        fields=("step", "name", "reason"),
        meaning="a local checkpoint the uploader will not send: a link, a copy under another "
                "step's name, another run's, unsigned under a key"),
    Kind.MIRROR_OTHER_RUN: KindSpec(
        fields=("steps", "newest", "reason"),
        meaning="the mirror prefix holds checkpoints of another run: left alone, not counted"),
    Kind.MIRROR_PRUNED: KindSpec(fields=("steps",), hookable=False,
                                 meaning="the mirror's retention deleted checkpoints"),
    Kind.MIRROR_FINAL: KindSpec(
        fields=("step", "made_it", "reason"), durable=True,
        meaning="at the run's end: whether the newest checkpoint is on the mirror"),
    Kind.MIRROR_DOWNLOADED: KindSpec(
        fields=("step", "bytes", "seconds", "cached_bytes"), durable=True,
        meaning="resume downloaded a checkpoint from the mirror (verified)"),
    Kind.MEMORY_PRESSURE: KindSpec(
        fields=("attempt", "action", "source", "used", "limit", "fraction", "why", "left_s"),
        meaning="memory growing toward its limit faster than relief and a stop take, or above "
                "its hard line for seconds: relief asked, or the attempt stopped "
                "for a rung down"),
    Kind.PRESSURE_RELIEVED: KindSpec(
        fields=("attempt", "step", "rank", "detail", "settings"),
        meaning="the worker answered a relieve request: what it freed, the settings it uses"),
    Kind.WORLD_SIZE_CHANGED: KindSpec(
        fields=("attempt", "world_size", "saved_world_size", "checkpoint"),
        meaning="the attempt's group has another number of ranks than the one that wrote the "
                "checkpoint it resumed (a node lost, or one added)"),
    Kind.RECOVERY: KindSpec(
        fields=("attempt", "failed_attempt", "failure", "complete", "teardown_s", "detection_s",
                "decision_s", "backoff_s", "spawn_s", "imports_s", "restore_s", "first_step_s",
                "total_s", "last_step", "resumed_step", "steps_lost", "step_time_s",
                "work_lost_s", "lost_s"),
        meaning="what a failure cost: its phases up to the relaunched attempt's first step, "
                "and the steps run again"),
    Kind.STANDBY_READY: KindSpec(
        fields=("attempt", "pid", "rss_bytes", "modules", "import_s"),
        optional=("since_start_s", "zygote"),
        meaning="a warm standby finished its imports and waits for the next attempt; "
                "`since_start_s` after the attempt it waits beside started; `zygote` the "
                "process it was forked from (which imported `modules` in `import_s`)"),
    Kind.STANDBY_DISCARDED: KindSpec(
        fields=("attempt", "pid", "reason"),
        meaning="a standby was ended unused (import-time environment or a preloaded file "
                "changed, host memory tight, memory pressure rising, the run ended); the "
                "attempt starts cold"),
    Kind.STANDBY_FAILED: KindSpec(
        fields=("attempt", "pid", "reason", "output"),
        meaning="a standby died, failed an import, initialised CUDA or did not answer; the "
                "attempt starts cold"),
    Kind.CANNOT_RESUME: KindSpec(
        fields=("attempt", "reason", "ckpt_dir", "files", "suggest", "message"),
        meaning="an attempt failed with nothing to resume from, said once per launch; "
                "`reason`: `elsewhere` (the script wrote checkpoint-like `files` outside the "
                "checkpoint dir; `suggest` is the --ckpt-dir to pass), `no_handoff` (no "
                "--resume-arg, {checkpoint} or Checkpointer takes a checkpoint), "
                "`not_checkpoints` (the dir holds only `files` that are no checkpoint) or "
                "`empty`"),
    Kind.STRAGGLER: KindSpec(
        fields=("attempt", "step", "rank", "host", "ratio", "busy_s", "others_busy_s",
                "ranks", "window_steps", "detail"),
        meaning="a rank was consistently slower than the others over the window ([straggler]): "
                "its median busy time per step (`busy_s`) is `ratio` times the other ranks' "
                "median (`others_busy_s`); `host` is the node it runs on"),
    Kind.MEMORY_TIER: KindSpec(
        fields=("attempt", "step", "state", "every", "stall_s", "write_s", "reason"),
        optional=("cost_s", "step_s", "bytes", "measured"),
        meaning="the memory tier started, changed its interval or stopped (`state` on, off "
                "or dropped; `reason` why it is off); `cost_s` what a snapshot of `bytes` "
                "costs the steps it runs beside (`measured` against the plain `step_s`, else "
                "estimated from the writer's CPU time)"),
    Kind.SNAPSHOT_PERSISTED: KindSpec(
        fields=("attempt", "step", "path", "bytes", "seconds", "why"),
        meaning="rtrain committed a memory-tier snapshot to the checkpoint dir (`why`: the "
                "attempt ended, the run ended, found at launch, disk cadence)"),
    Kind.SNAPSHOT_SEALED: KindSpec(
        fields=("attempt", "step", "bytes", "seconds"),
        meaning="the process died outside its optimizer's step: rtrain made the live state it "
                "kept in shared memory (the parameters and optimizer state of the last step "
                "boundary) a memory-tier snapshot of `step`, hashed and committed in `seconds`"),
    Kind.SNAPSHOT_RESUMED: KindSpec(
        fields=("attempt", "step", "origin"),
        meaning="under torchrun, the group resumed from the memory tier's parts of `step` (whole "
                "on every node; `origin` \"node\": each node's own, \"peer\": some copied from a "
                "peer node)"),
    Kind.PEER_COPY: KindSpec(
        fields=("attempt", "state", "peer", "step", "ranks", "bytes", "seconds", "reason"),
        meaning="several nodes: this node copies a peer's memory-tier parts (`replicating`, once "
                "per peer), copied what it lacked of a step at an attempt's start (`gathered`), "
                "or a copy failed or was refused (`failed`, with the reason, once per reason)"),
    Kind.SNAPSHOT_REFUSED: KindSpec(
        fields=("attempt", "step", "path", "reason"),
        meaning="a memory-tier snapshot failed its check (a file that does not match its "
                "manifest, a bad manifest): not persisted, not resumed from"),
    Kind.SNAPSHOT_NOT_PERSISTED: KindSpec(
        fields=("attempt", "step", "reason"),
        meaning="rtrain could not copy a memory-tier snapshot the worker asked it to persist "
                "as its disk save (a full disk): it stays in memory, the next request retries; "
                "said once until a copy succeeds"),
}
DURABLE_KINDS = frozenset(k.value for k, spec in KINDS.items() if spec.durable)
HOOKABLE_KINDS = tuple(k.value for k, spec in KINDS.items() if spec.hookable)
