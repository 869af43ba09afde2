"""The writing side of checkpoints under real failures: two writers in one project folder, a full
disk, a process killed in the middle of replacing a folder, an unwritable folder, and states that
share or contain themselves (async copies). Everything uses real files and real processes.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

from fittrain import Accelerator, ProjectConfiguration, Trainer
from fittrain.callbacks import Checkpointer
from fittrain.checkpoint import CheckpointError, CheckpointReader, atomic_checkpoint, is_intact, list_checkpoints
from fittrain.checkpoint.background import StagingBuffers
from fittrain.checkpoint.renames import exchange
from fittrain.checkpoint.temp_folders import WRITER_MARKER, TempFolder, reserve_numbered
from fittrain.trainer.events import Callback
from support.models import Regressor, regression_loader

REPO = pathlib.Path(__file__).resolve().parents[2]
PROCESS_TIMEOUT = 300.0


def _leftovers(folder: pathlib.Path) -> list[str]:
    """Hidden temporary, backup or private folders left beside checkpoints."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _write_version(final: pathlib.Path, version: int, **kwargs) -> None:
    with atomic_checkpoint(final, **kwargs) as writer:
        writer.write_json("version.json", {"version": version})
        writer.write_bytes("payload.bin", bytes([version % 256]) * 1000)


def _version(final: pathlib.Path) -> int:
    return CheckpointReader(final).read_json("version.json")["version"]


# ---------------------------------------------------------------------------------------------
# 1. Two writers in one project folder.

WRITER_SCRIPT = textwrap.dedent("""
    import json, pathlib, sys, time
    import torch
    from fittrain import Accelerator, ProjectConfiguration

    project, go, saves = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True))
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    deadline = time.monotonic() + 120
    while not go.exists():  # both processes start saving together
        if time.monotonic() > deadline:
            sys.exit("no go signal")
        time.sleep(0.01)
    paths = [accelerator.save_state(async_save=i % 3 == 2) for i in range(saves)]
    accelerator.wait_for_checkpoint()
    print("PATHS=" + json.dumps(paths))
""")


def _start_writer(script: pathlib.Path, project: pathlib.Path, go: pathlib.Path, saves: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(project), str(go), str(saves)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.subprocess
def test_two_processes_saving_into_one_project_never_share_a_checkpoint(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER_SCRIPT)
    project, go, saves = tmp_path / "project", tmp_path / "go", 20
    procs = [_start_writer(script, project, go, saves) for _ in range(2)]
    try:
        go.touch()
        outputs = [proc.communicate(timeout=PROCESS_TIMEOUT)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    paths = [path for output in outputs
             for path in json.loads(output.split("PATHS=")[-1].strip().splitlines()[0])]
    assert len(set(paths)) == 2 * saves, "two saves returned the same folder"
    root = project / "checkpoints"
    finals = list_checkpoints(root)
    assert sorted(map(str, finals)) == sorted(paths)  # each returned path is the folder written
    assert [f.name for f in finals if not is_intact(f)] == []
    assert _leftovers(root) == []


def test_a_live_writers_temporary_folder_is_never_taken_over(tmp_path):
    final = tmp_path / "checkpoint_0"
    held = TempFolder.claim(tmp_path / ".checkpoint_0.tmp")  # this process: alive
    assert held is not None
    (held.path / "model.safetensors").write_bytes(b"half written")
    with pytest.raises(CheckpointError, match=f"process {os.getpid()}.*is writing it right now"):
        _write_version(final, 1)
    assert (held.path / "model.safetensors").read_bytes() == b"half written"
    # Automatic naming takes the next number instead.
    reserved = reserve_numbered(tmp_path, "checkpoint_", 0)
    assert reserved.number == 1 and reserved.path.name == ".checkpoint_1.tmp"
    reserved.release()
    held.release()
    assert _leftovers(tmp_path) == []


def _claim_in_a_process_that_exits(temp: pathlib.Path) -> None:
    """Claims `temp` in a real process that then exits, leaving a stale folder behind."""
    code = textwrap.dedent(f"""
        import pathlib
        from fittrain.checkpoint.temp_folders import TempFolder
        claimed = TempFolder.claim(pathlib.Path({str(temp)!r}))
        (claimed.path / "optimizer.pt").write_bytes(b"x" * 100)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=PROCESS_TIMEOUT, cwd=REPO)


@pytest.mark.subprocess
def test_a_dead_writers_temporary_folder_is_cleaned_up_and_its_number_reused(tmp_path):
    _claim_in_a_process_that_exits(tmp_path / ".checkpoint_0.tmp")
    assert (tmp_path / ".checkpoint_0.tmp" / "optimizer.pt").exists()
    reserved = reserve_numbered(tmp_path, "checkpoint_", 0)
    assert reserved.number == 0 and sorted(os.listdir(reserved.path)) == [WRITER_MARKER]
    with atomic_checkpoint(tmp_path / "checkpoint_0", reserved=reserved) as writer:
        writer.write_json("a.json", 1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_0"]
    assert sorted(os.listdir(tmp_path / "checkpoint_0")) == ["a.json", "manifest.json"]


# ---------------------------------------------------------------------------------------------
# 2. Failures while saving: the temporary folder always goes, the previous checkpoint stays.

@pytest.fixture
def small_disk(tmp_path):
    """A real 512 KiB tmpfs (root only), unmounted afterwards whatever happens."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                          capture_output=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


def _fill(disk: pathlib.Path, leave: int = 0) -> pathlib.Path:
    """Fills the disk with a file until `leave` bytes (or none) are free."""
    filler = disk / "filler"
    with open(filler, "ab", buffering=0) as f:
        while True:
            stats = os.statvfs(disk)
            room = stats.f_bavail * stats.f_frsize - leave
            if room <= 0:
                return filler
            try:
                f.write(b"\0" * min(room, 64 * 1024))
            except OSError as err:
                assert err.errno == errno.ENOSPC
                return filler


def _assert_no_space_error(err: OSError, folder: pathlib.Path) -> None:
    assert err.errno == errno.ENOSPC
    assert "No space left on device" in str(err) and str(folder) in str(err)


def test_full_disk_inside_torch_save_is_an_oserror_naming_the_folder(small_disk):
    final = small_disk / "ckpt"
    _write_version(final, 1)
    with pytest.raises(OSError) as caught:
        with atomic_checkpoint(final) as writer:
            writer.write_json("version.json", {"version": 2})
            writer.write_torch("big.pt", {"t": torch.zeros(300_000)})  # 1.2 MB on a 512 KiB disk
    _assert_no_space_error(caught.value, final)
    assert "big.pt" in str(caught.value)
    assert _version(final) == 1 and is_intact(final)
    assert sorted(os.listdir(small_disk)) == ["ckpt"]  # the partial folder is gone
    _write_version(final, 3)  # the space came back
    assert _version(final) == 3


def test_full_disk_at_the_manifest_removes_the_folder_and_a_retry_succeeds(small_disk):
    final = small_disk / "ckpt"
    _write_version(final, 1)
    with pytest.raises(OSError) as caught:
        with atomic_checkpoint(final) as writer:
            writer.write_json("version.json", {"version": 2})
            filler = _fill(small_disk)  # files written; nothing left for the manifest
    _assert_no_space_error(caught.value, final)
    assert _version(final) == 1 and is_intact(final)
    assert sorted(os.listdir(small_disk)) == ["ckpt", "filler"]
    filler.unlink()
    _write_version(final, 2)
    assert _version(final) == 2 and sorted(os.listdir(small_disk)) == ["ckpt"]


def test_save_state_on_a_full_disk_fails_cleanly_and_succeeds_once_there_is_room(small_disk):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(small_disk / "run"), automatic_checkpoint_naming=True))
    model = nn.Linear(64, 64)
    model, optimizer = accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    first = pathlib.Path(accelerator.save_state())
    filler = _fill(small_disk, leave=16 * 1024)  # less than one checkpoint (about 70 KB)
    root = small_disk / "run" / "checkpoints"
    for async_save in (False, True):
        with pytest.raises(OSError) as caught:
            accelerator.save_state(async_save=async_save)
            accelerator.wait_for_checkpoint()
        assert caught.value.errno == errno.ENOSPC and "No space left on device" in str(caught.value)
        assert str(root / "checkpoint_") in str(caught.value)
        assert os.listdir(root) == [first.name] and is_intact(first)
    filler.unlink()
    retried = pathlib.Path(accelerator.save_state())
    assert is_intact(retried) and is_intact(first)
    assert _leftovers(root) == []


def test_a_failed_manifest_write_removes_the_temporary_folder(tmp_path):
    final = tmp_path / "ckpt"
    _write_version(final, 1)
    with pytest.raises(IsADirectoryError):
        with atomic_checkpoint(final) as writer:
            writer.write_json("version.json", {"version": 2})
            (writer.path / "manifest.json").mkdir()  # the manifest cannot be created
    assert _version(final) == 1 and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_automatic_naming_never_replaces_a_folder_that_appeared_meanwhile(tmp_path):
    reserved = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True
                                    ).reserve_next_checkpoint()
    root = tmp_path / "checkpoints"
    final = root / f"checkpoint_{reserved.number}"
    with pytest.raises(CheckpointError, match="appeared while this save was writing it"):
        with atomic_checkpoint(final, reserved=reserved) as writer:
            writer.write_json("version.json", {"version": 2})
            final.mkdir()  # another program takes the name before the rename
            (final / "theirs.txt").write_text("keep me")
    assert (final / "theirs.txt").read_text() == "keep me"
    assert sorted(os.listdir(root)) == [final.name]  # the temporary folder is gone


# ---------------------------------------------------------------------------------------------
# 3. Replacing a folder: the old or the new one is there at every moment.

def test_exchange_swaps_two_folders_in_one_system_call(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2(RENAME_EXCHANGE) is Linux-only")
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    inodes = (first.stat().st_ino, second.stat().st_ino)
    assert exchange(first, second) is True  # used on this machine, not the fallback
    assert (first.stat().st_ino, second.stat().st_ino) == inodes[::-1]


# Audit events of the calls that change the file system (`open` only when it writes).
_MUTATIONS = {"os.rename", "os.replace", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree",
              "os.truncate"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _is_mutation(event: str, args: tuple) -> bool:
    if event == "open":
        mode, flags = args[1], args[2]
        return bool(isinstance(flags, int) and flags & _WRITE_FLAGS) or any(c in str(mode or "") for c in "wax+")
    return event in _MUTATIONS


def _overwrite_killed_at(final: pathlib.Path, version: int, step: int) -> int:
    """Overwrites `final` in a forked child that SIGKILLs itself before its `step`-th file system
    change; returns the child's wait status (0 when it finished first)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 3
        try:
            seen = [0]

            def hook(event: str, args: tuple) -> None:
                if _is_mutation(event, args):
                    seen[0] += 1
                    if seen[0] == step:
                        os.kill(os.getpid(), signal.SIGKILL)

            sys.addaudithook(hook)
            _write_version(final, version)
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the writer killed at step {step} hung")
        time.sleep(0.005)


def test_a_kill_at_any_moment_of_an_overwrite_leaves_the_old_or_the_new_folder(tmp_path):
    final = tmp_path / "ckpt"
    _write_version(final, 0)
    current = 0
    for step in range(1, 100):
        status = _overwrite_killed_at(final, step, step)
        assert final.is_dir() and is_intact(final), f"killed before change {step}: no intact folder"
        assert _version(final) in (current, step)
        current = _version(final)
        if status == 0:  # finished before its `step`-th change: every moment was covered
            break
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    else:
        pytest.fail("the writer never finished")
    assert current == step and step > 5
    assert _leftovers(tmp_path) == []  # no `.ckpt.old`, and the killed writers' folders were cleaned
    assert sorted(os.listdir(final)) == ["manifest.json", "payload.bin", "version.json"]  # no marker


def test_a_file_in_the_way_is_refused_not_deleted(tmp_path):
    final = tmp_path / "ckpt"
    final.write_text("my notes")
    with pytest.raises(NotADirectoryError, match="a file of that name exists"):
        _write_version(final, 1)
    assert final.read_text() == "my notes" and os.listdir(tmp_path) == ["ckpt"]


# ---------------------------------------------------------------------------------------------
# 4. An unwritable checkpoint folder fails when fit starts, not at the first save.

class _StepCount(Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, trainer) -> None:
        self.steps += 1


def _fit_with_checkpoints(project: pathlib.Path) -> _StepCount:
    counter = _StepCount()
    loader = regression_loader(8, batch_size=2)
    trainer = Trainer(project_dir=project, max_epochs=1, callbacks=[counter, Checkpointer(every_n_steps=1)])
    try:
        trainer.fit(Regressor(), loader)
    finally:
        assert counter.steps == 0, "the folder must be checked before the first step"
    return counter


def test_a_project_dir_under_a_file_fails_when_fit_starts(tmp_path):
    (tmp_path / "a_file").write_text("x")
    project = tmp_path / "a_file" / "run"
    with pytest.raises(OSError, match="Checkpointer cannot write checkpoints to") as caught:
        _fit_with_checkpoints(project)
    assert str(project / "checkpoints") in str(caught.value) and "writable project_dir" in str(caught.value)


def test_a_read_only_project_dir_fails_when_fit_starts(tmp_path):
    project = tmp_path / "read_only"
    project.mkdir()
    if os.geteuid() == 0:  # root ignores permissions: mount a read-only file system instead
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(project)],
                              capture_output=True, timeout=30)
        if done.returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        project.chmod(0o555)
    try:
        with pytest.raises(OSError, match="Checkpointer cannot write checkpoints to") as caught:
            _fit_with_checkpoints(project)
        assert caught.value.errno in (errno.EROFS, errno.EACCES)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", "-l", str(project)], check=False, timeout=30)
        project.chmod(0o755)


# ---------------------------------------------------------------------------------------------
# 5. Async copies of states that share parts or contain themselves.

def test_a_state_that_shares_its_parts_is_copied_once_per_part():
    tensor = torch.ones(2)
    shared: list = [tensor]
    for _ in range(22):  # 2**22 paths to the innermost list: a copy per path would take seconds
        shared = [shared, shared]
    buffers = StagingBuffers()
    buffers.reset()
    copy = buffers.copy({"scheduler": shared})
    assert copy["scheduler"][0] is copy["scheduler"][1]  # sharing kept, as deepcopy keeps it
    inner = copy["scheduler"]
    for _ in range(22):
        inner = inner[0]
    assert torch.equal(inner[0], tensor) and inner[0] is not tensor


def test_a_state_that_contains_itself_is_refused_with_a_clear_error():
    cyclic: dict = {"lr": 0.1}
    cyclic["self"] = [cyclic]
    buffers = StagingBuffers()
    buffers.reset()
    with pytest.raises(ValueError, match="contains itself.*async_save=False"):
        buffers.copy({"scheduler": cyclic})


# ---------------------------------------------------------------------------------------------
# 6. ProjectConfiguration(iteration=...).

@pytest.mark.parametrize("iteration", [-3, "3", 1.5, True, None])
def test_iteration_must_be_a_non_negative_int(iteration):
    with pytest.raises(ValueError, match=r"ProjectConfiguration\(iteration=\.\.\.\)` must be an int >= 0"):
        ProjectConfiguration(iteration=iteration)
    assert ProjectConfiguration(iteration=4).iteration == 4
