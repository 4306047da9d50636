"""The ``kimi-convert`` command line.

A user error (bad input, a bad option value, refused output folder, a rule that cannot be satisfied) prints one line,
``kimi-convert: error: ...``, and exits 2; Ctrl-C exits 130. No traceback reaches the user for either.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import gc
import json
import os
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import click

from . import __version__, devices, filenames, paths, schemes
from .clioptions import SIZE, click_options
from .clioptions import checked as _checked
from .errors import ConvertError
from .options import Options
from .plan.render import mb
from .sources import check_spec, provenance
from .sources.hub import is_hub_spec

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
        except click.BadParameter as e:  # a bad option value (a size, a choice, a number): one line too
            hint = e.param_hint or (e.param.opts if e.param else None)
            hint = hint if isinstance(hint, str) or hint is None else "/".join(hint)
            _fail(f"{hint}: {e.message}" if hint else e.message)
        except click.UsageError as e:  # click's own (a missing argument, an unknown option) and ours: one line too
            _fail(e.format_message())
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


#: ``--trust-remote-code``'s help (``mapping derive``, ``verify-manifest --engine``)
TRUST_REMOTE_CODE = ("the engine reads the config through the checkpoint's own config code (auto_map), as the engines' "
                     "own --trust-remote-code (a release whose config class neither the engine nor transformers has). "
                     "Runs that code: only for a checkpoint you would serve with that flag.")


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="kimi-convert")
def cli() -> None:
    """Convert a sharded safetensors MoE checkpoint into an engine-ready NVFP4 checkpoint with a manifest.

    Hand tables: Kimi K3, Kimi Linear, DeepSeek V3 / R1, Kimi K2, Qwen3 MoE, Qwen3.5 MoE, GLM-4.5 MoE, gpt-oss;
    tables derived from vLLM's and SGLang's own model classes for those in mappings/derived/ (GLM-5.x, DeepSeek
    V3.2 / V4, MiniMax-M2 / M3, Kimi K2.5, Qwen3.8, Mistral Large 3, ...); any other MoE model both engines serve
    through `kimi-convert mapping derive` (scripts/engine-envs.sh) or a table of your own (--mapping FILE.toml).
    """


def user_presets() -> dict[str, str]:
    """The presets ``kimi-convert synth`` offers by name, with their descriptions: the built-in spec files'
    (presets/*.toml). The tests' own fixtures (tiny-deepseek-fp8) are spec files in tests/presets/."""
    from .synth import builtin_presets

    return {name: v.description for name, (_, v) in builtin_presets().items()}


class SynthCommand(click.Command):
    """``synth --help`` lists every preset it offers by name, read from the spec files themselves (torch is
    imported only when the help is asked for)."""

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help_text(ctx, formatter)
        with formatter.section("Presets"):
            formatter.write_dl(list(user_presets().items()))


@cli.command(cls=SynthCommand)
@click.argument("preset")
@click.argument("output", callback=_checked(paths.output_folder))
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic values.")
@click.option("--layers", type=int, help="Override the preset's layer count.")
@click.option("--experts", type=int, help="Override the preset's experts per MoE layer.")
@click.option("--shards", type=click.IntRange(min=1), help="Override the preset's shard count.")
@click.option("--overwrite", is_flag=True, help="Replace an existing checkpoint in OUTPUT.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Shards written at once (the same bytes for any value).")
def synth(preset: str, output: str, seed: int, layers: int | None, experts: int | None, shards: int | None,
          overwrite: bool, jobs: int) -> None:
    """Write a synthetic checkpoint shaped like a real release.

    PRESET: one of those below, or a spec file, FILE.toml holding one preset or FILE.toml:NAME (the format:
    docs/presets.md).
    """
    from .synth import load_preset, write_synth

    spec = load_preset(preset, layers, experts, shards)
    out = write_synth(spec, output, seed=seed, overwrite=overwrite, jobs=jobs)
    stats = [p.stat() for p in out.iterdir() if p.is_file()]
    size, used = sum(s.st_size for s in stats), sum(s.st_blocks * 512 for s in stats)
    sparse = f" ({size / 1e9:.1f} GB apparent, data regions are holes)" if spec.sparse else ""
    given = {"layers": layers, "experts": experts, "shards": shards}  # the description gives the preset's own
    changed = "".join(f" {k}={v}" for k, v in given.items() if v is not None)
    click.echo(f"wrote {paths.shown(out)}/: {spec.description}{f' (changed:{changed})' if changed else ''}; "
               f"{(used if sparse else size) / 1e6:.1f} MB on disk{sparse}")


@cli.command(name="inspect")
@click.argument("path", callback=_checked(lambda p: check_spec(p) if is_hub_spec(p) else paths.existing(p)))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--token", help="A Hub input's token (default: HF_TOKEN or the cached login). Never printed.")
def inspect_cmd(path: str, as_json: bool, token: str | None) -> None:
    """Architecture, layer kinds and MoE parameters (E, top-k, sizes) of a checkpoint or config.json."""
    from .modelinfo import inspect_path, inspect_source, render

    info = inspect_source(_hub_source(path, token)) if is_hub_spec(path) else inspect_path(path)
    click.echo(json.dumps(info.to_dict(), indent=2) if as_json else render(info))


@cli.group(name="mapping")
def mapping_group() -> None:
    """Mapping tables: derive one from the serving engines' own model classes."""


@mapping_group.command(name="derive")
@click.argument("input_dir", metavar="SOURCE", callback=_checked(check_spec))
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False), help="Write the table here (default: stdout).")
@click.option("--answers", type=click.Path(dir_okay=False),
              help="Also write the engines' raw answers (JSON), to rebuild the table without them.")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["vllm", "sglang"]),
              help="Ask only this engine (repeatable; default: both, which the tool's tables need).")
@click.option("--trust-remote-code", is_flag=True, help=TRUST_REMOTE_CODE[0].upper() + TRUST_REMOTE_CODE[1:])
@click.option("--token", help="A Hub input's token (default: HF_TOKEN or the cached login). Never printed.")
def mapping_derive(input_dir: str, out: str | None, answers: str | None, engines: tuple[str, ...],
                   trust_remote_code: bool, token: str | None) -> None:
    """Derive SOURCE's mapping table from vLLM's and SGLang's own model classes (needs scripts/engine-envs.sh).

    Each engine builds its model for SOURCE's config (at SOURCE's size: derive from a small checkpoint of the
    architecture), its loader is offered every weight and reports where each lands; the packed modules, the expert
    banks and the layers each engine builds unquantized become the table, each rule naming its engine and class."""
    from .checkpoint import open_checkpoint
    from .derive import ENGINES, derive
    from .derive.lookup import write_table

    ckpt = open_checkpoint(_input(input_dir, token))
    d = derive(ckpt, engines or ENGINES, Path(answers) if answers else None, trust_remote_code)
    write_table(d.text, Path(out) if out else None)
    for e, why in sorted(d.table.get("not_served", {}).items()):
        click.echo(f"kimi-convert: note: derived without {e}: {why}", err=True)
    for e, names in d.skipped.items():
        if names:
            click.echo(f"kimi-convert: note: {e} puts {len(names)} offered tensor(s) nowhere: {names[0]} ...", err=True)


@cli.command()
@click.argument("input_dir", metavar="INPUT", callback=_checked(check_spec))
@click_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--token", help="A Hub input's token (default: HF_TOKEN or the cached login). Never printed.")
def plan(input_dir: str, opts: Options, as_json: bool, token: str | None) -> None:
    """Print what pack would do, without reading tensor data."""
    from .gcpause import gc_paused
    from .pack import load_plan
    from .plan.serialize import plan_json

    with gc_paused():  # the headers and the plan (half a million objects for the released K3) live until exit:
        ckpt, p = load_plan(_input(input_dir, token), opts, banked=True)  # --json: expanded shard by shard
        gc.freeze()  # out of the collector's walks, before it walks them once (a second of CPU)
    origin = provenance(ckpt.source)  # a Hub input: the repository and the commit its revision resolved to
    if as_json:  # written as made (680 MB for the released K3), side files last: outside plan_dict, whose
        from .plan.serialize import side_dict  # hash covers the weights only

        for piece in plan_json(p, {**side_dict(p), **({"source": origin} if origin else {})}):
            click.echo(piece, nl=False)
        click.echo()
    else:
        from .plan.render import render

        click.echo(render(p, ckpt.source.name if origin else input_dir))
    for w in p.warnings:
        click.echo(f"kimi-convert: warning: {w}", err=True)


@cli.command()
@click.argument("input_dir", metavar="INPUT", callback=_checked(check_spec))
@click.argument("output_dir", metavar="OUTPUT", callback=_checked(paths.output_folder))
@click_options
@click.option("--device", default="auto", show_default=True, callback=_checked(devices.valid),
              help="auto (the GPU when the CUDA driver sees one and torch is a CUDA build), cpu (the C kernel), "
                   "cuda[:N] (the Triton kernel); for tests: reference (the torch code), triton (the Triton "
                   "kernel; on the CPU under TRITON_INTERPRET=1).")
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
@click.option("--upload", "upload_repo", metavar="REPO_ID",
              help="Also upload to this Hub repo, each shard as soon as it is written, while the next ones convert; "
                   "the commit (configs, card, manifest.json last) at the end, then the remote check. The repo id, "
                   "token and the Hub are checked before anything is packed.")
@click.option("--revision", help="With --upload: the branch to commit to (default: main).")
@click.option("--private", is_flag=True, help="With --upload: create the repo as private.")
@click.option("--token", help="With --upload or a Hub input: Hub token (default: HF_TOKEN or the cached login). Never "
                              "printed or stored (not in the resume command either).")
@click.option("--keep-output/--no-keep-output", default=True, show_default=True,
              help="With --upload: keep each shard here once the Hub has it (--no-keep-output deletes it: the disk "
                   "holds only the shards in flight; configs, records and manifest.json stay).")
@click.option("--scratch", "scratch", metavar="DIR", callback=_checked(paths.output_folder),
              help="With a Hub input (hf://OWNER/REPO[@REV]): where its weight files are downloaded, just in time, "
                   "each deleted once converted (default: .OUTPUT.hub-scratch beside OUTPUT).")
@click.option("--max-scratch", "max_scratch", type=SIZE, metavar="SIZE",
              help="With a Hub input: the most bytes of downloads on the scratch disk at once (default: the three "
                   "largest input shards). One file larger than it, or files read together that exceed it: an error "
                   "before any download.")
def pack(input_dir: str, output_dir: str, opts: Options, device: str, workers: int | None, streams: int | None,
         stats_path: str | None, overwrite: bool, resume: bool, quiet: bool, ray_address: str | None,
         upload_repo: str | None, revision: str | None, private: bool, token: str | None, keep_output: bool,
         scratch: str | None, max_scratch: int | None) -> None:
    """Fuse, quantize to NVFP4 and write INPUT as a pre-packed checkpoint in OUTPUT."""
    from .pack import pack as run
    from .tuning import Tuning

    if overwrite and resume:
        raise click.UsageError("--overwrite and --resume exclude each other")
    hub_input = is_hub_spec(input_dir)
    target = _upload_target(upload_repo, revision, private, token, keep_output, hub_input)
    if ray_address is not None and (workers or streams):  # --ray: Ray's tasks replace workers and streams
        raise click.UsageError(f"--{'workers' if workers else 'streams'} does not apply with --ray "
                               "(a task per run of shards, as many as the cluster's GPUs or CPUs run at once)")
    args = _without_token([a for a in sys.argv[1:] if a not in ("--overwrite", "--resume")])
    command = shlex.join(["kimi-convert", *args, "--resume"]) if args[:1] == ["pack"] else None

    source = input_dir
    if hub_input:  # resolved once, here (with --token); the resume command names the commit it resolved to
        source = _hub_source(input_dir, token)
        command = command.replace(input_dir, source.name, 1) if command else None

    _hint_resume(output_dir)
    res = run(source, output_dir, opts, device=device, workers=workers, streams=streams, overwrite=overwrite,
              resume=resume, progress=not quiet, command=command, ray=ray_address, upload=target,
              scratch=scratch, max_scratch=max_scratch,
              say=lambda m: click.echo(m, err=True),
              tuning=click.get_current_context().find_object(Tuning))  # (a test's, passed as the context's obj)
    _report_pack(res, output_dir, upload_repo, stats_path)


def _upload_target(upload_repo: str | None, revision: str | None, private: bool, token: str | None,
                   keep_output: bool, hub_input: bool):
    """``--upload``'s target, or None; an upload option without ``--upload`` is a usage error (``--token`` alone
    serves a Hub input too), refused before any work."""
    if not upload_repo and (revision or private or (token and not hub_input) or not keep_output):
        used = "--revision" if revision else "--private" if private else "--token" if token else "--no-keep-output"
        raise click.UsageError(f"{used} needs --upload REPO_ID")
    if not upload_repo:
        return None
    from .upload.live import UploadTarget

    return UploadTarget(upload_repo, revision=revision, private=private, token=token, keep_output=keep_output)


def _hint_resume(output_dir: str) -> None:
    """What an interrupted ``pack`` adds to its one line: the shards finished and the resume command, read from
    the output's journal when the interrupt comes (``main``'s handler calls it)."""
    from .journal import Journal

    def interrupted() -> str:
        j = Journal.load(Path(output_dir)) if Path(output_dir).is_dir() else None
        return f"; {len(j.shards)} shard(s) finished; resume with: {j.command}" if j else ""
    global _interrupt_hint
    _interrupt_hint = interrupted


def _report_pack(res, output_dir: str, upload_repo: str | None, stats_path: str | None) -> None:
    """What ``pack`` says when done: the plan's warnings, then either that the output was already complete or
    the summary (the --stats file, the side files not copied, the counts), the upload, and ``--device auto``'s
    choice."""
    for w in res.plan.warnings:
        click.echo(f"kimi-convert: warning: {w}", err=True)
    if res.already_complete:
        click.echo(f"{paths.shown(output_dir)}/ is already complete and matches its manifest; nothing to do"
                   + ("" if res.upload is None else " here"))
        _report_upload(res.upload, upload_repo, output_dir)
        return
    if stats_path and res.stats:
        Path(stats_path).write_text(json.dumps(dataclasses.asdict(res.stats), indent=2) + "\n")
    if res.plan.skipped_files:  # side files (convert/sidefiles.py): what was not copied, and why
        from .sidefiles import summary

        click.echo(summary(res.plan.skipped_files))
    click.echo(_pack_summary(res, output_dir))
    _report_upload(res.upload, upload_repo, output_dir)
    if res.stats and res.stats.device == "auto":  # what the measurement chose, and on what (also in --stats)
        click.echo(_auto_choice(res.stats))


def _pack_summary(res, output_dir: str) -> str:
    """The line a finished ``pack`` prints: what was written, its size, and the modules of each kind."""
    o = res.plan.outline  # counted from the outline: a banked plan's modules are made one output shard at a time
    cast = f"; MXFP4 cast: {res.cast_lossless}/{res.cast_blocks} blocks lossless" if res.cast_blocks else ""
    return (
        f"wrote {paths.shown(output_dir)}/ (recipe {res.plan.recipe.name}): {o.shards} shards, "
        f"{mb(res.bytes_out)} from {mb(res.bytes_in)}; "
        + "".join(f"{o.kinds[n]} {s.TITLE} modules, " for n, s in schemes.SCHEMES.items())
        + f"{o.kinds['keep']} kept, "
        f"{o.kinds['copy']} tensors copied{cast}; manifest.json"
        + (f" ({res.resumed_shards} finished shard(s) verified and kept)" if res.resumed_shards else "")
    )


def _auto_choice(stats) -> str:
    """``--device auto``'s line: what its measurement chose for each kind of work, or why every unit ran on the
    CPUs."""
    from .pipeline.choose import Choice

    chosen = "; ".join(Choice(**c).describe() for c in stats.device_choices)
    skipped = any(c.get("skipped") for c in stats.calibration)  # (Tuning.probe_after_s)
    return ("device auto (GPU or CPUs, whichever was faster on the first units of each kind of work): "
            + (chosen or ("the pack was over before the GPU was to be measured" if skipped else
                          "no kind of work was measured on both") + "; every unit ran on the CPUs"))


def _hub_source(spec: str, token: str | None):
    """A Hub input (``hf://OWNER/REPO[@REV]``), its revision resolved to a commit once, here."""
    from .sources.hub import HubRepo

    return HubRepo.connect(spec, token=token, say=lambda m: click.echo(m, err=True))


def _input(spec, token: str | None):
    """An input argument as the commands take it: a Hub input resolved (``_hub_source``), anything else as given."""
    return _hub_source(spec, token) if is_hub_spec(spec) else spec


def _without_token(args: list[str]) -> list[str]:
    """The command line less ``--token VALUE`` / ``--token=VALUE``: the resume command is stored in the journal."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--token":
            skip = True
        elif not a.startswith("--token="):
            out.append(a)
    return out


def _report_upload(up, repo_id: str | None, output_dir: str) -> None:
    """``pack --upload``'s last lines: the card, the commit, the remote check (as ``upload`` says them)."""
    if up is None:
        return
    _report_commit(up, repo_id, output_dir,
                   f"{up.commit_url} ({up.sent} shard(s) uploaded by this run as they were written)")


def _report_commit(res, repo_id: str | None, output_dir: str, committed: str) -> None:
    """The card, the commit and the remote check, as ``upload`` and ``pack --upload`` both say them; a
    file on the Hub that does not match the manifest is the error."""
    if res.card_written:
        click.echo(f"wrote {paths.shown(output_dir)}/README.md (model card)")
    click.echo(f"committed: {committed}")
    if res.remote.problems:
        for p in res.remote.problems:
            click.echo(f"  - {p}", err=True)
        raise ConvertError(f"{repo_id}: {len(res.remote.problems)} file(s) on the Hub do not match the manifest")
    click.echo(f"{repo_id}: all {res.remote.checked} files present, sizes and sha256 match the manifest")


@cli.command(name="verify-manifest")
@click.argument("output_dir", metavar="OUTPUT", callback=_checked(paths.folder, "a kimi-convert output folder"))
@click.option("--input", "input_dir", callback=_checked(check_spec),
              help="Also prove OUTPUT was derived from INPUT: hashes, re-plan, pass-through and re-quantization.")
@click.option("--full", is_flag=True, help="With --input: re-quantize every NVFP4 tensor, not a sample.")
@click.option("--device", default="cpu", show_default=True, callback=_checked(devices.valid),
              help="Where --input re-quantizes: cpu, cuda[:N], auto (or reference, triton).")
@click.option("--remote", metavar="REPO_ID", help="Also check a Hub repo's files against the manifest (no download).")
@click.option("--revision", help="With --remote: the branch, tag or refs/pr/N to check.")
@click.option("--token", help="With --remote or a Hub --input: Hub token (default: HF_TOKEN or the cached login).")
@click.option("--engine", "engines", multiple=True, type=click.Choice(["vllm", "sglang"]),
              help="Also load OUTPUT with this engine's own loading code, on the CPU (repeatable); "
                   "fails on an engine error, an unfilled parameter, a skipped tensor or a bad cast.")
@click.option("--engine-python", callback=_checked(paths.file, "a python executable"),
              help="With one --engine: the python that has the engine installed (default: "
                   "KIMI_CONVERT_VLLM_PYTHON / KIMI_CONVERT_SGLANG_PYTHON, else scripts/engine-envs.sh's environment).")
@click.option("--engine-any-version", is_flag=True,
              help="With --engine: run an engine version other than the tested one.")
@click.option("--numerics/--no-numerics", default=True, show_default=True,
              help="With --engine and --input: read every layer as the engine's GEMM does and compare it, row for "
                   "row, with INPUT's weights, each row held to its scheme's own error.")
@click.option("--draft/--no-draft", default=True, show_default=True,
              help="With --engine: where the engine's main model leaves MTP layers to its speculative-decoding draft, "
                   "also build that draft model (vLLM's --speculative-config method mtp, SGLang's "
                   "--speculative-algorithm NEXTN) and check it the same way.")
@click.option("--trust-remote-code", is_flag=True, help=f"With --engine: {TRUST_REMOTE_CODE}")
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable report (with --engine: every parameter's details).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
def verify_manifest(output_dir: str, input_dir: str | None, full: bool, device: str, remote: str | None,
                    revision: str | None, token: str | None, engines: tuple[str, ...], engine_python: str | None,
                    engine_any_version: bool, numerics: bool, draft: bool, trust_remote_code: bool, as_json: bool,
                    quiet: bool) -> None:
    """Check OUTPUT against its manifest.json (exit 0 only if everything holds).

    With --engine and no manifest.json in OUTPUT (any checkpoint: NVIDIA's, llm-compressor's), only the engine
    checks run, and with --input SOURCE the numeric check against SOURCE's weights, matched by tensor name.
    """
    from .progress import Progress
    from .verify import Report, verify

    engines = tuple(dict.fromkeys(engines))
    if engine_python and len(engines) != 1:
        raise click.UsageError("--engine-python needs exactly one --engine")
    if engine_any_version and not engines:
        raise click.UsageError("--engine-any-version needs --engine")
    manifest = Path(output_dir, filenames.MANIFEST).exists() or not engines
    hub_api = None
    if remote and manifest:  # the repo id, the Hub and the repo checked before any hashing
        from .transport import connect

        hub_api = connect(remote, token, write=False, revision=revision, say=lambda m: click.echo(m, err=True))
    if manifest:
        with Progress("verify", not (quiet or as_json)) as bar:
            given = _input(input_dir, token)
            rep = verify(output_dir, given, full=full, device=device, progress=bar.update, total=bar.grow,
                         hub=bool(remote))
    else:
        if remote or (input_dir and not numerics):
            raise ConvertError(f"{output_dir}: no manifest.json, so --input (without the numeric check) and --remote "
                               "have nothing to check")
        rep = Report()
    if remote:
        from .upload.publish import verify_remote

        rc = verify_remote(output_dir, remote, revision, token, say=lambda m: click.echo(m, err=True), api=hub_api,
                           local_sha256=rep.sha256)
        rep.check(f"Hub repo {remote}: files, sizes and sha256", rc.problems, f"{rc.checked} files")
    engine_reports = _engine_checks(rep, output_dir, engines, engine_python, engine_any_version,
                                    input_dir if numerics else None, draft, not (quiet or as_json),
                                    trust_remote_code)
    if engines and numerics and not input_dir and not (quiet or as_json):
        click.echo("note: numeric check not run: give --input SOURCE (the checkpoint OUTPUT was converted from)",
                   err=True)
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


def _engine_checks(rep, output_dir: str, engines: tuple[str, ...], engine_python: str | None, any_version: bool,
                   source: str | None, draft: bool, say: bool, trust_remote_code: bool = False) -> list:
    """Each engine's check of OUTPUT, and, where the engine's main model leaves MTP layers to its draft, the same check
    of the engine's speculative-decoding draft model (its own line: ``ENGINE VERSION draft``)."""
    from .enginecheck import check, resolve

    for engine in engines:  # every engine's python checked before any engine runs
        resolve(engine, engine_python, any_version)
    reports = []
    for engine in engines:
        roles = [False]
        main_class = None
        while roles:
            as_draft = roles.pop()
            if say:
                what = "its speculative-decoding draft" if as_draft else "its own loader"
                click.echo(f"loading {output_dir} with {engine} ({what}, on the CPU)...", err=True)
            er = check(output_dir, engine, python=engine_python, any_version=any_version, source=source,
                       draft=as_draft, trust_remote_code=trust_remote_code)
            if as_draft and er.model_class and er.model_class == main_class:
                rep.check(*_no_draft(engine, er.version, main_class))
                continue
            if as_draft and _draft_refused(er):
                rep.check(*_no_draft(engine, er.version, main_class, refused=er.error["message"]))
                continue
            main_class = er.model_class
            reports.append(er)
            head = f"{engine} {er.version}" + (f" draft ({(er.model_class or '?').rpartition('.')[2]})" if as_draft
                                               else "")
            rep.check(f"{head}: its own loader ({er.seconds:.0f} s)", [] if er.loads else [er.verdict],
                      er.load_verdict if er.loads else "")
            if er.loads and er.numerics is not None:
                rep.check(f"{head}: numerics, every layer as its GEMM reads it",
                          [] if er.numerics["ok"] else er.numerics["problems"], er.numeric_verdict)
            if draft and not as_draft and er.mtp_skipped:
                roles.append(True)
    return reports


def _draft_refused(er) -> bool:
    """The engine refuses to build any draft for the architecture before a model exists: vLLM's SpeculativeConfig
    maps the target's model type to no MTP model and rejects the method (``config/speculative.py``
    ``SpeculativeConfig.__post_init__``: ``NotImplementedError("Unsupported speculative method: 'mtp'")``; vLLM 0.33 and
    A.X K1's ``axk1``). Like a draft config that builds the main class again, nothing there reads the MTP layers."""
    if er.model_class is not None or er.loaded:
        return False
    err = er.error or {}
    return err.get("type") == "NotImplementedError" and "Unsupported speculative method" in (err.get("message") or "")


def _no_draft(engine: str, version: str | None, main_class: str, refused: str | None = None
              ) -> tuple[str, list[str], str]:
    """The check line of an engine whose speculative-decoding draft config builds the main class again: it has no
    draft model for the architecture (SGLang 0.5.23 and MiniMax M3: ``configs/model_config.py``
    ``ModelConfig._config_draft_model`` renames no MiniMax architecture), so nothing reads the MTP layers there; not
    a fault of the checkpoint (the main model's own check above holds it)."""
    name = main_class.rpartition(".")[2]
    why = (f"its speculative config refuses the method ({refused}), so nothing there reads the MTP layers its main "
           "model drops" if refused else f"its draft config builds {name} again, whose loader drops the MTP layers")
    return (f"{engine} {version} draft: none for {name}", [],
            f"{engine} {version} has no speculative-decoding draft model for {name}: {why} (docs/families.md, "
            "\"MTP layers and the engines' drafts\")")


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
    from .upload.publish import upload as run

    if create_pr and revision:
        raise click.UsageError("--create-pr opens a PR against the default branch; drop --revision")
    res = run(output_dir, repo_id, private=private, revision=revision, create_pr=create_pr, token=token,
              base_model=base_model, say=lambda m: click.echo(m, err=True))
    _report_commit(res, repo_id, output_dir, res.pr_url or res.commit_url)


def render_report(rep, output_dir: str) -> str:
    lines = [f"{'ok  ' if ok else 'FAIL'}  {name}" + (f" ({detail})" if detail else "")
             for name, ok, detail in rep.checks]
    shown = rep.problems[:40]
    lines += [f"  - {p}" for p in shown]
    if len(rep.problems) > len(shown):
        lines.append(f"  ... and {len(rep.problems) - len(shown)} more (--json lists all)")
    lines.append(f"{output_dir}: verified" if rep.ok else f"{output_dir}: {len(rep.problems)} problem(s)")
    return "\n".join(lines)


def main() -> None:
    try:
        cli(prog_name="kimi-convert")
    except SystemExit as e:
        if e.code != 130:
            raise
        # Interrupted: the pipeline has stopped, the journal and any Ray cluster are closed. The
        # interpreter's own finalization (torch's module teardown, once imported) would take 2-7 s more:
        # run the exit handlers (multiprocessing's, which free the workers' semaphores) and skip the rest.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


if __name__ == "__main__":
    main()
