"""Category two-writers: two processes (the ``_writer`` role) save into one project at once.

Every checkpoint that exists must be intact, every save that returned must be on disk with its own
writer's files, and a save that fails must say so with a CheckpointError rather than a raw OSError.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from fittrain.checkpoint import CheckpointReader, is_intact

from .checks import Outcome, broken_checkpoints, short
from .children import JOB_TIMEOUT_S, MODULE, Context, emit, killed_after, role_args, wait_for_file, wait_until
from .rig import Rig, fingerprint

WRITER_WIDTH = 384  # about 1.2 MB per checkpoint, so that saves overlap
WRITER_SAVES = 8
WRITERS = {"automatic numbering, synchronous saves": [], "automatic numbering, async saves": ["--async-save"],
           "both saving to one explicit folder": ["--folder", "shared"]}


# ===================================================================== in a writer
def writer_main(argv: list[str]) -> None:
    """Saves WRITER_SAVES times into --project once --wait-for exists, reporting each save as an event."""
    parser = argparse.ArgumentParser(prog=f"{MODULE} _writer")
    parser.add_argument("--project", required=True)
    parser.add_argument("--id", type=int, required=True)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--folder", help="save_state(<project>/<folder>) instead of automatic naming")
    parser.add_argument("--ready", required=True)
    parser.add_argument("--wait-for", required=True)
    args = parser.parse_args(argv)
    rig = Rig(pathlib.Path(args.project), seed=args.id, width=WRITER_WIDTH, writer=args.id, auto=not args.folder)
    rig.step()
    pathlib.Path(args.ready).touch()
    wait_for_file(args.wait_for)
    target = pathlib.Path(args.project) / args.folder if args.folder else None
    for save in range(WRITER_SAVES):
        rig.tag.save = save
        try:
            path = rig.acc.save_state(target, async_save=args.async_save)
            rig.step()  # training goes on while an async save is written
            rig.acc.wait_for_checkpoint()
            emit(save=save, path=path, fingerprint=rig.tag.fingerprint)
        except Exception as err:
            emit(save=save, error=short(err))


# ===================================================================== in the parent
def _saved_by(folder: pathlib.Path) -> tuple[int, int, bool]:
    """(writer, save) of the tag in `folder`, and whether its weights are the ones that writer saved."""
    reader = CheckpointReader(folder)
    tag = reader.read_torch("custom_checkpoint_0.pt")
    return tag["writer"], tag["save"], fingerprint(reader.read_tensors("model.safetensors")) == tag["fingerprint"]


def _claims_hold(project: pathlib.Path, saves: dict[int, list[dict[str, Any]]], shared: bool) -> list[str]:
    """Problems with the folders that saves which returned said they wrote."""
    claims = {(writer, e["save"]): pathlib.Path(e["path"]) for writer, events in saves.items()
              for e in events if "path" in e}
    problems, overwritten = [], []
    for folder in [project / "shared"] if shared else sorted(set(claims.values())):
        try:
            writer, save, own = _saved_by(folder)
        except Exception as err:
            problems.append(f"{folder.name}, which a save returned, is missing or unreadable: {short(err)}")
            continue
        if not own:
            problems.append(f"{folder.name} holds writer {writer}'s save {save} with the other writer's weights")
        elif (writer, save) not in claims:
            problems.append(f"{folder.name} holds writer {writer}'s save {save}, which had failed")
        if not shared:
            overwritten += [f"writer {w}'s save {s} ({folder.name})" for (w, s), path in claims.items()
                            if path == folder and (w, s) != (writer, save)]
    if overwritten:
        problems.append(f"saves that returned were overwritten by the other writer: {overwritten[:3]}")
    return problems


def _two_writers(ctx: Context, options: list[str]) -> list[str]:
    """Starts two writers with `options`, lets them save at once, then checks what is on disk."""
    run = ctx.folder("writers")
    project, go, shared = run / "project", run / "go", "--folder" in options
    writers = [ctx.start(role_args("_writer", "--project", project, "--id", i, "--ready", run / f"ready{i}",
                                   "--wait-for", go, *options), run / f"writer{i}.log") for i in (0, 1)]
    with killed_after(*writers):
        ready = [wait_until(lambda i=i: (run / f"ready{i}").exists(), w, JOB_TIMEOUT_S) for i, w in enumerate(writers)]
        if not all(ready):
            return [f"a writer never got ready: {' / '.join(w.ending() for w in writers)}"]
        go.touch()
        problems = [f"writer {i} {w.ending()}" for i, w in enumerate(writers) if w.wait() != 0]
        saves = {i: [e for e in w.events() if "save" in e] for i, w in enumerate(writers)}
        problems += [f"writer {i}'s save {e['save']} failed with a raw error, not a CheckpointError: {e['error']}"
                     for i, events in saves.items() for e in events
                     if "error" in e and not e["error"].startswith("CheckpointError")]
        if not shared:
            problems += broken_checkpoints(project / "checkpoints", "after both writers ended")
        elif not is_intact(project / "shared"):
            problems.append("the shared folder is not intact after both writers ended")
        return problems + _claims_hold(project, saves, shared)


def writers_category(ctx: Context) -> list[Outcome]:
    variants = list(WRITERS)[:1] if ctx.quick else list(WRITERS)
    return [Outcome(variant, _two_writers(ctx, WRITERS[variant])) for variant in variants]
