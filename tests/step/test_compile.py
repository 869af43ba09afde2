"""torch.compile through `Trainer(compile=...)` and `Accelerator(dynamo_backend=...)` (fittrain/step/compile.py).

What is checked, on the CPU:
- the options are checked (bad types, unknown keys, unknown backends), and nothing imports
  torch._dynamo unless a compile is asked for;
- the forward is compiled in place, so state_dict keys, checkpoints and `save_model` have no
  `_orig_mod.` prefix, and checkpoints move between compiled and plain models;
- fittrain's own per-step code adds no compilation: a counting backend sees as many graphs for
  two epochs of `Trainer.fit` with validation, checkpoints and a resume as for the same module
  compiled in a hand-written loop (the baseline is measured here, not assumed);
- a compiled run interrupted and resumed ends bitwise identical to an uninterrupted one;
- bf16 autocast wraps the compiled forward and still returns float32.

The tests use the "eager" backend or a counting backend, which trace with Dynamo but generate no
code, so they take seconds. One test, marked slow, uses inductor, the default backend.
"""

from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch._dynamo
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import DataLoader

from fittrain import Accelerator, Callback, Trainer, TrainModule
from fittrain.callbacks import Checkpointer
from fittrain.utils import TorchDynamoPlugin
from support.models import regression_data


class Counter:
    """A torch.compile backend that counts the graphs it is given and runs them as they are."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return graph.forward


class Net(TrainModule):
    """A small model with dropout, so that a resume must restore the RNG exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any) -> torch.Tensor:
        return self.training_step(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def loaders() -> tuple[DataLoader, DataLoader]:
    # Equal batch sizes (32 / 8, 16 / 8): a smaller last batch would add a dynamic-shape graph.
    return (DataLoader(regression_data(32, in_features=4, seed=1), batch_size=8, shuffle=True),
            DataLoader(regression_data(16, in_features=4, seed=1), batch_size=8))


def new_net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's caches (and its per-function recompile limit) are
    process-wide, so graphs compiled by one test would otherwise be reused or refused in the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("value, error, words", [
    ("yes", TypeError, ["`compile`", "'yes'", "True, False or a dict"]),
    (1, TypeError, ["`compile`", "compile=1"]),
    ({"mode": "default", "fulgraph": True}, ValueError, ["'fulgraph'", "Accepted keys", "fullgraph"]),
    ({"backend": "inductr"}, ValueError, ["compile['backend']", "'inductr'", "inductor", "eager"]),
    ({"mode": "fastest"}, ValueError, ["compile['mode']", "'fastest'", "default", "reduce-overhead", "max-autotune"]),
    ({"mode": "max-autotune", "options": {"max_autotune": True}}, ValueError,
     ["`compile`", "'mode' and 'options'", "Pass one"]),
])
def test_bad_compile_values_are_refused_by_name(value, error, words) -> None:
    with pytest.raises(error) as info:
        Trainer(compile=value)
    for word in words:
        assert word in str(info.value)


def test_a_mode_is_checked_for_inductor_only_and_in_a_dynamo_plugin() -> None:
    with pytest.raises(ValueError, match=r"`dynamo_plugin\['mode'\]` is not a mode of torch.compile's inductor"):
        Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(mode="fastest"))
    # Another backend receives the mode itself: torch.compile passes it on, so fittrain does too.
    assert Trainer(compile={"backend": "eager", "mode": "fastest"}) is not None


@pytest.mark.parametrize("value, error, words", [
    ("inductr", ValueError, ["`dynamo_backend`", "'inductr'", "Known backends", "aot_eager"]),
    (True, TypeError, ["`dynamo_backend`", "True", "Trainer(compile="]),
])
def test_bad_dynamo_backends_are_refused_by_name(value, error, words) -> None:
    with pytest.raises(error) as info:
        Accelerator(cpu=True, dynamo_backend=value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("value, options", [(None, None), ("no", None), ("NO", None),
                                            ("inductor", {"backend": "inductor"}),
                                            ("AOT_EAGER", {"backend": "aot_eager"})])
def test_dynamo_backend_takes_accelerates_spellings(value, options) -> None:
    assert Accelerator(cpu=True, dynamo_backend=value).compile_options == options


def test_compile_applies_to_a_given_accelerator_and_refuses_a_conflict() -> None:
    accelerator = Accelerator(cpu=True)
    trainer = Trainer(accelerator=accelerator, compile={"backend": "eager"})
    assert trainer.accelerator.compile_options == {"backend": "eager"}
    # The same options twice are fine; compile=False leaves the accelerator's own backend in force.
    assert Trainer(accelerator=Accelerator(cpu=True, dynamo_backend="inductor"), compile=True)
    assert Trainer(accelerator=Accelerator(cpu=True, dynamo_backend="eager")).accelerator.compile_options == {
        "backend": "eager"}
    with pytest.raises(ValueError, match="disagree"):
        Trainer(accelerator=Accelerator(cpu=True, dynamo_backend="eager"), compile={"mode": "max-autotune"})


@pytest.mark.subprocess
def test_no_compile_never_imports_dynamo() -> None:
    code = ("import sys, torch, fittrain\n"
            "from torch import nn\n"
            "acc = fittrain.Accelerator(cpu=True, dynamo_backend='no')\n"
            "fittrain.Trainer(compile=False)\n"
            "model = acc.prepare(nn.Linear(2, 2))\n"
            "acc.unwrap_model(model, keep_fp32_wrapper=False, keep_torch_compile=False)\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.stdout.strip() == "False", done.stderr


# ----------------------------------------------------------------------------- names and checkpoints


def test_prepare_compiles_in_place_and_unwrap_can_remove_it() -> None:
    counter = Counter()
    accelerator = Accelerator(cpu=True)
    accelerator.compile_options = {"backend": counter}
    net = new_net()
    model = accelerator.prepare(net)
    assert model is net and list(model.state_dict()) == list(new_net().state_dict())
    model(torch.randn(3, 4))
    assert counter.graphs == 1
    plain = accelerator.unwrap_model(model, keep_torch_compile=False)
    torch._dynamo.reset()  # a compiled forward would now compile again: it must not be called
    plain(torch.randn(3, 4))
    assert counter.graphs == 1


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights() -> None:
    # An EMA or teacher model made with copy.deepcopy after prepare must not run the original's forward.
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    model = accelerator.prepare(new_net()).eval()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    x = torch.randn(3, 4)
    plain = Net().eval()
    plain.load_state_dict(twin.state_dict())
    assert torch.equal(twin(x), plain(x))
    assert not torch.equal(model(x), twin(x))


def test_checkpoints_of_a_compiled_run_load_into_a_plain_model_and_back(tmp_path: pathlib.Path) -> None:
    train, val = loaders()
    trainer = Trainer(compile={"backend": "eager"}, max_epochs=1, project_dir=tmp_path,
                      callbacks=[Checkpointer(every_n_epochs=1)])
    trainer.fit(new_net(), train, val)
    trainer.accelerator.save_model(trainer.model, tmp_path / "export")
    saved = load_file(tmp_path / "checkpoints" / trainer.run_name / "checkpoint_0" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert not [k for k in [*saved, *exported] if "_orig_mod" in k]
    plain = Net()
    plain.load_state_dict(saved)  # strict: the same names as a plain model's
    assert_same(weights(plain), weights(trainer.module))
    assert_same(exported, weights(trainer.module))
    # And back: a plain run's checkpoint into a compiled model.
    plain_trainer = Trainer(max_epochs=1, project_dir=tmp_path / "plain", callbacks=[Checkpointer(every_n_epochs=1)])
    plain_trainer.fit(new_net(), train, val)
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    compiled = accelerator.prepare(Net())
    accelerator.load_state(tmp_path / "plain" / "checkpoints" / plain_trainer.run_name / "checkpoint_0")
    assert_same(weights(compiled), weights(plain_trainer.module))


def test_a_model_the_user_compiled_saves_without_orig_mod(tmp_path: pathlib.Path) -> None:
    # Accelerate's recipe: model = torch.compile(model), then prepare; its state_dict has "_orig_mod.".
    accelerator = Accelerator(cpu=True, project_dir=tmp_path)
    net = new_net()
    model = accelerator.prepare(torch.compile(net, backend="eager"))
    assert accelerator.unwrap_model(model) is net
    accelerator.save_model(model, tmp_path / "export")
    saved = accelerator.save_state(tmp_path / "state")
    assert sorted(load_file(tmp_path / "export" / "model.safetensors")) == sorted(net.state_dict())
    assert sorted(load_file(pathlib.Path(saved) / "model.safetensors")) == sorted(net.state_dict())
    accelerator.load_state(saved)


# ----------------------------------------------------------------------------- no extra compilation


def hand_written_graphs(epochs: int) -> int:
    """Graphs compiled for the same module in a plain loop: train steps, then validation under no_grad."""
    counter, net = Counter(), new_net()
    net.forward = torch.compile(net.forward, backend=counter)
    optimizer = net.configure_optimizers()
    train, val = loaders()
    for _ in range(epochs):
        net.train()
        for batch in train:
            optimizer.zero_grad()
            net.training_step(batch).backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            for batch in val:
                net.validation_step(batch)
    return counter.graphs


def test_trainer_adds_no_compilation_across_validation_checkpoints_and_resume(tmp_path: pathlib.Path) -> None:
    baseline = hand_written_graphs(epochs=2)
    assert baseline >= 1
    torch._dynamo.reset()
    train, val = loaders()
    counter = Counter()
    trainer = Trainer(compile={"backend": counter}, max_epochs=2, project_dir=tmp_path,
                      callbacks=[Checkpointer(every_n_steps=3)])
    trainer.fit(new_net(), train, val)
    assert counter.graphs == baseline
    # The resumed run (from step 6, mid-epoch 1 of 3) trains and validates: again the baseline.
    torch._dynamo.reset()
    resumed_counter = Counter()
    resumed = Trainer(compile={"backend": resumed_counter}, max_epochs=3, project_dir=tmp_path,
                      resume_from=tmp_path / "checkpoints" / trainer.run_name / "checkpoint_1",
                      callbacks=[Checkpointer(every_n_steps=3)])
    resumed.fit(new_net(), train, val)
    assert resumed.state.global_step == 12
    assert resumed_counter.graphs == baseline


# ----------------------------------------------------------------------------- exact resume


class Crash(Exception):
    pass


class CrashAt(Callback):
    """A callback that interrupts fit after the given optimizer step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.state.global_step == self.step:
            raise Crash(f"interrupted after step {self.step}")


def compiled_fit(tmp_path: pathlib.Path, backend: Any, crash_at: int | None = None, resume: str | None = None) -> Net:
    train, val = loaders()
    callbacks: list[Any] = [Checkpointer(every_n_steps=3)] + ([CrashAt(crash_at)] if crash_at else [])
    trainer = Trainer(compile={"backend": backend}, max_epochs=2, project_dir=tmp_path, resume_from=resume,
                      callbacks=callbacks)
    net = new_net()
    trainer.fit(net, train, val)
    return net


def check_exact_resume(tmp_path: pathlib.Path, backend: Any) -> None:
    whole = weights(compiled_fit(tmp_path / "whole", backend))
    with pytest.raises(Crash):
        compiled_fit(tmp_path / "cut", backend, crash_at=5)
    torch.manual_seed(1234)  # the resume must restore the RNG from the checkpoint, not rely on this
    resumed = weights(compiled_fit(tmp_path / "cut", backend, resume="latest"))
    assert_same(resumed, whole)


def test_an_interrupted_compiled_run_resumes_bitwise_exactly(tmp_path: pathlib.Path) -> None:
    check_exact_resume(tmp_path, "aot_eager")


@pytest.mark.subprocess
@pytest.mark.slow
def test_exact_resume_with_inductor(tmp_path: pathlib.Path) -> None:
    """The only test with inductor, the default backend, which generates and builds C++ (slow)."""
    check_exact_resume(tmp_path, "inductor")


# ----------------------------------------------------------------------------- mixed precision


def test_bf16_autocast_wraps_the_compiled_forward() -> None:
    x = torch.randn(5, 4)
    eager_acc = Accelerator(cpu=True, mixed_precision="bf16")
    eager = eager_acc.prepare(new_net()).eval()
    counter = Counter()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    accelerator.compile_options = {"backend": counter}
    compiled = accelerator.prepare(new_net()).eval()
    out = compiled(x)
    assert out.dtype == torch.float32 and counter.graphs == 1
    assert torch.equal(out, eager(x))
    # The Trainer drops the fp32 wrapper (it autocasts whole steps) but keeps the compiled forward.
    # Under the same autocast, the graph compiled through the wrapper serves again.
    accelerator.unwrap_model(compiled, keep_fp32_wrapper=False)
    with accelerator.autocast():
        assert compiled(x).dtype == torch.bfloat16
    assert counter.graphs == 1


def test_trainer_with_bf16_and_compile_matches_eager_bf16(tmp_path: pathlib.Path) -> None:
    from fittrain.callbacks import MixedPrecision

    train, val = loaders()
    results = []
    for compile_options in (False, {"backend": "eager"}):
        torch.manual_seed(3)
        trainer = Trainer(compile=compile_options, max_epochs=1, project_dir=tmp_path,
                          callbacks=[MixedPrecision("bf16")])
        trainer.fit(new_net(), train, val)
        results.append((weights(trainer.module), trainer.state.metrics["val_loss"]))
    assert_same(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]
