"""The ``kimi-convert`` command line.

A user error (bad input, refused output folder, a rule that cannot be satisfied) prints one line,
``kimi-convert: error: ...``, and exits 2; Ctrl-C exits 130. No traceback reaches the user for either.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import click

from . import __version__, devices, paths
from .errors import ConvertError
from .plan import DEFAULT_MAX_SHARD, LAYOUTS, Options, Plan

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4, "K": 1000, "M": 1000**2, "G": 1000**3}


def parse_size(text: str) -> int:
    m = _SIZE.match(text)
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise click.BadParameter(f"{text!r} is not a size like 5GB, 500MB or 2GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise click.BadParameter("must be positive")
    return size


#: OS errors that are the user's environment, not a bug: one line, exit 2.
USER_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT,
               errno.ENOTDIR, errno.EISDIR, errno.EEXIST)


def _no_hint() -> str:
    return ""


#: Set by a command whose interruption leaves something to resume: says what and how.
_interrupt_hint: Callable[[], str] = _no_hint


class Cli(click.Group):
    def invoke(self, ctx: click.Context):
        previous = signal.signal(signal.SIGTERM, _terminate)
        try:
            return super().invoke(ctx)
        except ConvertError as e:
            _fail(str(e))
        except KeyboardInterrupt:
            click.echo(f"kimi-convert: interrupted{_interrupt_hint()}", err=True)
            sys.exit(130)
        except OSError as e:
            if e.errno in USER_ERRNOS:
                _fail(f"{e.filename or ''}: {e.strerror}".lstrip(": "))
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame) -> None:
    """SIGTERM stops like Ctrl-C: cleanly, with a resumable state."""
    raise KeyboardInterrupt


def _fail(msg: str) -> None:
    click.echo(f"kimi-convert: error: {msg}", err=True)
    sys.exit(2)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kimi-convert")
def cli() -> None:
    """Convert a sharded safetensors MoE checkpoint (Kimi K3, Kimi Linear) into pre-packed NVFP4."""


def _checked(check, *args):
    """A click callback running one of ``paths``' checks (or another), so a bad value is refused in
    the tool's one-line form before any work, never in click's own wording."""
    def callback(ctx: click.Context, param: click.Parameter, value):
        if value is None:
            return value
        for v in value if isinstance(value, tuple) else (value,):
            check(v, *args)
        return value
    return callback


def plan_options(f):
    opts = [
        click.option("--exclude", "exclude", multiple=True, metavar="GLOB",
                     help="Keep source modules matching GLOB in high precision (repeatable)."),
        click.option("--exclude-from", "exclude_from", multiple=True, metavar="FILE",
                     callback=_checked(paths.file, "an exclude file"),
                     help="Patterns from FILE: one per line, a JSON list, or an hf_quant_config.json."),
        click.option("--no-default-excludes", is_flag=True, help="Do not apply the mapping's default recipe."),
        click.option("--keep-partial", is_flag=True,
                     help="Keep a fused module (or MoE layer) whole in high precision when only some of "
                          "its shards are excluded."),
        click.option("--fuse", multiple=True, metavar="GROUP", help="Enable an opt-in fused group of the mapping."),
        click.option("--no-fuse", multiple=True, metavar="GROUP", help="Do not build this fused group."),
        click.option("--max-shard-size", default=str(DEFAULT_MAX_SHARD), show_default="5GB",
                     help="Largest output shard, e.g. 5GB, 500MB."),
        click.option("--mapping", metavar="NAME|FILE", help="Architecture table (default: chosen from config.json)."),
        click.option("--recipe", metavar="NAME|FILE",
                     help="What is quantized how: nvidia-k3 (the default for Kimi K3), nvfp4-w4a16 (the default "
                          "otherwise), or a recipe file."),
        click.option("--layout", type=click.Choice(LAYOUTS), default="source", show_default=True,
                     help="source: the input's tensor names and files (loads in vLLM and SGLang); sglang: "
                          "SGLang's fused names on disk (SGLang only)."),
        click.option("--input-scale", type=float, metavar="X",
                     help="Replace the recipe's constant activation input_scale (nvidia-k3: 1.0)."),
        click.option("--strict", is_flag=True,
                     help="Warnings are errors: a mapping for another architecture, a mapping entry or an "
                          "exclusion pattern that matches no module of the input."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _options(kw: dict) -> Options:
    return Options(
        exclude=tuple(kw["exclude"]),
        exclude_from=tuple(kw["exclude_from"]),
        default_excludes=not kw["no_default_excludes"],
        keep_partial=kw["keep_partial"],
        max_shard_size=parse_size(kw["max_shard_size"]),
        fuse=tuple(kw["fuse"]),
        no_fuse=tuple(kw["no_fuse"]),
        recipe=kw["recipe"],
        layout=kw["layout"],
        input_scale=_input_scale(kw["input_scale"]),
    )


def _input_scale(x: float | None) -> float | None:
    if x is not None and not (0 < x < float("inf")):
        raise click.BadParameter(f"{x} is not a positive finite number", param_hint="--input-scale")
    return x


@cli.command()
@click.argument("preset")
@click.argument("output", callback=_checked(paths.output_folder))
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic values.")
@click.option("--layers", type=int, help="Override the preset's layer count.")
@click.option("--experts", type=int, help="Override the preset's experts per MoE layer.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint in OUTPUT.")
def synth(preset: str, output: str, seed: int, layers: int | None, experts: int | None, overwrite: bool) -> None:
    """Write a synthetic checkpoint shaped like a real release.

    Presets: tiny-k3, tiny-kimi-linear (examples and tests), bench-k3, bench-kimi-linear (a few GB).
    """
    from .synth import PRESETS, write_synth

    out = write_synth(preset, output, seed=seed, layers=layers, experts=experts, overwrite=overwrite)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    click.echo(f"wrote {paths.shown(out)}/: {PRESETS[preset].description}; {size / 1e6:.1f} MB on disk")


@cli.command(name="inspect")
@click.argument("path", callback=_checked(paths.existing))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def inspect_cmd(path: str, as_json: bool) -> None:
    """Architecture, layer kinds and MoE parameters (E, top-k, sizes) of a checkpoint or config.json."""
    from .modelinfo import inspect_path, render

    info = inspect_path(path)
    click.echo(json.dumps(info.to_dict(), indent=2) if as_json else render(info))


@cli.command()
@click.argument("input_dir", metavar="INPUT", callback=_checked(paths.folder))
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(input_dir: str, as_json: bool, **kw) -> None:
    """Print what pack would do, without reading tensor data."""
    from .manifest import plan_dict
    from .pack import load_plan

    _, p = load_plan(input_dir, _options(kw), kw["mapping"], kw["strict"])
    if as_json:
        from .manifest import side_dict  # side files: outside plan_dict, whose hash covers the weights only

        click.echo(json.dumps({**plan_dict(p), **side_dict(p)}, indent=2))
    else:
        click.echo(render_plan(p, input_dir))
    for w in p.warnings:
        click.echo(f"kimi-convert: warning: {w}", err=True)


@cli.command()
@click.argument("input_dir", metavar="INPUT", callback=_checked(paths.folder))
@click.argument("output_dir", metavar="OUTPUT", callback=_checked(paths.output_folder))
@plan_options
@click.option("--device", default="auto", show_default=True, callback=_checked(devices.valid),
              help="auto (the GPU when torch sees one), cpu (the C kernel), cuda[:N] (the Triton kernel); "
                   "for tests: reference (the torch code), triton (the Triton kernel; on the CPU under "
                   "TRITON_INTERPRET=1).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Worker processes that split the output shards, one device each (same bytes for any number). "
                   "Default: one per visible GPU for --device auto/cuda, else 1.")
@click.option("--streams", type=click.IntRange(min=1), default=None,
              help="Pipelines per worker, each on its own consecutive shards (a file's sha256 runs on one core). "
                   "Default: one per 4 CPUs of a worker, at most 4.")
@click.option("--stats", "stats_path", callback=_checked(paths.output_file),
              help="Write how the run went (workers, streams, start-up and conversion seconds, hashing) as JSON.")
@click.option("--overwrite", is_flag=True, help="Replace a previous output in OUTPUT.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted pack in OUTPUT: finished shards are verified and kept.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Spread the shards over a Ray cluster whose nodes share INPUT and OUTPUT (same paths): "
                   "ADDRESS is auto, HOST:PORT or ray://HOST:PORT; none: RAY_ADDRESS, else the cluster started "
                   "on this machine, else a new local one. Needs: pip install 'kimi-convert[ray]'.")
def pack(input_dir: str, output_dir: str, device: str, workers: int | None, streams: int | None,
         stats_path: str | None, overwrite: bool, resume: bool, quiet: bool, ray_address: str | None, **kw) -> None:
    """Fuse, quantize to NVFP4 and write INPUT as a pre-packed checkpoint in OUTPUT."""
    from .journal import Journal
    from .pack import pack as run

    if overwrite and resume:
        raise click.UsageError("--overwrite and --resume exclude each other")
    if ray_address is not None and (workers or streams):  # --ray: Ray's tasks replace workers and streams
        raise click.UsageError(f"--{'workers' if workers else 'streams'} does not apply with --ray "
                               "(a task per run of shards, as many as the cluster's GPUs or CPUs run at once)")
    args = [a for a in sys.argv[1:] if a not in ("--overwrite", "--resume")]
    command = shlex.join(["kimi-convert", *args, "--resume"]) if args[:1] == ["pack"] else None

    def interrupted() -> str:
        j = Journal.load(Path(output_dir)) if Path(output_dir).is_dir() else None
        return f"; {len(j.shards)} shard(s) finished; resume with: {j.command}" if j else ""
    global _interrupt_hint
    _interrupt_hint = interrupted
    res = run(input_dir, output_dir, _options(kw), mapping=kw["mapping"], device=device, workers=workers,
              streams=streams, overwrite=overwrite, resume=resume, progress=not quiet, command=command,
              strict=kw["strict"], ray=ray_address)
    for w in res.plan.warnings:
        click.echo(f"kimi-convert: warning: {w}", err=True)
    if res.already_complete:
        click.echo(f"{paths.shown(output_dir)}/ is already complete and matches its manifest; nothing to do")
        return
    if stats_path and res.stats:
        Path(stats_path).write_text(json.dumps(dataclasses.asdict(res.stats), indent=2) + "\n")
    if res.plan.skipped_files:  # side files (convert/sidefiles.py): what was not copied, and why
        from .sidefiles import summary

        click.echo(summary(res.plan.skipped_files))
    items = res.plan.items
    cast = f"; MXFP4 cast: {res.cast_lossless}/{res.cast_blocks} blocks lossless" if res.cast_blocks else ""
    click.echo(
        f"wrote {paths.shown(output_dir)}/ (recipe {res.plan.recipe.name}): {len(res.plan.shards)} shards, "
        f"{_mb(res.bytes_out)} from {_mb(res.bytes_in)}; "
        f"{sum(i.kind == 'nvfp4' for i in items)} NVFP4 modules, {sum(i.kind == 'fp8-block' for i in items)} "
        f"block FP8, {sum(i.kind == 'keep' for i in items)} kept, "
        f"{sum(i.kind == 'copy' for i in items)} tensors copied{cast}; manifest.json"
        + (f" ({res.resumed_shards} finished shard(s) verified and kept)" if res.resumed_shards else "")
    )


@cli.command(name="verify-manifest")
@click.argument("output_dir", metavar="OUTPUT", callback=_checked(paths.folder, "a kimi-convert output folder"))
@click.option("--input", "input_dir", callback=_checked(paths.folder),
              help="Also prove OUTPUT was derived from INPUT: hashes, re-plan, pass-through and re-quantization.")
@click.option("--full", is_flag=True, help="With --input: re-quantize every NVFP4 tensor, not a sample.")
@click.option("--device", default="cpu", show_default=True, callback=_checked(devices.valid),
              help="Where --input re-quantizes: cpu, cuda[:N], auto (or reference, triton).")
@click.option("--remote", metavar="REPO_ID", help="Also check a Hub repo's files against the manifest (no download).")
@click.option("--revision", help="With --remote: the branch, tag or refs/pr/N to check.")
@click.option("--token", help="With --remote: Hub token (default: HF_TOKEN or the cached login).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["vllm", "sglang"]),
              help="Also load OUTPUT with this engine's own loading code, on the CPU (repeatable); "
                   "fails on an engine error, an unfilled parameter, a skipped tensor or a bad cast.")
@click.option("--engine-python", callback=_checked(paths.file, "a python executable"),
              help="With one --engine: the python that has the engine installed (default: "
                   "KIMI_CONVERT_VLLM_PYTHON / KIMI_CONVERT_SGLANG_PYTHON, else scripts/engine-envs.sh's environment).")
@click.option("--engine-any-version", is_flag=True,
              help="With --engine: run an engine version other than the tested one.")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable report (with --engine: every parameter's details).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def verify_manifest(output_dir: str, input_dir: str | None, full: bool, device: str, remote: str | None,
                    revision: str | None, token: str | None, engines: tuple[str, ...], engine_python: str | None,
                    engine_any_version: bool, as_json: bool, quiet: bool) -> None:
    """Check OUTPUT against its manifest.json (exit 0 only if everything holds).

    With --engine and no manifest.json in OUTPUT (any checkpoint), only the engine checks run.
    """
    from .progress import Progress
    from .verify import Report, verify

    engines = tuple(dict.fromkeys(engines))
    if engine_python and len(engines) != 1:
        raise click.UsageError("--engine-python needs exactly one --engine")
    if engine_any_version and not engines:
        raise click.UsageError("--engine-any-version needs --engine")
    manifest = Path(output_dir, "manifest.json").exists() or not engines
    hub_api = None
    if remote and manifest:  # the repo id, the Hub and the repo checked before any hashing
        from .hub import connect

        hub_api = connect(remote, token, write=False, revision=revision, say=lambda m: click.echo(m, err=True))
    if manifest:
        with Progress("verify", not (quiet or as_json)) as bar:
            rep = verify(output_dir, input_dir, full=full, device=device, progress=bar.update, total=bar.grow)
    else:
        if input_dir or remote:
            raise ConvertError(f"{output_dir}: no manifest.json, so --input and --remote have nothing to check")
        rep = Report()
    if remote:
        from .hub import verify_remote

        rc = verify_remote(output_dir, remote, revision, token, say=lambda m: click.echo(m, err=True), api=hub_api)
        rep.check(f"Hub repo {remote}: files, sizes and sha256", rc.problems, f"{rc.checked} files")
    engine_reports = []
    if engines:
        from .enginecheck import check, resolve

        for engine in engines:  # every engine's python checked before any engine runs
            resolve(engine, engine_python, engine_any_version)
        for engine in engines:
            if not (quiet or as_json):
                click.echo(f"loading {output_dir} with {engine} (its own loader, on the CPU)...", err=True)
            er = check(output_dir, engine, python=engine_python, any_version=engine_any_version)
            engine_reports.append(er)
            rep.check(f"{engine} {er.version}: its own loader ({er.seconds:.0f} s)", [] if er.ok else [er.verdict],
                      er.verdict if er.ok else "")
    if as_json:
        d = rep.to_dict()
        if not manifest:
            d["manifest"] = "absent: manifest checks skipped"
        if engine_reports:
            d["engines"] = [er.to_dict() for er in engine_reports]
        click.echo(json.dumps(d, indent=2))
    else:
        if not manifest:
            click.echo(f"{output_dir}: no manifest.json: manifest checks skipped, engine checks only")
        click.echo(render_report(rep, output_dir))
        for er in engine_reports:  # the engines' one-line verdicts last, where a failure is seen
            if not er.ok:
                click.echo(er.verdict, err=True)
    sys.exit(0 if rep.ok else 1)


@cli.command()
@click.argument("output_dir", metavar="OUTPUT", callback=_checked(paths.folder, "a kimi-convert output folder"))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo as private.")
@click.option("--revision", help="Branch to commit to (default: main).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing to the branch.")
@click.option("--token", help="Hub token (default: HF_TOKEN or the cached login). Never printed or stored.")
@click.option("--base-model", help="base_model for the model card (default: config.json's _name_or_path).")
def upload(output_dir: str, repo_id: str, private: bool, revision: str | None, create_pr: bool,
           token: str | None, base_model: str | None) -> None:
    """Verify OUTPUT, upload it to the Hub repo REPO_ID, and check what arrived against the manifest.

    REPO_ID's form, the token and the Hub's answer are checked first, in seconds, before verifying.
    """
    from .hub import upload as run

    if create_pr and revision:
        raise click.UsageError("--create-pr opens a PR against the default branch; drop --revision")
    res = run(output_dir, repo_id, private=private, revision=revision, create_pr=create_pr, token=token,
              base_model=base_model, say=lambda m: click.echo(m, err=True))
    if res.card_written:
        click.echo(f"wrote {paths.shown(output_dir)}/README.md (model card)")
    click.echo(f"committed: {res.pr_url or res.commit_url}")
    if res.remote.problems:
        for p in res.remote.problems:
            click.echo(f"  - {p}", err=True)
        raise ConvertError(f"{repo_id}: {len(res.remote.problems)} file(s) on the Hub do not match the manifest")
    click.echo(f"{repo_id}: all {res.remote.checked} files present, sizes and sha256 match the manifest")


def render_report(rep, output_dir: str) -> str:
    lines = [f"{'ok  ' if ok else 'FAIL'}  {name}" + (f" ({detail})" if detail else "")
             for name, ok, detail in rep.checks]
    shown = rep.problems[:40]
    lines += [f"  - {p}" for p in shown]
    if len(rep.problems) > len(shown):
        lines.append(f"  ... and {len(rep.problems) - len(shown)} more (--json lists all)")
    lines.append(f"{output_dir}: verified" if rep.ok else f"{output_dir}: {len(rep.problems)} problem(s)")
    return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _shape(dtype: str, shape) -> str:
    return f"{dtype}[{','.join(map(str, shape))}]"


def render_plan(p: Plan, input_dir: str) -> str:
    shard_of = p.shard_of()
    lines = [f"plan for {input_dir} (mapping {p.mapping.name}, {p.mapping.path}, sha256 {p.mapping.sha256[:12]})",
             f"recipe {p.recipe.name} ({p.recipe.path}): {p.recipe.description}",
             f"layout {p.options.layout}; quantization_config: {p.recipe.quant_method} / {p.recipe.quant_algo}",
             *(f"note: {n}" for n in p.notes), ""]
    for u in p.units:
        for it in u.items:
            srcs = ", ".join(_shape(s.dtype, s.shape) for s in it.sources)
            out = " + ".join(_shape(t.dtype, t.shape) for t in it.outputs)
            lines.append(f"{it.kind:9} {it.name}  {out}  -> {shard_of[it.outputs[0].name]}")
            if it.kind != "copy":
                extra = f"; shared scale {u.shared_scale}" if u.shared_scale else ""
                lines.append(f"        why: {it.rule}{extra}")
            if it.op != "none" or it.sources[0].name != it.outputs[0].name or it.sources[0].encoding != "dense":
                lines.append(f"        from {it.op}({srcs})" if it.op != "none" else f"        from {srcs}")
                for s, (a, b) in zip(it.sources, it.row_ranges(), strict=True):
                    extra = "".join(f" + {x.name} ({x.file})" for x in s.parts[1:])
                    lines.append(f"          rows {a}:{b} <- {s.name} [{s.encoding}] ({s.file}){extra}")
    if p.engine_groups:
        lines += ["", "engine packed modules (stored apart; quantized members share one global scale):"]
        for g in p.engine_groups:
            rows = ", ".join(f"{mod.rsplit('.', 1)[-1]} {a}:{b}" for mod, (a, b) in zip(g.members, g.rows, strict=True))
            lines.append(f"  {g.name} [{', '.join(g.engines)}]: {rows}")
    t = {k: sum(i.kind == k for i in p.items) for k in ("nvfp4", "fp8-block", "keep", "copy")}
    lines += [
        "",
        f"totals: {t['nvfp4']} NVFP4 modules, {t['fp8-block']} block FP8 modules, {t['keep']} kept linear modules, "
        f"{t['copy']} tensors copied",
        f"bytes in {p.bytes_in} ({_mb(p.bytes_in)}), bytes out {p.bytes_out} ({_mb(p.bytes_out)}) "
        f"in {len(p.shards)} shard(s)",
        f"exclude list: {len(p.exclude_modules)} names (hf_quant_config.json exclude_modules, config.json ignore)",
    ]
    from .sidefiles import render  # side files (convert/sidefiles.py)

    return "\n".join([*lines, *render(p.side_files, p.side_folders, p.skipped_files)])


def main() -> None:
    cli(prog_name="kimi-convert")


if __name__ == "__main__":
    main()
