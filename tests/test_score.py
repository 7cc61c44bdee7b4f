"""mingpt.score: the held-out split scored exactly as the run's final evaluation, any
text file, a character outside the vocabulary, bad input; eval events carry perplexity."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import child_env, free_port

from mingpt import export, generate
from mingpt.config import DataConfig
from mingpt.data import cache_location
from mingpt.score import ScoreConfig, main, score
from mingpt.snapshot.reader import load_model


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch):
    """The CLI sets up logging to the (captured) stderr: put the root logger back after."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)


def last_eval(run_dir) -> dict:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [e for e in events if e["split"] == "eval"][-1]


def test_held_out_split_scores_as_the_runs_last_evaluation(
    tiny_run, monkeypatch, capsys, one_thread
):
    cwd, run_dir = tiny_run
    monkeypatch.chdir(cwd)  # the run's data_config.path is relative to where it ran
    final = last_eval(run_dir)
    assert final["step"] == 60 and final["perplexity"] == pytest.approx(
        math.exp(final["loss"]), rel=1e-12
    )
    for snapshot in (run_dir, run_dir / "snapshots"):
        result = score(ScoreConfig(snapshot_path=str(snapshot), device="cpu"))
        assert result.loss == pytest.approx(final["loss"], rel=1e-6, abs=0)
        assert result.tokens == final["tokens"] and result.step == 60
        assert result.bpc == pytest.approx(final["bpc"], rel=1e-6)
    main([f"snapshot_path={run_dir}", "device=cpu"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"{run_dir} (step 60) on the held-out split of small.txt: "
        f"{final['tokens']:,} characters scored"
    )
    loss, bpc, perplexity = (float(line.split()[1]) for line in out[1:])
    assert loss == pytest.approx(final["loss"], abs=1e-6) and bpc == pytest.approx(
        final["bpc"], abs=1e-6
    )
    assert perplexity == pytest.approx(final["perplexity"], abs=1e-5)


def test_one_character_scored_is_said_in_the_singular(tiny_run, tmp_path, capsys):
    """It said 1 characters scored."""
    _, run_dir = tiny_run
    path = tmp_path / "two.txt"
    path.write_text("RO", encoding="utf-8")
    main([f"snapshot_path={run_dir}", f"path={path}", "device=cpu"])
    assert capsys.readouterr().out.splitlines()[0].endswith(": 1 character scored")


def test_a_text_file_is_scored_window_by_window(tiny_run, tmp_path, one_thread):
    _, run_dir = tiny_run
    model, tokenizer, _ = load_model(str(run_dir), torch.device("cpu"))
    block = model.config.block_size
    text = "ROMEO:\nWhat light through yonder window breaks? It is the east."[: 2 * block + 5]
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    result = score(ScoreConfig(snapshot_path=str(run_dir), path=str(path), device="cpu"))
    # Two whole windows of block_size, each predicted from its own start, then the 4 characters
    # after them, predicted from the last whole window's last character.
    tokens = tokenizer.encode(text).long()
    windows = torch.stack([tokens[i * block : (i + 1) * block + 1] for i in range(2)])
    with torch.no_grad():
        logits, _ = model(windows[:, :-1])
        tail, _ = model(tokens[None, 2 * block : -1])
    expected = F.cross_entropy(
        torch.cat([logits.reshape(-1, logits.size(-1)), tail[0]]),
        torch.cat([windows[:, 1:].reshape(-1), tokens[2 * block + 1 :]]),
    ).item()
    assert result.tokens == 2 * block + 4 and result.loss == pytest.approx(expected, rel=1e-6)
    assert result.perplexity == pytest.approx(
        math.exp(expected), rel=1e-6
    ) and result.source == str(path)
    # A text shorter than one window is one window of its whole length.
    path.write_text("ROMEO:", encoding="utf-8")
    short = score(ScoreConfig(snapshot_path=str(run_dir), path=str(path), device="cpu"))
    with torch.no_grad():
        logits, loss = model(tokens[None, :5], tokens[None, 1:6])
    assert short.tokens == 5 and short.loss == pytest.approx(loss.item(), rel=1e-6)


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_status:
        main(argv)
    err = capsys.readouterr().err
    assert exit_status.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize(
    "command, argv, key",
    [
        (main, [], "snapshot_path"),
        (generate.main, [], "snapshot_path"),
        (export.main, ["src=runs/default", "dst=out"], "src"),
    ],
    ids=["score", "generate", "export"],
)
def test_no_run_here_says_to_train_first(command, argv, key, tmp_path, monkeypatch, capsys):
    """Outside a directory that trained, runs/default (the default snapshot_path, and the docs'
    src) was only "not found". The command named trains here: `python main.py` in a clone's root,
    the installed command elsewhere, where `python main.py` was named and found no file."""
    monkeypatch.chdir(tmp_path)
    for train in ("mingpt-train", "python main.py"):
        with pytest.raises(SystemExit):
            command(argv)
        assert capsys.readouterr().err == (
            f"error: snapshot not found: runs/default (no run here: train one with {train}, or "
            f"give {key}=PATH)\n"
        )
        (tmp_path / "main.py").write_text("")  # a clone's root


def test_inside_a_run_directory_says_to_give_it(tiny_run, monkeypatch, capsys):
    """In runs/NAME (or a directory a config's hydra.run.dir: ./ trained in), the hint was to
    train a run first."""
    monkeypatch.chdir(tiny_run[1])
    assert refused(capsys, []) == (
        "error: snapshot not found: runs/default (this directory is a run's: give snapshot_path=.)"
    )


def test_bad_input_is_one_line(tiny_run, tmp_path, capsys):
    _, run_dir = tiny_run
    snapshot = f"snapshot_path={run_dir / 'snapshots'}"
    foreign = tmp_path / "foreign.txt"
    foreign.write_text("Romeo é~ Romeo\n", encoding="utf-8")
    assert refused(capsys, [snapshot, f"path={foreign}"]) == (
        f"error: {foreign} has characters outside the snapshot's vocabulary: '~' 'é'"
    )
    # A run directory: the log said which of its snapshots it took, then the error, before.
    assert refused(capsys, [f"snapshot_path={run_dir}", f"path={foreign}"]) == (
        f"error: {foreign} has characters outside the snapshot's vocabulary: '~' 'é'"
    )
    fifo = tmp_path / "text.fifo"
    os.mkfifo(fifo)  # a read would wait for a writer forever; /dev/zero's would never end
    assert (
        refused(capsys, [snapshot, f"path={fifo}"])
        == f"error: path is not a regular file: {fifo} is a FIFO"
    )
    assert refused(capsys, [snapshot, "path=/dev/zero"]) == (
        "error: path is not a regular file: /dev/zero is a device or socket"
    )
    assert (
        refused(capsys, [f"snapshot_path={fifo}"])
        == f"error: snapshot is not a regular file: {fifo} is a FIFO"
    )
    # path= named as its key, as prompt_file= is: "data file", before
    missing = tmp_path / "missing.txt"
    assert refused(capsys, [snapshot, f"path={missing}"]) == f"error: path not found: {missing}"
    url = f"http://127.0.0.1:{free_port()}/text.txt"  # a port nothing listens on
    assert refused(capsys, [snapshot, f"path={url}"]).startswith(
        f"error: cannot fetch path {url}: "
    )
    # a name with glob characters too (fsspec's error then has a cause, as a failed fetch's has),
    # and a glob, which score does not expand
    for missing in (tmp_path / "missing[1].txt", tmp_path / "*.txt"):
        assert refused(capsys, [snapshot, f"path={missing}"]) == (
            f"error: path not found: {missing} (one file's name: no glob is expanded here)"
        )
    # the held-out split of the run's relative corpus, from another directory
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit):
        patch.chdir(tmp_path)
        main([snapshot])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: the run's corpus: data file not found: small.txt (its data_config.path, read from "
        "the current directory as the run read it from its own: score from there, or give the "
        "text with path=...)"
    )
    assert refused(capsys, [f"snapshot_path={tmp_path / 'none.pt'}"]) == (
        f"error: snapshot not found: {tmp_path / 'none.pt'}"
    )
    assert refused(capsys, [snapshot, "batch=3"]) == (
        "error: unknown key batch (did you mean path? see --help)"
    )
    assert (
        refused(capsys, [snapshot, "device=tpu"])
        == "error: device: 'tpu' is not one of auto, cpu, cuda"
    )
    if not torch.cuda.is_available():
        assert (
            refused(capsys, [snapshot, "device=cuda"])
            == "error: device: cuda, but CUDA is not available"
        )


def test_a_record_whose_settings_no_run_has_is_one_line(
    tiny_run, tiny_file, tmp_path, monkeypatch, capsys
):
    """A crafted record's batch_size (0, or a string) reached torch, a traceback, as did windows
    longer than the model's context; a negative eval_tokens scored one window in silence."""
    from mingpt.snapshot import single_file

    cwd, _ = tiny_run
    monkeypatch.chdir(cwd)  # the run's data_config.path is relative to where it ran
    text = tmp_path / "text.txt"
    text.write_text("ROMEO: what is this thing\n")
    crafted = tmp_path / "crafted.pt"
    cases = [
        ("trainer_config", "batch_size", 0, [f"path={text}"], "0, not a whole number >= 1"),
        ("trainer_config", "batch_size", "12", [], "'12', not a whole number >= 1"),
        ("trainer_config", "eval_tokens", -5, [], "-5, not a whole number >= 0"),
    ]
    for section, name, value, argv, problem in cases:
        state = single_file.load(str(tiny_file))
        state[section][name] = value
        single_file.save(state, str(crafted))
        assert refused(capsys, [f"snapshot_path={crafted}", *argv]) == (
            f"error: the snapshot's {section}.{name} cannot be used: {problem}"
        )
    state = single_file.load(str(tiny_file))
    state["data_config"]["block_size"] = 999
    single_file.save(state, str(crafted))
    assert refused(capsys, [f"snapshot_path={crafted}"]) == (
        "error: the snapshot's data_config cannot be used (data_config.block_size: 999, longer "
        "than the model's block_size 16): give the text with path=..."
    )
    # A cache_dir that cannot be written here: the hint named data_config.cache_dir, no key of
    # score's.
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a directory")
    state = single_file.load(str(tiny_file))
    state["data_config"]["cache_dir"] = str(blocked)
    single_file.save(state, str(crafted))
    cache = cache_location(DataConfig(**state["data_config"]))[1]
    assert refused(capsys, [f"snapshot_path={crafted}"]) == (
        f"error: the run's corpus: cannot write its token cache {cache}: {blocked} is not a "
        "directory "
        "(where the run's data_config.cache_dir puts it, read from the current directory: score "
        "where that can be written, or give the text with path=...)"
    )


def test_a_text_is_read_chunk_by_chunk_and_refused_at_its_first_unknown_character(
    tiny_run, tmp_path, capsys, monkeypatch
):
    """A large file is not read whole before its characters are checked: a chunk with one outside
    the vocabulary ends the read, before the bytes after it (here: not UTF-8)."""
    from mingpt import token_cache

    _, run_dir = tiny_run
    text = tmp_path / "text.txt"
    text.write_text("ROMEO:\nWhat light through yonder window breaks?\n", encoding="utf-8")
    whole = score(ScoreConfig(snapshot_path=str(run_dir), path=str(text), device="cpu"))
    monkeypatch.setattr(token_cache, "CHUNK", 7)
    chunked = score(ScoreConfig(snapshot_path=str(run_dir), path=str(text), device="cpu"))
    assert (chunked.loss, chunked.tokens) == (whole.loss, whole.tokens)
    foreign = tmp_path / "foreign.txt"
    foreign.write_bytes(b"Romeo~ Romeo\n" + b"Juliet\n" * 10 + b"\xff")
    assert refused(capsys, [f"snapshot_path={run_dir}", f"path={foreign}"]) == (
        f"error: {foreign} has characters outside the snapshot's vocabulary: '~'"
    )
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert refused(capsys, [f"snapshot_path={run_dir}", f"path={empty}"]) == (
        f"error: path is empty: {empty}"
    )


@pytest.mark.parametrize("stdout", [None, "/dev/full"], ids=["closed", "full"])
def test_a_result_that_cannot_be_written_is_one_line_not_lost(
    tiny_run, tmp_path, capsys, monkeypatch, stdout
):
    """score (and export, the same write) with stdout closed (`>&-`) or full: one line and status 2;
    before, a closed stdout lost the result with status 0, a full one gave a traceback."""
    from mingpt.export import main as export_main

    cwd, run_dir = tiny_run
    monkeypatch.chdir(cwd)  # the run's data_config.path is relative to where it ran
    expected = "stdout is closed"
    if stdout is not None:
        expected = "cannot write to stdout: No space left"
    for command in (
        lambda: main([f"snapshot_path={run_dir}", "device=cpu"]),
        lambda: export_main([str(run_dir), str(tmp_path / "model")]),
    ):
        with contextlib.ExitStack() as stack, pytest.MonkeyPatch.context() as patch:
            out = None
            if stdout is not None:  # each its own: a failed write sends the rest to /dev/null
                out = stack.enter_context(open(stdout, "w"))  # noqa: SIM115
            patch.setattr(sys, "stdout", out)
            with pytest.raises(SystemExit) as status:
                command()
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert status.value.code == 2 and "Traceback" not in err, err
        assert last.startswith(f"error: {expected}"), err


def test_help():
    result = subprocess.run(
        [sys.executable, "-m", "mingpt.score", "--help"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        result.returncode == 0
        and result.stdout.startswith("usage: python -m mingpt.score")
        and not result.stderr
    )


def test_a_corpus_changed_since_the_snapshot_is_refused_unless_allowed(
    tiny_run, tmp_path, monkeypatch, capsys, one_thread
):
    """The held-out split is rebuilt from the snapshot's data_config: on a corpus that grew
    since, it is another split, refused naming the file, or scored with a warning. The refusal is
    the only line: it came after the lines of the new corpus's token cache, before."""
    cwd, run_dir = tiny_run
    text = (cwd / "small.txt").read_text(encoding="utf-8")
    (tmp_path / "small.txt").write_text(text + text[:3000], encoding="utf-8")
    shutil.copytree(run_dir / "snapshots", tmp_path / "snapshots")
    monkeypatch.chdir(tmp_path)
    before, after = len(text.encode()), (tmp_path / "small.txt").stat().st_size
    assert refused(capsys, ["snapshot_path=snapshots", "device=cpu"]) == (
        "error: the corpus changed since the snapshot was written "
        f"(small.txt: {before} -> {after} bytes), so its "
        "held-out split is not the run's: give the text with path=..., or score the new split with "
        "allow_corpus_change=true"
    )
    main(["snapshot_path=snapshots", "device=cpu", "allow_corpus_change=true"])
    out, err = capsys.readouterr()
    assert out.startswith("snapshots (step 60) on the held-out split of small.txt")
    assert (
        "WARNING the corpus changed since the snapshot was written "
        f"(small.txt: {before} -> {after} bytes)"
    ) in err
