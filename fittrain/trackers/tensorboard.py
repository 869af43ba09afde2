"""TensorBoardTracker: event files written with tensorboard's own `EventFileWriter`, one event
per logging point; hyperparameters through the hparams plugin."""

from __future__ import annotations

import os
import time
from typing import Any

from fittrain.trackers.base import GeneralTracker, RunInfo, as_number, check_values, flatten, hparams_of, unloggable


class EventWriter:
    """A TensorBoard event file that takes all the scalars of one logging point as one event.

    torch's `SummaryWriter.add_scalar` builds and queues one event per scalar, through several
    layers; a logging point writes five or more, and on a small CPU that cost about 1 ms. One
    event holding every value, written with tensorboard's own `EventFileWriter`, costs a quarter
    of that and reads back the same (each value is a scalar under its tag).

    Args:
        folder: The log folder; created if missing.
        purge_step: When given, the file starts with a SessionLog START at this step, as
            `SummaryWriter(purge_step=...)` writes: TensorBoard's readers then drop the points
            that earlier files of this folder hold from that step on (a crashed run's, which a
            resumed run writes again).
    """

    def __init__(self, folder: str, purge_step: int | None = None) -> None:
        # Imported here: tensorboard takes a noticeable time to import, which a Logger without it should not pay.
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._session_log = Event, Summary, SessionLog
        if purge_step is None:
            self._file = EventFileWriter(folder)
        else:
            self._file = _last_in_order(folder, EventFileWriter)
            self.purge(purge_step)

    def purge(self, step: int) -> None:
        """Writes a SessionLog START at `step`: readers drop the points read so far at `step` or later."""
        start = self._session_log(status=self._session_log.START)
        self._file.add_event(self._event(step=step, wall_time=time.time(), session_log=start))

    def write(self, scalars: dict[str, float], step: int, flush: bool = False) -> None:
        """Appends one event with every scalar at `step`; `flush` pushes it to disk now."""
        values = [self._summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self.write_summary(self._summary(value=values), step, flush)

    def write_summary(self, summary: Any, step: int, flush: bool = False) -> None:
        """Appends one event holding `summary` (a tensorboard `Summary` proto) at `step`."""
        self._file.add_event(self._event(wall_time=time.time(), step=step, summary=summary))
        if flush:
            self._file.flush()

    def flush(self) -> None:
        """Pushes queued events to disk."""
        self._file.flush()

    def close(self) -> None:
        """Flushes and closes the file."""
        self._file.close()


class TensorBoardTracker(GeneralTracker):
    """Writes to TensorBoard event files in `{logging_dir}/{run_name}` (Accelerate's layout).

    Numbers become scalars (all of one `log` call in one event), strings become text, nested
    dicts become "outer/inner" tags. `store_init_configuration` writes the hparams plugin's
    session summary, which TensorBoard's HPARAMS tab shows. `tracker` (and `writer`) is a
    torch `SummaryWriter` on the same folder, opened on first use, for images, histograms and
    the rest of its API.

    Args:
        run_name: The run's folder name under `logging_dir`.
        logging_dir: The folder holding the runs.
        purge_step: For a resumed run: points that earlier event files of this folder hold at
            this step or later are hidden (see `EventWriter`).
        **kwargs: Passed to the `SummaryWriter` that `tracker` opens.
    """

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, purge_step: int | None = None,
                 **kwargs: Any) -> None:
        self.logging_dir = os.path.join(os.fspath(logging_dir), run_name)
        self._events: EventWriter | None = EventWriter(self.logging_dir, purge_step)
        self._writer_kwargs = kwargs
        self._writer: Any = None
        self._next_step = 0

    @classmethod
    def for_run(cls, run: RunInfo, **kwargs: Any) -> "TensorBoardTracker":
        return cls(run.name, run.logs_dir, purge_step=run.purge_step, **kwargs)

    @property
    def tracker(self) -> Any:
        """A torch `SummaryWriter` on this run's folder (a second event file, opened on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # slow to import: only for users who ask

            self._writer = SummaryWriter(self.logging_dir, **self._writer_kwargs)
        return self._writer

    writer = tracker

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Writes `values` (flattened; other types as their repr) as the hparams plugin's session start."""
        self._write(_hparams_summary(hparams_of(values, "TensorBoardTracker")), 0, flush=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Writes numbers as scalars and strings as text, all at `step` (None: the next step)."""
        check_values(values, "TensorBoardTracker")
        if kwargs:
            raise TypeError(f"`TensorBoardTracker.log` takes no extra arguments. Received: {sorted(kwargs)}.")
        scalars: dict[str, float] = {}
        texts: dict[str, str] = {}
        for name, value in flatten(values):
            number = as_number(value)
            if number is not None:
                scalars[name] = number
            elif isinstance(value, str):
                texts[name] = value
            else:
                raise unloggable("TensorBoardTracker", name, value)
        step = self._next_step if step is None else int(step)
        self._next_step = step + 1
        if self._events is None:
            return
        if scalars:
            self._events.write(scalars, step)
        if texts:
            self._events.write_summary(_text_summary(texts), step)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        """The Logger's fast path: floats only, already checked, one event."""
        self._next_step = step + 1
        if self._events is not None:
            self._events.write(scalars, step)

    def purge(self, step: int) -> None:
        """Hides the points this folder's earlier event files hold at `step` or later (a crashed
        run's, which a resumed run writes again)."""
        if self._events is not None:
            self._events.purge(step)

    def _write(self, summary: Any, step: int, flush: bool = False) -> None:
        if self._events is not None:
            self._events.write_summary(summary, step, flush)

    def flush(self) -> None:
        if self._events is not None:
            self._events.flush()

    def finish(self) -> None:
        """Closes the event file (and the SummaryWriter, if one was opened)."""
        if self._events is not None:
            self._events.close()
            self._events = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _hparams_summary(hparams: dict[str, bool | int | float | str]) -> Any:
    """The hparams plugin's session-start summary, built from its protos directly (the plugin's
    own `summary_v2.hparams_pb` would import a tensor library stub worth a quarter second)."""
    # Imported on use, as in EventWriter: tensorboard is slow to import, and optional.
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, value in sorted(hparams.items()):
        if isinstance(value, bool):
            start.hparams[name].bool_value = value
        elif isinstance(value, (int, float)):
            start.hparams[name].number_value = value
        else:
            start.hparams[name].string_value = value
    content = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=start).SerializeToString()
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="hparams", content=content))
    empty = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=0)]))
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag="_hparams_/session_start_info", metadata=metadata, tensor=empty)])


def _text_summary(texts: dict[str, str]) -> Any:
    """Strings as text-plugin summaries (what `SummaryWriter.add_text` writes)."""
    # Imported on use, as in EventWriter: tensorboard is slow to import, and optional.
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorboard.plugins.text import plugin_data_pb2

    content = plugin_data_pb2.TextPluginData(version=0).SerializeToString()
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text", content=content))
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(
        tag=name, metadata=metadata, tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, string_val=[text.encode()], tensor_shape=tensor_shape_pb2.TensorShapeProto()))
        for name, text in texts.items()])


def _event_files(folder: str) -> set[str]:
    return {n for n in os.listdir(folder) if n.startswith("events.out.tfevents.")} if os.path.isdir(folder) else set()


def _last_in_order(folder: str, writer: Any) -> Any:
    """An EventFileWriter whose file sorts after the folder's earlier ones.

    TensorBoard reads a folder's event files in name order, and a purge hides only the points
    read before it. A file this process opens in the same second as an earlier one can sort
    first (the name's counter going from 9 to 10); it is then opened again in the next second.
    """
    for _ in range(3):
        before = _event_files(folder)
        opened = writer(folder)
        mine = sorted(_event_files(folder) - before)
        if not before or not mine or mine[-1] > max(before):
            return opened
        opened.close()
        os.remove(os.path.join(folder, mine[-1]))
        time.sleep(1.0 - time.time() % 1.0 + 0.01)
    return writer(folder)
