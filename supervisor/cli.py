"""The `rtrain` command: parse arguments, call one keyword-only domain function, print.

Only this layer turns an `RtrainError` into `rtrain: error: <reason>` on stderr and an exit code.
Domain modules are imported inside each command, so `rtrain inspect` never pays for `launch`'s
imports (and nothing here imports torch). Output is plain text (rich_markup_mode=None): rich
would add ~100 ms to every start; `FastTyper` spares simple options typer's pydantic coercion.

To add a command: one `@app.command()` function that imports its domain module, calls it inside
`with reported():`, and prints the result.
"""

from __future__ import annotations

import contextlib
import enum
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typer

from rtrain import __version__
from rtrain.supervisor.commands.fast_typer import FastCommand, FastGroup, FastTyper
from rtrain.supervisor.core.errors import RtrainError
from rtrain.supervisor.proc import reaper


class Commands(FastGroup):
    order = ("launch", "status", "inspect", "prune", "report", "export", "check-resume")


class LaunchCommand(FastCommand):
    """`rtrain launch --help` in four panels: what most runs set, then the rest by topic."""

    panels: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("module", "resume", "resume_arg", "run_dir", "ckpt_dir", "config",
                         "sets", "quiet", "python", "metrics_file"), "Common"),
        **dict.fromkeys(("max_restarts", "grace", "stop_signal", "hang_timeout", "requeue",
                         "no_backoff", "fresh", "retry", "no_standby"), "Restarts"),
        **dict.fromkeys(("nproc_per_node", "nnodes", "rdzv_endpoint", "rdzv_backend"),
                        "Distributed"),
        **dict.fromkeys(("mirror", "keep_remote"), "Storage"),
    }

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # The tokens as typed: which ones followed `--` (the script's by the person's word)
        # is known only here, before click drops the `--`.
        ctx.meta[RAW_ARGS] = list(args)
        return super().parse_args(ctx, args)


RAW_ARGS = "rtrain.launch.raw_args"


app = FastTyper(
    cls=Commands,
    name="rtrain",
    help="Keep long PyTorch training runs alive: verified checkpoints, restarts, degradation.",
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class VerifyLevel(str, enum.Enum):
    # Mirrors checkpoint.verify.Level; kept here so that building the CLI imports no hashing code.
    quick = "quick"
    full = "full"


class Mode(str, enum.Enum):
    min = "min"
    max = "max"


@contextlib.contextmanager
def reported() -> Iterator[None]:
    """Turn a domain error into one line on stderr and rtrain's exit code; never a traceback."""
    try:
        yield
    except RtrainError as e:
        typer.echo(f"rtrain: error: {e}", err=True)
        raise typer.Exit(int(e.exit_code)) from None


def echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _signing_key() -> bytes | None:
    from rtrain.checkpoint.hashing import load_signing_key

    return load_signing_key()


def _ckpt_dir(target: Path | None) -> Path:
    if target is not None:
        return target
    from rtrain.supervisor.records.paths import default_ckpt_dir

    return default_ckpt_dir()


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"rtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    """rtrain: a supervisor that keeps long PyTorch training runs alive."""


MirrorTarget = Annotated[str | None, typer.Argument(
    metavar="DIR|URL", show_default=False,
    help="Checkpoint dir or one checkpoint-N dir (default: the run's when the current "
         "directory is a run dir, else from rtrain.toml, else ./checkpoints), or a mirror URL "
         "(s3://bucket/prefix, file:///path[/checkpoint-N]).")]


RunDirOption = Annotated[Path | None, typer.Option(
    "--run-dir", metavar="RUN_DIR", show_default=False,
    help="The same as the RUN_DIR argument, spelt as rtrain launch takes it.")]
CkptRunDirOption = Annotated[Path | None, typer.Option(
    "--run-dir", metavar="RUN_DIR", show_default=False,
    help="Read the checkpoints of the run in RUN_DIR (the --run-dir given to rtrain launch): "
         "its --ckpt-dir, else RUN_DIR/checkpoints. Instead of a DIR|URL argument.")]


def _one_run_dir(positional: Path | None, option: Path | None) -> Path | None:
    from rtrain.supervisor.core.errors import UsageError

    if positional is not None and option is not None and positional != option:
        raise UsageError(f"two run dirs given ({positional} and --run-dir {option}): pass one")
    return positional if positional is not None else option


def _target(target: str | None, run_dir: Path | None) -> str | None:
    """The inspect/prune target: DIR|URL as given, or the checkpoint dir of `--run-dir`."""
    if run_dir is None:
        return target
    from rtrain.supervisor.core.errors import UsageError
    from rtrain.supervisor.records.paths import is_run_dir, run_ckpt_dir

    if target is not None:
        raise UsageError(f"{target} and --run-dir {run_dir} both name what to read: pass one")
    if not is_run_dir(run_dir):
        raise UsageError(f"no rtrain run in {run_dir}: pass the --run-dir given to rtrain "
                         "launch")
    return str(run_ckpt_dir(run_dir))


def _url(target: str | None) -> str | None:
    """`target` when it names a mirror; the mirror code loads only then."""
    from rtrain.supervisor.mirror.url import is_url

    return target if target is not None and is_url(target) else None


@app.command()
def inspect(
    target: MirrorTarget = None,
    verify: Annotated[VerifyLevel | None, typer.Option(
        "--verify", case_sensitive=False, show_default=False,
        help="quick (sizes) or full (content hashes). Default quick; when given, a failure "
             "exits 1.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    run_dir: CkptRunDirOption = None,
) -> None:
    """List checkpoints and which one resume would pick, or show one checkpoint in detail."""
    with reported():
        target = _target(target, run_dir)
        from rtrain.checkpoint.verify import Level
        from rtrain.supervisor.commands import inspect_render as render
        from rtrain.supervisor.commands import inspecting as insp

        level = Level((verify or VerifyLevel.quick).value)
        key = _signing_key()
        result: Any
        if url := _url(target):
            from rtrain.supervisor.mirror import url_commands

            one = url_commands.is_one_checkpoint(url)
            result = (url_commands.inspect_mirror_one if one else url_commands.inspect_mirror)(
                url, verify=level, key=key)
        else:
            root = _ckpt_dir(None if target is None else Path(target))
            one = insp.is_checkpoint_dir(root)
            result = (insp.inspect_one if one else insp.inspect_dir)(root, verify=level, key=key)
        if as_json:
            echo_json(render.one_json(result) if one else render.dir_json(result))
        else:
            typer.echo(render.render_one(result) if one else render.render_dir(result))
        if verify is not None:
            result.raise_if_failed()


@app.command()
def prune(
    target: MirrorTarget = None,
    keep: Annotated[int, typer.Option("--keep", metavar="N", show_default=False,
                                      help="Keep the newest N verified checkpoints.")] = ...,
    keep_best: Annotated[int, typer.Option("--keep-best", metavar="K",
                                           help="Also keep the best K by --metric.")] = 0,
    metric: Annotated[str | None, typer.Option("--metric", metavar="NAME",
                                               help="Metric that ranks --keep-best.")] = None,
    mode: Annotated[Mode | None, typer.Option(
        "--mode", case_sensitive=False, show_default=False,
        help="min (e.g. loss, the default) or max (e.g. accuracy).")] = None,
    milestone_every: Annotated[int, typer.Option(
        "--milestone-every", metavar="M", help="Also keep every step that is a multiple of M.")
    ] = 0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show, remove nothing.")] = False,
    verify: Annotated[VerifyLevel, typer.Option(
        "--verify", case_sensitive=False,
        help="Level that decides which checkpoints count as good.")] = VerifyLevel.quick,
    run_dir: CkptRunDirOption = None,
) -> None:
    """Remove checkpoints the retention policy does not keep, and abandoned temp dirs."""
    with reported():
        target = _target(target, run_dir)
        from rtrain.checkpoint.verify import Level
        from rtrain.supervisor.retention import prune_command

        policy = prune_command.policy_from_options(
            keep=keep, keep_best=keep_best, metric=metric, mode=mode and mode.value,
            milestone_every=milestone_every)
        if url := _url(target):
            from rtrain.supervisor.mirror import url_commands

            remote = url_commands.prune_mirror(url, policy=policy, verify=Level(verify.value),
                                               key=_signing_key(), dry_run=dry_run)
            typer.echo(url_commands.render_mirror_prune(url, remote, dry_run=dry_run))
            return
        report = prune_command.prune_dir(_ckpt_dir(None if target is None else Path(target)),
                                         policy=policy, verify=Level(verify.value),
                                         key=_signing_key(), dry_run=dry_run)
        typer.echo(prune_command.render_prune(report, dry_run=dry_run))


@app.command(cls=LaunchCommand,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    script: Annotated[str | None, typer.Argument(
        metavar="SCRIPT [ARGS]...", show_default=False,
        help="The training script (train.py) or a command (torchrun ...), then its arguments; "
             "`{knob}` in them gets this attempt's value. Put arguments that look like rtrain "
             "options after `--`.")] = None,
    module: Annotated[str | None, typer.Option("-m", "--module", metavar="MODULE",
                                               help="Run a module: python -m MODULE.")] = None,
    resume: Annotated[str | None, typer.Option(
        "--resume", metavar="auto|never|PATH",
        help="auto: newest verified checkpoint; never: start fresh; PATH: this one (default "
             "auto).")
    ] = None,
    resume_arg: Annotated[list[str] | None, typer.Option(
        "--resume-arg", metavar="TEMPLATE",
        help="Arguments appended (shell-split) only when resuming, e.g. "
             "\"--resume_from_checkpoint {checkpoint}\" (repeatable).")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", metavar="DIR",
                                                 help="Run directory (default rtrain-run).")
                       ] = None,
    ckpt_dir: Annotated[Path | None, typer.Option(
        "--ckpt-dir", metavar="DIR", help="Checkpoint dir (default RUN_DIR/checkpoints).")
    ] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", metavar="FILE", help="Config file (default rtrain.toml or [tool.rtrain] in "
                                         "pyproject.toml).")] = None,
    max_restarts: Annotated[int | None, typer.Option(
        "--max-restarts", metavar="N",
        help="Relaunches allowed after failures of any kind without progress in between (a "
             "newer checkpoint forgives earlier failures); per-kind budgets not set in the "
             "config follow it. Default 20. Apart from it, a run whose last 3 attempts ended "
             "without a newer checkpoint stops (a crash loop).")] = None,
    grace: Annotated[float | None, typer.Option(
        "--grace", metavar="SECONDS",
        help="From the stop signal to SIGKILL: time to save and exit (default 30).")] = None,
    stop_signal: Annotated[str | None, typer.Option(
        "--stop-signal", metavar="SIG",
        help="Signal that asks the child to save and exit 75 (default SIGTERM; or SIGINT, "
             "SIGHUP, SIGQUIT, SIGUSR1, SIGXCPU, SIGPWR).")] = None,
    hang_timeout: Annotated[float | None, typer.Option(
        "--hang-timeout", metavar="SECONDS",
        help="Hung after this long without output or CPU progress (plain scripts), or "
             "without a heartbeat before the step timeout is learned (default 1800).")] = None,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KNOB=VALUE", help="Set a knob's starting value (repeatable).")] = None,
    requeue: Annotated[bool | None, typer.Option(
        "--requeue/--no-requeue", show_default=False,
        help="On preemption under Slurm, requeue the job, else exit 75 (default no).")
    ] = None,
    no_backoff: Annotated[bool, typer.Option("--no-backoff",
                                             help="Relaunch at once after a failure.")] = False,
    fresh: Annotated[bool, typer.Option(
        "--fresh", help="Run again even if the run finished; ignore its history.")] = False,
    retry: Annotated[bool, typer.Option(
        "--retry", help="Relaunch a run that gave up (else exit 5 at once): fresh budgets, "
                        "quarantined checkpoints usable again.")] = False,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="Do not echo the child's output (it is still logged).")] = False,
    python: Annotated[str | None, typer.Option(
        "--python", metavar="EXE", help="Interpreter for SCRIPT (default: rtrain's).")] = None,
    metrics_file: Annotated[Path | None, typer.Option(
        "--metrics-file", metavar="PATH",
        help="Write Prometheus metrics here (textfile collector), replaced atomically "
             "(default none).")] = None,
    mirror: Annotated[str | None, typer.Option(
        "--mirror", metavar="URL",
        help="Copy every checkpoint to this fsspec URL (s3://bucket/prefix, a path on a shared "
             "filesystem) and resume from it on a fresh machine (default none).")] = None,
    keep_remote: Annotated[int | None, typer.Option(
        "--keep-remote", metavar="N",
        help="The mirror keeps the newest N checkpoints, 0 all (default 3).")] = None,
    no_standby: Annotated[bool, typer.Option(
        "--no-standby", help="Start every attempt in a new interpreter: keep no warm "
                             "standby interpreter. Without it one is kept (under "
                             "--nproc-per-node it starts every rank of the node, with "
                             "--nnodes N too).")] = False,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", metavar="N",
        help="Run SCRIPT under torchrun with N ranks on this node (rtrain owns restarts).")
    ] = None,
    nnodes: Annotated[str | None, typer.Option(
        "--nnodes", metavar="N|MIN:MAX", help="torchrun: number of nodes.")] = None,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", metavar="HOST:PORT",
        help="torchrun: rendezvous endpoint (several nodes).")] = None,
    rdzv_backend: Annotated[str | None, typer.Option(
        "--rdzv-backend", metavar="NAME", help="torchrun: rendezvous backend (default c10d).")
    ] = None,
) -> None:
    """Run a training script under supervision: restart on failure, degrade on OOM."""
    with reported():
        from rtrain.supervisor.config import load_config
        from rtrain.supervisor.launch.loop import LaunchSpec, child_command
        from rtrain.supervisor.launch.loop import launch as run_launch

        _check_option_typos(ctx, None if module else script,
                            [script] if module and script is not None else [])
        cwd = Path.cwd()
        # Option -> config key; each option's help states the key's default (config.py owns
        # it; tests/test_config_schema.py holds the two together).
        overrides = {"resume": resume, "run_dir": run_dir, "ckpt_dir": ckpt_dir,
                     "restart.max_restarts": max_restarts, "grace_s": grace,
                     "stop_signal": stop_signal, "hang.timeout_s": hang_timeout,
                     "requeue": requeue,
                     "settings": _parse_sets(sets or []) or None,
                     "backoff.enabled": False if no_backoff else None,
                     "metrics_file": metrics_file, "mirror": mirror,
                     "keep_remote": keep_remote,
                     "standby": False if no_standby else None}
        cfg = load_config(overrides, config, cwd)
        if retry and fresh:
            from rtrain.supervisor.core.errors import UsageError

            raise UsageError("--retry continues the run, --fresh starts it over: pass one")
        if nproc_per_node is None and (nnodes or rdzv_endpoint or rdzv_backend):
            from rtrain.supervisor.core.errors import UsageError

            raise UsageError("--nnodes/--rdzv-* need --nproc-per-node N")
        if nproc_per_node is not None:
            from rtrain.supervisor.proc.torchrun import TorchrunSpec, torchrun_command

            spec = TorchrunSpec(nproc_per_node=nproc_per_node, nnodes=nnodes,
                                rdzv_endpoint=rdzv_endpoint, rdzv_backend=rdzv_backend)
            command = torchrun_command(spec, script, module, list(ctx.args), python)
        else:
            command = child_command(script, module, list(ctx.args), python)
        raise typer.Exit(run_launch(LaunchSpec(command=command, config=cfg, fresh=fresh,
                                               retry=retry, echo=not quiet, cwd=cwd,
                                               resume_args=_split_resume_args(resume_arg))))


def _check_option_typos(ctx: typer.Context, script: str | None, first: list[str]) -> None:
    """An unknown option where the script should be is a usage error; a script argument one
    edit away from an rtrain option gets a warning (commands/option_typos.py). `first`: the
    module's first argument, which click put in the SCRIPT slot (`-m pkg --lr 1`)."""
    from rtrain.supervisor.commands import option_typos
    from rtrain.supervisor.core.errors import UsageError

    options = [o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts)]
    raw: list[str] = ctx.meta.get(RAW_ARGS, [])
    after = raw[raw.index("--") + 1:] if "--" in raw else []
    from_after = bool(after) and script == after[0]  # `rtrain launch -- torchrun ...`
    if script is not None and script.startswith("-") and not from_after:
        raise UsageError(option_typos.unknown_before_script(script, options))
    mine = len(after) - (1 if from_after else 0)  # the leftovers that followed `--`
    args = list(ctx.args)
    for line in option_typos.misspelt_after_script([*first, *args[:len(args) - mine]],
                                                   options):
        typer.echo(f"rtrain: warning: {line}", err=True)


def _split_resume_args(items: list[str] | None) -> tuple[str, ...]:
    import shlex

    from rtrain.supervisor.core.errors import UsageError

    out: list[str] = []
    for item in items or []:
        try:
            out += shlex.split(item)
        except ValueError as e:
            raise UsageError(f"--resume-arg {item!r}: {e}; quote it as for a shell") from None
    return tuple(out)


def _parse_sets(items: list[str]) -> dict[str, Any]:
    from rtrain.supervisor.core.errors import UsageError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--set {item!r}: write it as KNOB=VALUE, e.g. --set batch_size=32")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw  # a bare word is a string
    return out


class StopKind(str, enum.Enum):
    kill = "kill"
    signal = "signal"
    both = "both"


@app.command("check-resume",
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def check_resume(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(
        metavar="SCRIPT [ARGS]...", show_default=False,
        help="A training script that uses rtrain.Checkpointer and ends by itself, then its "
             "arguments (`{ckpt_dir}` and `{knob}` templates as in launch).")],
    at: Annotated[int | None, typer.Option(
        "--at", metavar="STEP", show_default=False,
        help="Stop at this step (default: half of the uninterrupted run's steps).")] = None,
    stop: Annotated[StopKind, typer.Option(
        "--stop", case_sensitive=False,
        help="kill (a save, then SIGKILL), signal (SIGTERM: save, exit 75) or both.")
    ] = StopKind.both,
    sets: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KNOB=VALUE", help="Set a knob for every run (repeatable).")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", metavar="FILE", help="Config file whose [settings] the runs get (default "
                                         "rtrain.toml or [tool.rtrain] in pyproject.toml).")
    ] = None,
    python: Annotated[str | None, typer.Option(
        "--python", metavar="EXE", help="Interpreter for SCRIPT (default: rtrain's).")] = None,
    work_dir: Annotated[Path | None, typer.Option(
        "--work-dir", metavar="DIR", show_default=False,
        help="Where the runs keep their checkpoints and logs, kept afterwards (default: a "
             "temporary dir, removed when the script resumes exactly).")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", metavar="SECONDS", help="Longest one run may take.")] = 1800.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Check that a script resumes exactly: run it straight, and stopped and resumed, compare."""
    with reported():
        import sys

        from rtrain.supervisor.checkresume import check as cr
        from rtrain.supervisor.config import load_config

        cwd = Path.cwd()
        settings = load_config({"settings": _parse_sets(sets or []) or None}, config,
                               cwd).settings
        opts = cr.Options(script=script, args=tuple(ctx.args), at=at,
                          stops=("kill", "signal") if stop is StopKind.both else (stop.value,),
                          settings=settings, python=python or sys.executable, cwd=cwd,
                          work_dir=work_dir, timeout_s=timeout, key=_signing_key())
        report = cr.check_resume(opts, say=(lambda _: None) if as_json else
                                 (lambda line: typer.echo(line, err=True)))
        echo_json(cr.report_json(report)) if as_json else typer.echo(cr.render_report(report))
        raise typer.Exit(0 if report.exact else 1)


@app.command()
def status(
    run_dir: Annotated[Path | None, typer.Argument(
        metavar="RUN_DIR", show_default=False,
        help="The run's --run-dir (default: the current directory when it is a run dir, else "
             "run_dir from rtrain.toml, else ./rtrain-run).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    run_dir_option: RunDirOption = None,
) -> None:
    """Summarise a run from its files: attempts, failures, rung, checkpoint, progress."""
    with reported():
        from rtrain.supervisor.commands import status as st
        from rtrain.supervisor.records.paths import default_run_dir

        run_dir = _one_run_dir(run_dir, run_dir_option)
        summary = st.summarize(run_dir or default_run_dir(), key=_signing_key())
        echo_json(st.to_json(summary)) if as_json else typer.echo(st.render_text(summary))


@app.command()
def report(
    run_dir: Annotated[Path | None, typer.Argument(
        metavar="RUN_DIR", show_default=False,
        help="The run's --run-dir (default: the current directory when it is a run dir, else "
             "run_dir from rtrain.toml, else ./rtrain-run).")
    ] = None,
    output: Annotated[Path | None, typer.Option(
        "-o", "--output", metavar="FILE", show_default=False,
        help="Where to write the HTML (default RUN_DIR/report.html).")] = None,
    run_dir_option: RunDirOption = None,
) -> None:
    """Write a self-contained HTML report: curves, failures, degradations, checkpoints."""
    with reported():
        from rtrain.supervisor.commands.report_html import write_report
        from rtrain.supervisor.records.paths import default_run_dir

        root = _one_run_dir(run_dir, run_dir_option) or default_run_dir()
        written = write_report(root, output or root / "report.html", key=_signing_key())
        typer.echo(f"wrote {written}")


class ExportFormat(str, enum.Enum):
    safetensors = "safetensors"
    torch = "torch"


@app.command()
def export(
    checkpoint: Annotated[Path, typer.Argument(
        metavar="CHECKPOINT", show_default=False,
        help="One checkpoint (rtrain's checkpoint-N dir, a Trainer's checkpoint-N dir, a "
             "Lightning .ckpt, a torch.save file), or a dir of them: the newest that "
             "verifies.")],
    out: Annotated[Path, typer.Argument(
        metavar="OUT", show_default=False,
        help="The file to write: .safetensors, or .pt/.pth/.bin for a torch.save state dict.")],
    fmt: Annotated[ExportFormat | None, typer.Option(
        "--format", case_sensitive=False, show_default=False,
        help="safetensors or torch (default: from OUT's suffix).")] = None,
    optimizer: Annotated[bool, typer.Option(
        "--optimizer", help="Also export the optimizer state.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")] = False,
) -> None:
    """Write a checkpoint's model weights as safetensors or a torch.save state dict."""
    with reported():
        from rtrain.supervisor.commands import exporting

        done = exporting.export_checkpoint(checkpoint=checkpoint, out=out,
                                           fmt=fmt and fmt.value, optimizer=optimizer,
                                           force=force, key=_signing_key())
        typer.echo(exporting.render(done))


def main() -> None:
    reaper.enable()  # rtrain is its own process: orphans adopted below it are its to reap
    app(prog_name="rtrain")


if __name__ == "__main__":  # pragma: no cover
    main()
