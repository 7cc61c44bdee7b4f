"""What the benchmark scripts share: their command lines, the line that says where and when a figure
was measured, timing, a plain training step, nanoGPT's model, launching fresh processes, and (the
last part) every use of the trainer's and the snapshots' internals, so that a change to those is
met here.

Not a benchmark itself (the leading underscore: tests/test_benchmarks.py runs every other script
here)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import importlib.util
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
# The scripts run from a clone without installing; mingpt is imported inside the functions below.
sys.path.insert(0, str(REPO))


# Command lines


def fail(message: str) -> NoReturn:
    """End the script as the library's commands end on bad input: one `error:` line on stderr, exit
    status 2."""
    from mingpt.cli import fail as cli_fail

    cli_fail(message)


def run_main(main: Callable[[], None]) -> None:
    """The script's `main`; a user error of the library (a corpus that is not there, a device this
    machine lacks, a value the config refuses) ends it in one line, as main.py ends."""
    from mingpt.cli import USER_ERRORS

    try:
        main()
    except USER_ERRORS as e:
        fail(str(e))


class Options(argparse.ArgumentParser):
    """argparse with its errors in one line (no usage banner), as the training command says them."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def parser(doc: str) -> Options:
    """The script's options, with its docstring as --help."""
    return Options(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least `low`."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a number >= {low}, got {value}")
        return value

    return whole_number


positive = at_least(1)


def device(text: str) -> str:
    """An argparse type: a device of this machine (cpu, cuda, cuda:N), as given."""
    try:
        chosen = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if chosen.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda are measured here")
    if chosen.type == "cpu":
        return text
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}, but CUDA is not available")
    if chosen.index is not None and chosen.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text}, but this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return text


def nanogpt_checkout(text: str) -> str:
    """An argparse type: a directory holding nanoGPT's model.py."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text}: no such directory (give a checkout of karpathy/nanoGPT)"
        )
    if not os.path.isfile(os.path.join(text, "model.py")):
        raise argparse.ArgumentTypeError(
            f"{text}: no model.py in it (give a checkout of karpathy/nanoGPT)"
        )
    return text


def existing_file(text: str) -> str:
    """An argparse type: a file that is there and not empty."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if os.path.getsize(text) == 0:
        raise argparse.ArgumentTypeError(f"{text}: the file is empty")
    return text


def writable_dir(text: str) -> str:
    """An argparse type: a directory this process can write in, made if it is not there."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    try:
        os.makedirs(text, exist_ok=True)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: cannot create it: {e.strerror or e}") from None
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in it")
    return text


def parse(options: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the training config's overrides (key=value) given among them, in any order
    (an option of several values, such as --world 1 2, would take the overrides after it)."""
    overrides = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")]
    return options.parse_args([a for a in sys.argv[1:] if a not in overrides]), overrides


def _composed(overrides: list[str]) -> Any:
    """The composed config; an override it cannot take (a key not there, a value of the wrong type,
    a preset not there) ends the script in one line, as main.py says it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from mingpt.cli import CONF_DIR, config_error_line
    from mingpt.config import register_configs

    register_configs()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        fail(config_error_line(e))


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _value(tree: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return KeyError
        tree = tree[part]
    return tree


def with_defaults(defaults: list[str], given: list[str]) -> list[str]:
    """Hydra overrides: the script's `defaults`, then the user's `given`, with each default left out
    where the user decides that key: the same key given, a preset of its group chosen
    (`gpt_config=gpt2` decides every gpt_config.* key), or a composed value the user's overrides
    change (an experiment's keys). Hydra applies a key override after every preset, whatever its
    place in the list, so without this `gpt_config.n_layer=4` of a script beat the user's
    gpt_config=gpt2."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(_composed([]), resolve=False)
    theirs = OmegaConf.to_container(_composed(list(given)), resolve=False)
    keys = [_key(g) for g in given]

    def decided(default: str) -> bool:
        key = _key(default)
        if any(key == k or key.startswith(k + ".") for k in keys):
            return True
        before = _value(plain, key)  # a preset (a group's choice) stays unless chosen again
        return not isinstance(before, dict) and before != _value(theirs, key)

    return [d for d in defaults if not decided(d)] + list(given)


def training_config(defaults: list[str], given: list[str]) -> Any:
    """The training config (mingpt.config.Config): the user's overrides over the script's
    defaults."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from mingpt.cli import config_error_line
    from mingpt.config import ConfigError

    composed = _composed(with_defaults(defaults, given))
    try:
        return OmegaConf.to_object(composed)
    except ConfigError as e:  # the values' checks (mingpt.config), a value out of its range
        fail(str(e))
    except OmegaConfBaseException as e:
        fail(config_error_line(e))


# Where and when


def _cpu_name() -> str:
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return platform.processor() or platform.machine()


def machine(device: torch.device | str = "cpu", threads: int | None = None) -> str:
    """The line printed with every result: the date, the CPU, its cores and the threads torch uses
    (`threads`: those of the processes that measured, where not this one's), torch, the GPU, the
    load."""
    threads = torch.get_num_threads() if threads is None else threads
    parts = [
        datetime.datetime.now().isoformat(sep=" ", timespec="seconds"),
        f"{_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} on {threads} threads",
    ]
    if torch.device(device).type == "cuda":
        parts.append(torch.cuda.get_device_name(device))
    parts.append(f"load {os.getloadavg()[0]:.1f}")
    return "machine: " + " | ".join(parts)


# Timing


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work: a time taken after it includes that work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def seconds(run: Callable[[], Any], device: torch.device | str = "cpu") -> float:
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def medians(
    runs: dict[str, Callable[[], float]], rounds: int, warm_up: int = 0
) -> dict[str, float]:
    """Each run's median result (seconds it measured) over `rounds` rounds after `warm_up` more, the
    runs in turn in every round: a drift in the machine's speed hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(warm_up + rounds):
        for name, run in runs.items():
            result = run()
            if r >= warm_up:
                times[name].append(result)
    return {name: statistics.median(t) for name, t in times.items()}


def rss(field: str) -> int:
    """A field of /proc/self/status in bytes: VmRSS now, VmHWM the most since reset_peak()."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from now on


# A plain training step, and nanoGPT's model


class Plain(NamedTuple):
    """A model stepped in a plain loop: `forward` is the model, or the model wrapped; `no_sync`
    holds back DDP's all-reduce in the backward of a micro-batch that accumulates."""

    model: nn.Module
    forward: Callable
    optimizer: torch.optim.Optimizer
    clip: float = 1.0
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def plain_step(
    p: Plain,
    x: torch.Tensor,
    y: torch.Tensor,
    autocast: Any = None,
    mark: Callable[[str], None] = lambda phase: None,
    weight: float = 1.0,
) -> None:
    """Forward, backward, gradient clipping and the optimizer's step, as a bare loop writes them;
    `mark(phase)` at the end of each phase. `weight`: the loss's share of an accumulated step's (the
    last micro-batch's, whose backward all-reduces)."""
    with autocast or contextlib.nullcontext():
        _, loss = p.forward(x, y)
    mark("forward")
    if weight != 1.0:
        loss = loss * weight
    loss.backward()
    mark("backward")
    nn.utils.clip_grad_norm_(p.model.parameters(), p.clip)
    p.optimizer.step()
    p.optimizer.zero_grad(set_to_none=True)
    mark("optimizer")


def nanogpt(
    directory: str,
    shape: Any,
    bias: bool,
    betas: tuple[float, float],
    weight_decay: float,
    learning_rate: float,
    device: torch.device,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """nanoGPT's GPT at `shape` (a mingpt GPTConfig) with its own configure_optimizers, from the
    model.py of a checkout of karpathy/nanoGPT (imported there, never copied here)."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", Path(directory) / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.GPTConfig(
        block_size=shape.block_size,
        vocab_size=shape.vocab_size,
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        dropout=shape.dropout,
        bias=bias,
    )
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter counts, its AdamW's kind
        model = module.GPT(config).to(device)
        optimizer = model.configure_optimizers(weight_decay, learning_rate, betas, device.type)
    return model, optimizer


# Fresh processes


def launch(
    nproc: int, argv: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`argv` (a script and its arguments) in fresh processes, python for one and torchrun for more,
    with this repository on PYTHONPATH (the caller's own paths kept) and `env` set; its output
    caught."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run(
        [*launcher, *argv],
        env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
    )


def result_of(proc: subprocess.CompletedProcess, what: str) -> dict:
    """The JSON line a child printed last (rank 0's), or exit with its error."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        sys.exit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# The trainer's and the snapshots' internals: the benchmarks reach them through here alone.


@contextlib.contextmanager
def trainer(config: Any, info: Any, data: Any = None) -> Iterator[Any]:
    """The Trainer main.py builds for `config` (a copy: building fits it to the data) in a temporary
    run directory."""
    from mingpt.run import build

    with tempfile.TemporaryDirectory() as run_dir:
        built = build(copy.deepcopy(config), info, run_dir, data)
        try:
            yield built
        finally:
            built.metrics.close()


def fitted(config: Any, data: Any) -> Any:
    """config.gpt_config with the data's vocabulary and the block size, as the trainer fits it."""
    from mingpt.run import fit_to_data

    return fit_to_data(config.gpt_config, data.tokenizer.vocab_size, config.data_config.block_size)


def samples_per_step(t: Any) -> int:
    """Windows of one rank's optimizer step (batch size x accumulation)."""
    return t.samples_per_step


def step(t: Any, indices: torch.Tensor) -> None:
    """Trainer.train_step on training windows `indices`; then the step count goes on, as in the loop
    (the schedule's learning rate and dropout's reseeding follow it)."""
    t.train_step(indices.to(t.train_windows.tokens.device))
    t.state.step += 1


def backward(t: Any, indices: torch.Tensor) -> None:
    """A forward and backward of the trainer's model: the gradients that a step holds."""
    x, y = t.train_windows.batch(indices.to(t.train_windows.tokens.device))
    t.model(x, y)[1].backward()


def state(t: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The trainer's model (unwrapped, sharded with fsdp) and optimizer."""
    return t.raw_model, t.optimizer


def ddp_module(t: Any) -> nn.Module:
    """What the trainer's step calls: the DDP module under torchrun with ddp."""
    return t.model


def stop_check(t: Any) -> None:
    """The trainer's decision of every step (stop? save due?): a small all-reduce under torchrun."""
    t.checkpointer._agree()


def save_snapshot(t: Any, at_step: int) -> int:
    """The run's own save at `at_step`, waited for until published (a background save included);
    the snapshot's bytes on rank 0 (0 elsewhere)."""
    from mingpt.snapshot import manifest, sharded

    t.state.step = at_step  # another position: the save writes again
    t.checkpointer._save(t.state)
    sharded.wait_pending()
    if not t.dist.is_main_process:
        return 0
    newest = manifest.latest(t.snapshot_path)
    return sum(f.stat().st_size for f in Path(newest).iterdir())


def train_to_end(config: Any, info: Any, data: Any) -> list[dict]:
    """Trainer.train() of `config` in a temporary run directory: its train events (rank 0's)."""
    from mingpt.run import build

    with tempfile.TemporaryDirectory() as run_dir:
        build(copy.deepcopy(config), info, run_dir, data).train()
        if not info.is_main_process:
            return []
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            events = [json.loads(line) for line in f]
    return [e for e in events if e["split"] == "train"]


def train_timed(t: Any) -> tuple[float, float, list[float]]:
    """Trainer.train() with its batch reads and steps timed: when the first step ended
    (time.time()), the seconds spent reading batches after it (`batch`, and `prefetch` outside the
    step), and each step's seconds."""
    windows = t.train_windows
    reads = [0.0]
    steps: list[float] = []
    first_end: list[float] = []

    def timed(read: Callable) -> Callable:
        def call(indices: torch.Tensor) -> Any:
            start = time.perf_counter()
            out = read(indices)
            reads[0] += time.perf_counter() - start
            return out

        return call

    train_step = t.train_step

    def timed_step(indices: torch.Tensor) -> Any:
        start = time.perf_counter()
        out = train_step(indices)
        steps.append(time.perf_counter() - start)
        if not first_end:
            first_end.append(time.time())
            reads[0] = 0.0  # the first step's reads warm up
        return out

    # Instance attributes shadow the methods.
    windows.batch = timed(windows.batch)
    windows.prefetch = timed(windows.prefetch)
    t.train_step = timed_step
    t.train()
    return first_end[0], reads[0], steps


def heldout_loss(model: nn.Module, data: Any) -> float:
    """The trainer's evaluation of the whole held-out split, in one process."""
    from mingpt.distributed import DistInfo
    from mingpt.evaluation import evaluate

    one = DistInfo(
        rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")
    )
    return evaluate(model, data.heldout, one, eval_tokens=0, batch_size=64).loss


def shard(model: nn.Module, info: Any) -> None:
    """FSDP2 over every rank, in place, as the trainer shards with parallelism=fsdp."""
    from mingpt import parallel

    parallel.shard(model, info, None)


def run_saver(
    root: str, model: nn.Module, optimizer: Any, info: Any, async_save: bool
) -> Callable[[int], Any]:
    """The run's own save (Distributed Checkpoint, each rank its shards) of `model` and `optimizer`
    under `root`, with the trainer's finiteness check: save(step) returns once training may go on;
    the future it returns (done(), result()) follows a background write."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from mingpt.checkpointer import NotFinite
    from mingpt.distributed import all_max
    from mingpt.snapshot import sharded

    def save(at_step: int) -> Any:
        model_state, optim_state = get_state_dict(model, optimizer)
        # Every rank agrees: with FSDP each holds other shards.
        if all_max(info, [int(not finite_check(model_state.values()))])[0]:
            raise NotFinite("the weights are not finite")
        tensors = {"model": model_state, "optim": optim_state}
        return sharded.save(
            tensors, {"step": at_step}, root, at_step, keep=1, async_save=async_save
        )

    return save


def finite_check(tensors: Any) -> bool:
    """The trainer's check before every save, of this rank's shards, without its all-reduce."""
    from mingpt.checkpointer import all_finite

    return all_finite([t.to_local() if hasattr(t, "to_local") else t for t in tensors])


def save_file(state_dict: dict, path: str) -> None:
    """A single-file snapshot, export's format, which generate, score and init_from read."""
    from mingpt.snapshot import single_file

    single_file.save(state_dict, path)


def verify_file(data: bytes, path: str) -> None:
    """A single file's integrity check: every zip record's CRC-32."""
    from mingpt.snapshot import single_file

    single_file.verify(data, path)
