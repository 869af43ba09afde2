"""Runs several real training scripts in turn in one interpreter, with fittrain or with Accelerate.

    python runner.py --lib fittrain --assets DIR --out DIR --spec runs.json

`runs.json` is a list of `{"name": ..., "script": ..., "argv": [...]}`. Each run gets a folder
`OUT/<name>/` that links the tiny assets (assets.py) under the Hub names, is made the working
directory, and receives the script: as stored under upstream/ for `--lib accelerate`, and with
the import change only for `--lib fittrain` (`accelerate` becomes `fittrain` in `from accelerate`
and `import accelerate` lines; nothing else changes). The script then runs as `__main__` with
`sys.argv` set, as `python script.py ARGV...` would run it.

One interpreter serves all runs because importing transformers takes seconds; between runs,
Accelerate's process-wide state is reset with its own `_reset_state` methods (fittrain keeps no
such state). Under a launcher (torchrun, `fittrain launch`) every worker runs the same list.

For each run, each process prints one line `@@RUN {json}` with the run's name, the rank, whether
it finished, the error (type, message and the last frames) if not, the lines the script printed,
and a SHA-256 digest of every `logits` and `loss` tensor that a transformers model returned, in
order: equal digests mean bitwise equal forward passes over the whole training and evaluation.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import pathlib
import re
import runpy
import sys
import traceback

#: `from accelerate...` and `import accelerate...` at any indentation; group 2 is the module name.
IMPORT_LINE = re.compile(r"^(\s*(?:from|import)\s+)(accelerate)(?=[\s.])", re.MULTILINE)
#: The asset folders linked into every run folder, under the names the scripts load.
ASSET_NAMES = ("bert-base-cased", "nyu-mll", "glue", "HuggingFaceTB", "Salesforce")


def rewrite_imports(source: str) -> str:
    """The import change, and nothing else: `accelerate` becomes `fittrain` in import lines."""
    return IMPORT_LINE.sub(r"\1fittrain", source)


class _Tee(io.TextIOBase):
    """Writes through to the real stdout and keeps a copy of what the script printed."""

    def __init__(self, target) -> None:
        self.target, self.kept = target, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.target.write(text)

    def flush(self) -> None:
        self.target.flush()


class _ForwardDigest:
    """A SHA-256 over the `logits` and `loss` of every transformers model forward, in order."""

    def __init__(self) -> None:
        import torch
        from transformers import PreTrainedModel

        self.sha, self.forwards, self._model_type = hashlib.sha256(), 0, PreTrainedModel
        self.last = ""  # the last forward's logits alone: the final evaluation, compared across resumes
        self._handle = torch.nn.modules.module.register_module_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if not isinstance(module, self._model_type):
            return
        for key in ("loss", "logits"):
            value = getattr(output, key, None)
            if value is not None:
                data = value.detach().float().cpu().contiguous().numpy().tobytes()
                self.sha.update(data)
                self.forwards += 1
                if key == "logits":
                    self.last = hashlib.sha256(data).hexdigest()

    def close(self) -> str:
        self._handle.remove()
        return self.sha.hexdigest()


def _reset_library_state(lib: str) -> None:
    """Accelerate keeps its state in process-wide singletons that a second script would inherit."""
    if lib == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _rejoin_process_group(index: int) -> None:
    """Joins a fresh process group for run `index` when an earlier script left none.

    A script that calls `end_training()` destroys the process group, with Accelerate and with
    fittrain alike. A later `init_process_group` on the launcher's store would then find the first
    group's keys and fail to connect, a limit of running several scripts in one job, not of
    either library; so the runner joins a group under a key prefix of this run's own, which both
    libraries adopt as they adopt any group made before them. The first run joins on its own.
    """
    import datetime

    import torch.distributed as dist

    if index == 0 or int(os.environ.get("WORLD_SIZE", "1")) < 2 or dist.is_initialized():
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=90))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"real_scripts_run_{index}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _prepare(run: dict, lib: str, assets: pathlib.Path, out: pathlib.Path, rank: int) -> pathlib.Path:
    """The run's folder with the asset links, and the script to run from it."""
    folder = out / run["name"]
    folder.mkdir(parents=True, exist_ok=True)
    for name in ASSET_NAMES:
        with contextlib.suppress(FileExistsError):  # the other rank made it first
            (folder / name).symlink_to(assets / name, target_is_directory=True)
    source = pathlib.Path(run["script"]).read_text(encoding="utf-8")
    script = folder / ".scripts" / str(rank) / pathlib.Path(run["script"]).name  # ranks write apart
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(rewrite_imports(source) if lib == "fittrain" else source, encoding="utf-8")
    return script


def run_one(run: dict, lib: str, assets: pathlib.Path, out: pathlib.Path, rank: int, index: int) -> dict:
    """Runs one script as `__main__` in its folder; returns what the `@@RUN` line reports."""
    result = {"name": run["name"], "rank": rank, "ok": False, "error": None, "lines": [], "digest": None}
    digest, tee, cwd, argv = _ForwardDigest(), _Tee(sys.stdout), os.getcwd(), sys.argv
    try:
        _rejoin_process_group(index)
        script = _prepare(run, lib, assets, out, rank)
        os.chdir(out / run["name"])
        sys.argv = [str(script), *run["argv"]]
        with contextlib.redirect_stdout(tee):
            runpy.run_path(str(script), run_name="__main__")
        result["ok"] = True
    except SystemExit as exit_:  # argparse errors and explicit exits
        result["ok"] = exit_.code in (0, None)
        result["error"] = None if result["ok"] else f"SystemExit({exit_.code!r})"
    except BaseException as error:  # noqa: BLE001 - reported, and the next script still runs
        frames = traceback.format_exception(type(error), error, error.__traceback__)
        result["error"] = "".join(frames[-6:])[-3000:]
    finally:
        os.chdir(cwd)
        sys.argv = argv
        result["digest"] = digest.close()
        result["forwards"], result["last_logits"] = digest.forwards, digest.last
        result["lines"] = tee.kept.getvalue().splitlines()
        _reset_library_state(lib)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", choices=("fittrain", "accelerate"), required=True)
    parser.add_argument("--assets", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--spec", type=pathlib.Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    for index, run in enumerate(json.loads(args.spec.read_text(encoding="utf-8"))):
        result = run_one(run, args.lib, args.assets.resolve(), args.out.resolve(), rank, index)
        print("@@RUN " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
