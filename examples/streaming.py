"""Training from a stream that reads a text file line by line, killed and resumed exactly.

A character-level language model (the MLP of examples/char_lm.py) learns the Zen of Python, which
ships with Python. The script first writes a corpus to `outputs/streaming/`: `--copies` copies of
the Zen's lines, each copy in its own seeded shuffled order, and one more shuffled copy as the
validation text (the same aphorisms in another order: its loss measures how well the model learnt
them, not how it generalises). `LineStream`, a torch `IterableDataset`, then opens the file and
reads it line by line, yielding (previous `--context` characters, next character) samples. It has
no length: the Trainer trains to `--max-steps`, validating every `--val-every` steps.

With `--num-workers N`, each DataLoader worker reads the lines `i % N == worker id` (it splits
its work with `torch.utils.data.get_worker_info()`, as in plain PyTorch). `LineStream` also
reports how far it has read (`state_dict()`), so a resumed run continues each worker's stream
where the checkpoint left it.

Three runs of the same job, in this one script:

1. the reference: trains to `--max-steps` without interruption;
2. the same job, saving a checkpoint every `--save-every` steps, killed (a raised exception stands
   in for the kill) after step `--stop-after`: the steps since the last checkpoint are lost;
3. a fresh model (other initial weights, other global seed) and a fresh Trainer with
   `resume_from="latest"`, which finish the job.

On the CPU with deterministic ops, run 3 ends with weights bitwise equal to run 1's.
Each start deletes the checkpoints that the script's previous start left in outputs/streaming/.

Run it:      python examples/streaming.py
Tiny sizes:  python examples/streaming.py --smoke   (in outputs/streaming_smoke/ instead)
Two workers: python examples/streaming.py --num-workers 2
"""

import argparse
import codecs
import contextlib
import io
import pathlib
import random
import shutil

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from fittrain import Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer, GradClip
from fittrain.checkpoint.run_folders import run_checkpoints, run_folder

OUTPUT_DIR = pathlib.Path("outputs/streaming")
SMOKE_OUTPUT_DIR = pathlib.Path("outputs/streaming_smoke")  # a smoke run never deletes a full run's files


def zen_lines() -> list[str]:
    """The Zen of Python's non-empty lines (`this.s` is rot13-encoded)."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines() if line.strip()]


def write_corpus(path: pathlib.Path, copies: int, seed: int) -> int:
    """Writes `copies` copies of the Zen's lines, each copy shuffled with its own seed; returns the line count."""
    lines = zen_lines()
    with open(path, "w", encoding="utf-8") as f:
        for copy in range(copies):
            order = lines[:]
            random.Random(seed * 1_000_003 + copy).shuffle(order)  # deterministic: the same file every run
            f.writelines(line + "\n" for line in order)
    return copies * len(lines)


class LineStream(IterableDataset):
    """(context, next character) samples of a text file, read line by line.

    Each line is predicted on its own, after `context` newlines, up to and including its final
    newline. With DataLoader workers, worker w of W reads the lines i with i % W == w.
    `state_dict()` counts the samples this copy of the stream has yielded in its pass, so that
    `load_state_dict()` makes the next pass continue after them (the counted lines are read but
    not turned into samples).
    """

    def __init__(self, path: pathlib.Path, stoi: dict[str, int], context: int) -> None:
        self.path, self.stoi, self.context = path, stoi, context
        self.yielded = 0  # samples yielded in the current pass
        self.resume_at = 0  # samples to pass over at the start of the next pass

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        skip, self.resume_at, self.yielded = self.resume_at, 0, 0
        with open(self.path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if i % workers != worker:
                    continue
                if skip >= len(line):  # a line gives len(line) samples, its newline included
                    skip, self.yielded = skip - len(line), self.yielded + len(line)
                    continue
                ids = [self.stoi[ch] for ch in "\n" * self.context + line]
                for end in range(self.context + skip, len(ids)):
                    self.yielded += 1
                    yield torch.tensor(ids[end - self.context:end]), torch.tensor(ids[end])
                skip = 0

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = int(state["yielded"])


class CharLM(TrainModule):
    """Embeds `context` characters, concatenates them, and predicts the next one with an MLP."""

    def __init__(self, vocab_size: int, context: int, embed: int = 24, hidden: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(vocab_size, embed)
        self.mlp = nn.Sequential(nn.Linear(context * embed, hidden), nn.Tanh(), nn.Linear(hidden, vocab_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(ids).flatten(1))  # (batch, context) ids -> (batch, vocab) logits

    def training_step(self, batch):
        context, next_char = batch
        return nn.functional.cross_entropy(self(context), next_char)

    def validation_step(self, batch):
        return self.training_step(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class PrintValidation(Callback):
    """Prints the step, the last training loss and the validation loss after each validation."""

    def on_validation_end(self, trainer):
        metrics = trainer.state.metrics
        trainer.accelerator.print(f"  step {trainer.state.global_step:4d}  epoch {trainer.state.epoch}  "
                                  f"train_loss {metrics['train_loss']:.3f}  val_loss {metrics['val_loss']:.3f}")


class SimulatedKill(Exception):
    """What KillAfter raises."""


class KillAfter(Callback):
    """Raises after optimizer step `step`, as if the process had been killed there."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer):
        if trainer.state.global_step == self.step:
            raise SimulatedKill(f"simulated kill after step {self.step}")


def run(project_dir: pathlib.Path, data: dict, args: argparse.Namespace, seed: int, callbacks: list,
        resume_from: str | None = None) -> CharLM:
    """Builds everything from scratch (as a new process would) and fits."""
    torch.manual_seed(seed)
    stoi, workers = data["stoi"], args.num_workers
    train = DataLoader(LineStream(data["train"], stoi, args.context), batch_size=args.batch_size, num_workers=workers)
    val = DataLoader(LineStream(data["val"], stoi, args.context), batch_size=256, num_workers=workers)
    model = CharLM(len(stoi), args.context, hidden=args.hidden)
    trainer = Trainer(max_steps=args.max_steps, val_every_n_steps=args.val_every, project_dir=project_dir,
                      resume_from=resume_from, callbacks=[GradClip(max_norm=1.0), PrintValidation(), *callbacks])
    trainer.fit(model, train, val)
    print(f"  finished at step {trainer.state.global_step}")
    return model


def prepare_data(args: argparse.Namespace) -> dict:
    """Writes the training and validation texts under args.output_dir; returns their paths and the vocabulary."""
    args.output_dir.mkdir(parents=True, exist_ok=True)
    train, val = args.output_dir / "train.txt", args.output_dir / "val.txt"
    lines = write_corpus(train, args.copies, seed=0)
    write_corpus(val, 1, seed=1)
    text = train.read_text(encoding="utf-8")
    print(f"corpus: {train}, {lines} lines, {len(text)} characters; validation: {val}")
    vocab = sorted(set(text) | {"\n"})
    return {"train": train, "val": val, "stoi": {ch: i for i, ch in enumerate(vocab)}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train from a line-by-line text stream; kill, resume, compare.")
    parser.add_argument("--copies", type=int, default=40, help="shuffled copies of the Zen in the corpus")
    parser.add_argument("--context", type=int, default=16, help="characters the model sees to predict the next")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-steps", type=int, default=800)
    parser.add_argument("--val-every", type=int, default=100, help="Trainer(val_every_n_steps=...)")
    parser.add_argument("--save-every", type=int, default=100, help="Checkpointer(every_n_steps=...)")
    parser.add_argument("--stop-after", type=int, default=550, help="the step after which run 2 is killed")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers for both streams")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for a quick test")
    args = parser.parse_args()
    if args.smoke:  # about 27 batches per pass: the runs cross an epoch boundary
        args.copies, args.context, args.hidden, args.batch_size = 1, 8, 32, 32
        args.max_steps, args.val_every, args.save_every, args.stop_after = 36, 12, 10, 25
    args.output_dir = SMOKE_OUTPUT_DIR if args.smoke else OUTPUT_DIR
    if not 0 < args.stop_after < args.max_steps:
        parser.error(f"--stop-after must be between 0 and --max-steps ({args.max_steps}). "
                     f"Received: --stop-after {args.stop_after}.")
    return args


def main() -> None:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    data = prepare_data(args)
    reference_dir, job_dir = args.output_dir / "reference", args.output_dir / "job"
    for folder in (reference_dir, job_dir):
        shutil.rmtree(folder, ignore_errors=True)  # this script's own runs from an earlier start

    print(f"1. uninterrupted run to step {args.max_steps}, {args.num_workers} DataLoader workers")
    reference = run(reference_dir, data, args, seed=0, callbacks=[])

    print(f"2. the same run, saving every {args.save_every} steps, killed after step {args.stop_after}")
    try:
        run(job_dir, data, args, seed=0,
            callbacks=[Checkpointer(every_n_steps=args.save_every), KillAfter(args.stop_after)])
    except SimulatedKill as kill:
        print(f"  {kill}")
    saved = run_checkpoints(job_dir)  # the run's folder, checkpoints/<run name>
    print(f"  checkpoints on disk: {', '.join(p.name for p in saved)}")

    print("3. a fresh Trainer (other seed, other initial weights) resumes from 'latest'")
    # The callback list matches run 2's, minus the kill: callback states are matched by position and class.
    resumed = run(job_dir, data, args, seed=1234, callbacks=[Checkpointer(every_n_steps=args.save_every)],
                  resume_from="latest")

    ref_state, res_state = reference.state_dict(), resumed.state_dict()
    equal = all(torch.equal(ref_state[k], res_state[k]) for k in ref_state)
    print(f"final weights equal to the uninterrupted run's (torch.equal): {equal}")
    print(f"checkpoints: {run_folder(job_dir)}")
    if not equal:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
