"""mingpt.export: safetensors and Hugging Face exports of both snapshot formats and of a
run directory, loaded back by safetensors and by transformers' own GPT2LMHeadModel,
the project's logits to 1e-5; the snapshot format; refused destinations and bad input."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import child_env, read_snapshot, run_each

from mingpt.config import GPTConfig
from mingpt.export import main as export_main
from mingpt.model import GPT
from mingpt.snapshot.reader import load_model

TOLERANCE = 1e-5
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 characters


@pytest.fixture(autouse=True)
def keep_logging(monkeypatch):
    """The CLI sets up logging to the (captured) stderr: put the root logger back after."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)


def random_model(seed: int = 0) -> GPT:
    """A tiny GPT whose every weight is far from its initialisation (LayerNorm gains and
    biases included), so that a wrong mapping, transpose or activation shows in the logits."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=len(VOCAB), block_size=16))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def sharded_root(tmp_path_factory) -> Path:
    """A sharded snapshot of random_model, saved by this one process (no process group)."""
    from mingpt.snapshot import sharded

    root = tmp_path_factory.mktemp("sharded") / "snapshots"
    model = random_model()
    meta = {
        "gpt_config": dataclasses.asdict(model.config),
        "vocab": VOCAB,
        "epoch": 0,
        "samples_in_epoch": 0,
        "step": 3,
    }
    sharded.save({"model": model.state_dict()}, meta, str(root), 3, async_save=False)
    return root


@pytest.fixture(params=["file", "sharded", "run directory"])
def source(request, tiny_run, tiny_file, sharded_root) -> str:
    """A snapshot of each kind: a single file, a sharded snapshot, a run's directory."""
    _, run_dir = tiny_run
    return {"file": str(tiny_file), "sharded": str(sharded_root), "run directory": str(run_dir)}[
        request.param
    ]


def export(src, dst, *options) -> None:
    export_main([str(src), str(dst), *options])


def max_difference(model: GPT, hf_model, seed: int = 0) -> float:
    c = model.config
    idx = torch.randint(
        0, c.vocab_size, (4, c.block_size), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf_model(input_ids=idx).logits
    assert theirs.shape == ours.shape
    return (ours - theirs).abs().max().item()


def test_hf_export_loads_in_transformers_with_the_same_logits(source, tmp_path, capsys):
    from transformers import GPT2LMHeadModel

    dst = tmp_path / "hf"
    export(source, dst, "--format", "hf")
    assert capsys.readouterr().out.startswith(f"exported {source} (step ")
    assert sorted(os.listdir(dst)) == ["config.json", "model.safetensors", "vocab.json"]
    hf_model, info = GPT2LMHeadModel.from_pretrained(dst, output_loading_info=True)
    # every weight is ours, none drawn
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf_model.eval()
    model, tokenizer, _ = load_model(source, torch.device("cpu"))
    assert hf_model.config.tie_word_embeddings is False
    assert not torch.equal(hf_model.lm_head.weight, hf_model.transformer.wte.weight)
    assert max_difference(model, hf_model) <= TOLERANCE
    assert json.loads((dst / "vocab.json").read_text(encoding="utf-8")) == {
        c: i for i, c in enumerate(tokenizer.chars)
    }


def test_the_logit_check_detects_a_wrong_activation(sharded_root, tmp_path):
    """tanh-approximate GELU (GPT-2's own `gelu_new`) in place
    of the exact one: off by more than 10x the tolerance."""
    from transformers import GPT2LMHeadModel

    export(sharded_root, tmp_path / "hf", "--format=hf")
    model, _, _ = load_model(str(sharded_root), torch.device("cpu"))
    wrong = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", activation_function="gelu_new").eval()
    assert max_difference(model, wrong) > 10 * TOLERANCE


def test_safetensors_export_rebuilds_the_model(source, tmp_path):
    from safetensors.torch import load_file

    dst = tmp_path / "st"
    export(source, dst)  # the default format
    config = json.loads((dst / "config.json").read_text())
    vocab = json.loads((dst / "vocab.json").read_text(encoding="utf-8"))
    rebuilt = GPT(GPTConfig(**config))
    rebuilt.load_state_dict(load_file(dst / "model.safetensors"))
    model, tokenizer, _ = load_model(source, torch.device("cpu"))
    assert dataclasses.asdict(model.config) == config
    assert sorted(vocab, key=vocab.get) == list(tokenizer.chars)
    for (name, ours), (name2, theirs) in zip(
        model.state_dict().items(), rebuilt.state_dict().items(), strict=True
    ):
        assert name == name2 and torch.equal(ours, theirs), name


def test_snapshot_format_from_a_run_directory_and_over_an_earlier_export(
    tiny_run, sharded_root, tmp_path, capsys
):
    from mingpt.snapshot import single_file

    _, run_dir = tiny_run
    dst = tmp_path / "one.pt"
    export(sharded_root, dst, "--format", "snapshot")  # an earlier snapshot file is replaced
    capsys.readouterr()
    export(run_dir, dst, "--format", "snapshot")  # a run directory: its best weights
    exported, original = single_file.load(str(dst)), read_snapshot(run_dir / "snapshots-best")
    assert (
        capsys.readouterr().out
        == f"exported {run_dir} (step {original['step']}) as snapshot to {dst}\n"
    )
    # The weights and the run's record, without optimizer state.
    assert exported.keys() == original.keys() - {"optimizer_state"}
    assert exported["step"] == original["best_step"]
    assert all(
        torch.equal(exported["model_state"][k], v) for k, v in original["model_state"].items()
    )
    # A directory export over an earlier one replaces it whole, leaving nothing else beside it
    # (a killed export's temporary directory included).
    export(run_dir, tmp_path / "st")
    (tmp_path / ".st.tmp-killed").mkdir()
    export_main([f"src={run_dir}", f"dst={tmp_path / 'st'}", "format=hf"])  # the key=value form
    assert json.loads((tmp_path / "st" / "config.json").read_text())["model_type"] == "gpt2"
    assert sorted(os.listdir(tmp_path)) == ["one.pt", "st"]


def test_a_snapshot_file_behind_a_symbolic_link_is_replaced_and_the_link_stays(
    tiny_file, sharded_root, tmp_path
):
    """As a directory export behind a link replaces the directory: the link was replaced by a
    file, and the snapshot it pointed to (the one checked) kept its old weights."""
    from mingpt.snapshot import single_file

    target = tmp_path / "current.pt"
    target.write_bytes(tiny_file.read_bytes())
    link = tmp_path / "link.pt"
    link.symlink_to(target.name)
    export(sharded_root, link, "--format", "snapshot")
    assert link.is_symlink() and os.readlink(link) == target.name
    assert single_file.load(str(target))["step"] == 3  # sharded_root's, not the tiny run's
    assert sorted(os.listdir(tmp_path)) == ["current.pt", "link.pt"]


def refused(capsys, argv: list[str]) -> str:
    """The one line on stderr of a command that exits with status 2."""
    with pytest.raises(SystemExit) as exit_status:
        export_main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_status.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    return err.strip()


def test_a_failed_write_from_a_run_directory_is_one_line(tiny_run, capsys):
    """The log said which snapshot of the run directory it took, then the error, before."""
    _, run_dir = tiny_run
    line = refused(capsys, [run_dir, "/proc/one.pt", "--format", "snapshot"])
    assert line.startswith("error: cannot save snapshot /proc/one.pt: "), line


def test_an_earlier_export_that_cannot_be_put_back_is_named_in_one_line(
    sharded_root, tmp_path, capsys, monkeypatch
):
    """The export over an earlier one fails once that one is moved aside, and moving it back fails
    too: a traceback, before."""
    dst = tmp_path / "st"
    export(sharded_root, dst)
    rename = os.rename
    renames = []

    def failing(src, target):
        renames.append(target)
        if len(renames) > 1:  # the move aside alone succeeds
            raise OSError(errno.EIO, "Input/output error")
        rename(src, target)

    monkeypatch.setattr(os, "rename", failing)
    line = refused(capsys, [sharded_root, dst])
    assert line == (
        f"error: cannot write {dst}: Input/output error; the earlier export is left in "
        f"{renames[0]}: rename it back to {dst} before the next export, which removes it"
    )
    assert sorted(os.listdir(renames[0])) == ["config.json", "model.safetensors", "vocab.json"]


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
@pytest.mark.parametrize("form", ["snapshot", "safetensors", "hf"])
def test_a_device_node_is_never_replaced(sharded_root, tmp_path, capsys, device, form):
    before = os.stat(device)
    line = refused(capsys, [sharded_root, device, "--format", form])
    assert line == (
        f"error: {device} is not a regular file or directory (a device, pipe or socket): "
        "refusing to replace it"
    )
    link = tmp_path / "link"  # nor through a symbolic link
    link.symlink_to(device)
    assert "is not a regular file or directory" in refused(
        capsys, [sharded_root, link, "--format", form]
    )
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and link.is_symlink()
    assert os.listdir("/dev").count(os.path.basename(device)) == 1 and not list(
        Path("/dev").glob("*.tmp-*")
    )


def test_a_destination_that_cannot_be_listed_is_refused_untouched(sharded_root, unlistable):
    """Whether it holds other files cannot be known: refused in one line (a traceback of
    os.listdir's PermissionError, before)."""
    locked, prefix = unlistable
    result = subprocess.run(
        [*prefix, sys.executable, "-m", "mingpt.export", str(sharded_root), str(locked)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr == f"error: cannot write {locked}: Permission denied\n"
    locked.chmod(0o755)
    assert os.listdir(locked) == []


@pytest.mark.parametrize("form", ["safetensors", "hf"])
def test_a_directory_format_to_a_url_is_refused_before_the_snapshot_is_read(tmp_path, capsys, form):
    """It was refused once the model was read (the run directory's line, then the error): here the
    source does not even exist, and the destination alone is named."""
    line = refused(capsys, [tmp_path / "missing", "memory://out", "--format", form])
    assert (
        line == "error: cannot write memory://out: this format writes a local directory, not a URL"
    )


def test_a_snapshot_to_memory_is_refused_as_it_would_end_with_the_command(tiny_file, capsys):
    """The command said it exported, and the file was gone with the process."""
    line = refused(capsys, [tiny_file, "memory://export.pt", "--format", "snapshot"])
    assert line == (
        "error: dst: memory:// ends with the command, and the export with it: give a path or a "
        "URL that outlives it"
    )
    assert not fsspec.filesystem("memory").exists("/export.pt")


def test_a_file_that_is_not_a_snapshot_is_never_replaced(sharded_root, tmp_path, capsys):
    """A swapped or mistyped DST (here a text of the user's) is refused, not overwritten."""
    text = tmp_path / "corpus.txt"
    text.write_text("ROMEO: the user's own text\n")
    line = refused(capsys, [sharded_root, text, "--format", "snapshot"])
    assert line == (
        f"error: {text} is a file that is not a snapshot: refusing to replace it (give a new "
        "path, or an earlier export's file)"
    )
    assert text.read_text() == "ROMEO: the user's own text\n"
    # A zip archive (a .docx or .jar is one too), or another program's torch file, starts as a
    # snapshot file does: it was replaced.
    archive = tmp_path / "backup.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("notes.txt", "the user's own notes")
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(2)}, "iter_num": 5}, checkpoint)
    for mine in (archive, checkpoint):
        before = mine.read_bytes()
        assert refused(capsys, [sharded_root, mine, "--format", "snapshot"]) == (
            f"error: {mine} is a file that is not a snapshot: refusing to replace it (give a new "
            "path, or an earlier export's file)"
        )
        assert mine.read_bytes() == before


def test_bad_input_is_one_line(sharded_root, tiny_file, tmp_path, capsys):
    snapshot = tiny_file
    missing = tmp_path / "missing.pt"
    assert refused(capsys, [missing, tmp_path / "out"]) == f"error: snapshot not found: {missing}"
    damaged = tmp_path / "damaged.pt"
    damaged.write_bytes(snapshot.read_bytes()[:-100])
    assert refused(capsys, [damaged, tmp_path / "out"]).startswith(
        f"error: snapshot {damaged} is truncated"
    )
    assert refused(capsys, [snapshot, tmp_path / "out", "--format", "onnx"]) == (
        "error: format: 'onnx' is not one of safetensors, hf, snapshot"
    )
    assert refused(capsys, [snapshot, tmp_path / "out", "--format"]) == (
        "error: --format: expects one of safetensors, hf, snapshot"
    )
    assert refused(capsys, [snapshot]) == "error: dst: must be given"
    assert refused(capsys, [snapshot, tmp_path / "out", "--level=3"]) == (
        "error: --level=3: expected key=value (SRC and DST are given)"
    )
    assert (
        refused(capsys, [f"src={snapshot}", "level=3"]) == "error: unknown key level (see --help)"
    )
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    # a parent that is a file: nothing can be written there
    for form in ("safetensors", "snapshot"):
        assert refused(capsys, [snapshot, blocker / "out", "--format", form]).startswith(
            f"error: cannot write {blocker / 'out'}: Not a directory"
        )
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert refused(capsys, [snapshot, mine]) == (
        f"error: {mine} is a directory with other files (notes.txt): "
        "give a new or an earlier export's directory"
    )
    assert refused(capsys, [snapshot, mine, "--format", "snapshot"]) == (
        f"error: {mine} is a directory: the snapshot format writes one file"
    )
    assert (
        refused(capsys, [snapshot, blocker])
        == f"error: {blocker} is a file: this format writes a directory"
    )
    assert (mine / "notes.txt").read_text() == "keep me" and blocker.read_text() == "x"
    # A file of an export's name alone is another program's (an export has all three): it was
    # replaced, with the directory.
    (mine / "notes.txt").rename(mine / "config.json")
    assert refused(capsys, [snapshot, mine, "--format", "hf"]) == (
        f"error: {mine} is not an earlier export (no model.safetensors, vocab.json): give a new "
        "or an earlier export's directory"
    )
    assert os.listdir(mine) == ["config.json"] and (mine / "config.json").read_text() == "keep me"
    # no temporary left behind
    assert sorted(os.listdir(tmp_path)) == ["a-file", "damaged.pt", "mine"]


def test_help_and_the_command_line(tiny_run, tmp_path):
    cwd, run_dir = tiny_run
    # one process for both: each run is mostly importing torch
    helped, refused = run_each(
        "mingpt.export", [(tmp_path, ["--help"]), (tmp_path, [str(run_dir), "/dev/full"])]
    )
    assert helped.returncode == 0 and helped.stdout.startswith(
        "usage: python -m mingpt.export src=SRC dst=DST"
    )
    assert "\n  format=safetensors" in helped.stdout and not helped.stderr
    assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.count("\n") == 1, (
        refused.stderr
    )
    assert refused.stderr.startswith("error: /dev/full is not a regular file or directory")


def test_a_path_beside_a_key_value_fills_the_other_of_src_and_dst(tmp_path, capsys):
    """`src=A B` exports A to B, `dst=B A` too; a path beyond both is refused. `src=A B dst=C`
    exported A to C, and B was dropped unsaid (it had been taken as a src that src=A replaced)."""
    from mingpt.export import overrides

    assert overrides(["src=a", "b"]) == ["dst=b", "src=a"]
    assert overrides(["dst=b", "a", "--format", "hf"]) == ["src=a", "dst=b", "format=hf"]
    assert overrides(["a", "b"]) == ["src=a", "dst=b"]
    assert refused(capsys, ["src=a", "b", "dst=c"]) == (
        "error: b: expected key=value (SRC and DST are given)"
    )
    assert refused(capsys, ["src=a", "dst=c", "b", "d"]) == (
        "error: b d: expected key=value (SRC and DST are given)"
    )


def test_a_run_directory_names_its_snapshot(tmp_path, capsys):
    """As generate finds it: the snapshot that the run's own .hydra/config.yaml names."""
    from mingpt.snapshot.reader import find as find_snapshot

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    config = run / ".hydra" / "config.yaml"
    elsewhere = tmp_path / "elsewhere" / "s"
    for made in (
        run / "snapshots" / "step-00000001" / "manifest.json",
        elsewhere / "step-00000001" / "manifest.json",
    ):
        made.parent.mkdir(parents=True, exist_ok=True)
        made.touch()  # what find_snapshot looks for (a published snapshot: its manifest); not read
    for trainer_config, found in (
        ("{}", run / "snapshots"),
        ("{parallelism: fsdp}", run / "snapshots"),
        (f"{{snapshot_path: {elsewhere}}}", elsewhere),
    ):
        config.write_text(f"trainer_config: {trainer_config}\n")
        assert find_snapshot(str(run))[0] == str(found)
    # A run directory of the single-file training format before: its snapshot.pt.
    old = tmp_path / "old"
    (old / ".hydra").mkdir(parents=True)
    (old / ".hydra" / "config.yaml").write_text("trainer_config: {}\n")
    (old / "snapshot.pt").touch()
    assert find_snapshot(str(old))[0] == str(old / "snapshot.pt")
    # not a run directory: taken as given, with nothing to say
    assert find_snapshot(str(tmp_path)) == (str(tmp_path), "")
    config.write_text("trainer_config: {batch_size: many}\n")
    assert refused(capsys, [run, tmp_path / "out"]) == (
        f"error: run directory {run}: {config} cannot be read "
        "(Value 'many' of type 'str' could not be converted to Integer)"
    )
