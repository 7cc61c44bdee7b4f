"""The README's commands in the order a newcomer types them: the Quick start's
`python main.py` (on a terminal), the same again, What next's training it longer
and fine-tuning, sampling, the scale-out under torchrun, then the export and the
`transformers` lines. Each is taken from the README's text, with a tiny model
appended, so a README that sends a command into another one's finished run fails
here."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import subprocess
import sys
import time

from conftest import (
    REPO,
    RUN_DEADLINE,
    TINY,
    child_env,
    on_cpu,
    read_snapshot,
    run_dir_of,
    run_each,
)

EXTRA = [*TINY, "trainer_config.max_steps=6", "trainer_config.device=cpu"]


def readme_line(pattern: str) -> str:
    """The first line of the README that matches `pattern`."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    line = re.search(rf"^.*{pattern}.*$", readme, re.M)
    assert line, f"no README line matches {pattern!r}"
    return line.group(0)


def readme_command(pattern: str) -> list[str]:
    """The first command line of the README that matches `pattern`, as words."""
    return shlex.split(readme_line(pattern).split("#")[0])


def main_args(words: list[str]) -> list[str]:
    """The words after main.py."""
    return words[words.index("main.py") + 1 :]


def train_steps(run_dir) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [e["step"] for e in map(json.loads, lines) if e["split"] == "train"]


def run_on_terminal(cmd: list[str], cwd, timeout: float = 240) -> tuple[int, str]:
    """Run `cmd` with stdout and stderr on a pseudo-terminal; its exit status and all it showed."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=child_env(), stdin=subprocess.DEVNULL, stdout=follower, stderr=follower
    )
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return status, b"".join(chunks).decode("utf-8", "replace")


def test_quick_start_then_scale_out_trains_both(tmp_path, corpus):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "input.txt").write_text(
        corpus.read_text(encoding="utf-8")[:20_000], encoding="utf-8"
    )

    quick = readme_command(r"&& python main\.py")  # `pip install -e . && python main.py`
    quick = main_args(quick[quick.index("&&") + 1 :])
    # On a terminal, as a newcomer runs it: the progress bar is on.
    status, shown = run_on_terminal(
        [sys.executable, str(REPO / "main.py"), *quick, *EXTRA], tmp_path
    )
    assert status == 0, shown[-3000:]
    # The bar's line is cleared before the sample header, which starts a line of its own.
    assert re.search(r"[\r\n]--- sample after step 6 ---", shown) and "]--- sample" not in shown, (
        shown[-3000:]
    )
    # The first log line's window holds the start-up: no ETA; the next one has it.
    logs = re.findall(r"train step (\d+) .*\| (elapsed \S+(?: eta \S+)?)\r?$", shown, re.M)
    assert [(step, "eta" in note) for step, note in logs] == [("5", False), ("6", True)], logs
    # The closing line, after the sample: the losses,
    # the snapshot and the command that samples from it.
    closing = shown.rstrip().splitlines()[-1]
    snapshot = run_dir_of(tmp_path, [*quick, *EXTRA]) / "snapshots"
    best = read_snapshot(snapshot)["best_eval_loss"]
    best_file = snapshot.with_name("snapshots-best")  # the best weights, beside the snapshots
    best_shown = re.escape(str(best_file.relative_to(tmp_path)))
    assert re.search(
        rf"done at step 6: held-out loss [\d.]+, best {best:.4f} at step \d \({best_shown}\) "
        r"\| snapshot ",
        closing,
    ), closing
    command = closing.split("sample from the best: ")[1].strip()
    assert shlex.split(command)[:3] == ["python", "-m", "mingpt.generate"]
    # where it was started
    assert shlex.split(command)[3] == f"snapshot_path={best_file.relative_to(tmp_path)}"

    # Then, one after another as typed: the same command again; What next's train-longer command;
    # its fine-tuning, on the text its line makes first. One process for the three main.py
    # commands (each is mostly importing torch), as `python main.py` runs them.
    made = subprocess.run(readme_line(r"^tail -c"), shell=True, cwd=tmp_path, env=child_env())
    assert made.returncode == 0 and (tmp_path / "mytext.txt").stat().st_size > 0
    # The README's command for the Quick start's run, with the tiny run's own bound raised as the
    # "already complete" line says: it continues runs/default.
    line = readme_line(r"^python main\.py .*allow_config_change=true")
    assert line.endswith("# continues runs/default"), line
    longer = [*quick, *main_args(shlex.split(line.split("#")[0])), *EXTRA]
    longer.append("trainer_config.max_steps=12")
    assert run_dir_of(tmp_path, longer) == snapshot.parent
    tune = [*main_args(readme_command(r"trainer_config\.init_from=runs/default ")), *EXTRA]
    assert run_dir_of(tmp_path, tune) not in (snapshot.parent, tmp_path / "runs" / "ddp2")
    # Sampling: the Quick start's closing command, and What next's from the fine-tuned run; and
    # What next's export of the Quick start's model. One process for these commands and the three
    # above (each is mostly importing torch), one after another as typed.
    sample = readme_command(r"^python -m mingpt\.generate snapshot_path=runs/mytext ")
    assert run_dir_of(tmp_path, tune) == tmp_path / sample[3].partition("=")[2]
    export = readme_command(r"^python -m mingpt\.export .* format=hf")
    assert export[1:3] == ["-m", "mingpt.export"], export
    commands = [(tmp_path, on_cpu(argv)) for argv in ([*quick, *EXTRA], longer, tune)]
    commands += [
        (
            tmp_path,
            [*shlex.split(command)[3:], "max_new_tokens=5", "device=cpu"],
            "mingpt.generate",
        ),
        (tmp_path, [*sample[3:], "max_new_tokens=5", "device=cpu"], "mingpt.generate"),
        (tmp_path, export[3:], "mingpt.export"),
        (tmp_path, [transformers_lines()], "-c"),
    ]
    results = run_each("mingpt.cli", commands)
    again, continued, tuned, best_sampled, tune_sampled, exported, loaded = results

    # The same command again finds its run complete and says what to type instead.
    assert again.returncode == 0, again.stderr[-3000:]
    line = next(
        line for line in again.stderr.splitlines() if "run already complete at step 6" in line
    )
    assert "nothing to train" in line and "add trainer_config.run_name=NAME" in line
    assert line.endswith("add trainer_config.max_steps=12 trainer_config.allow_config_change=true")

    assert continued.returncode == 0, continued.stderr[-3000:]
    assert f"resumed from {snapshot}: " in continued.stderr, continued.stderr[-3000:]
    assert train_steps(snapshot.parent) == [5, 6, 10, 12]

    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert re.search(r"initialised from \S*runs/default/snapshots-best ", tuned.stderr)

    assert best_sampled.returncode == 0 and best_sampled.stdout.strip(), best_sampled.stderr[-3000:]
    assert tune_sampled.returncode == 0 and tune_sampled.stdout.startswith("ROMEO:"), (
        tune_sampled.stderr
    )

    scale = readme_command(r"torchrun --standalone --nproc_per_node=2 main\.py")
    env = child_env()
    while re.fullmatch(r"[A-Z_]+=\S*", scale[0]):  # OMP_NUM_THREADS=1
        key, _, value = scale.pop(0).partition("=")
        env[key] = value
    assert scale[0] == "torchrun"
    launcher = scale[1 : scale.index("main.py")]
    args = [*main_args(scale), *EXTRA]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(REPO / "main.py"), *args]
    second = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "already complete" not in second.stderr
    run_dir = run_dir_of(tmp_path, args)
    assert run_dir != run_dir_of(tmp_path, [*quick, *EXTRA])
    assert train_steps(run_dir) == [5, 6]
    assert read_snapshot(run_dir / "snapshots")["world_size"] == 2

    # What next's last lines: the Quick start's model, exported, loads in `transformers` with
    # the README's own Python lines (run after the export, in its process).
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    text = loaded.stdout.rstrip("\n")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 5, loaded.stdout


def transformers_lines() -> str:
    """The README's Python lines that load the export in `transformers`, sampling 5 characters."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    (lines,) = re.findall(r"^```python\n(.*?)^```", readme, re.M | re.S)
    # The tiny model sees 16 characters: the prompt and 5 more fit.
    assert "max_new_tokens=50" in lines
    return lines.replace("max_new_tokens=50", "max_new_tokens=5")
