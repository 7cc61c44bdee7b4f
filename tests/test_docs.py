"""The documentation against the code: docs/configuration.md's key tables are made
from the fields of the four config dataclasses, and every relative link in
README.md and docs/ reaches a file and, with an #anchor, a heading of it; the tables of stop
signals, comm hooks and export formats list what the code has, and the timeouts and thresholds
they cite are the code's."""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, child_env
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from mingpt import decoding, generate, stopping, storage, token_cache, torch_fixes, tracking
from mingpt.config import (
    FIELDS,
    Config,
    DataConfig,
    GPTConfig,
    OptimizerConfig,
    TrainerConfig,
    key,
    key_lines,
    key_table,
    markdown,
)
from mingpt.export import ExportConfig
from mingpt.optim import lr_at
from mingpt.trainer import TrainState

SECTIONS = {
    "gpt_config": GPTConfig,
    "optimizer_config": OptimizerConfig,
    "data_config": DataConfig,
    "trainer_config": TrainerConfig,
}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# the default run's optimizer steps per epoch on tiny shakespeare (its first log line says so)
STEPS_PER_EPOCH = 1308


def test_the_key_tables_are_made_from_the_fields():
    """docs/configuration.md's key tables are what
    `python -m mingpt.config --markdown` makes of the fields."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert markdown(text) == text, "run python -m mingpt.config --markdown docs/configuration.md"


@pytest.mark.parametrize("section", SECTIONS)
def test_each_default_cell_is_the_default_as_typed(section):
    """A table's default, typed on the command line, is the field's default."""
    parser = OverridesParser.create()
    for f, row in zip(
        dataclasses.fields(SECTIONS[section]),
        key_table(SECTIONS[section]).splitlines()[2:],
        strict=True,
    ):
        cell = row.split(" | ")[2]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        written = parser.parse_override(f"{section}.{f.name}={cell}").value()
        assert written == (list(default) if isinstance(default, tuple) else default), (
            section,
            f.name,
            cell,
        )


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(
        r"^#{1,6} (.+)$", FENCE.sub("", path.read_text(encoding="utf-8")), re.M
    ):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", documents(), ids=lambda path: path.relative_to(REPO).as_posix())
def test_every_relative_link_reaches_a_file_and_heading(doc):
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or doc.name == "layout.md"
    broken = []
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and (path.suffix != ".md" or anchor not in anchors(path)):
            broken.append(f"{link}: no heading #{anchor} in {path.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: {broken}"


def test_the_readme_links_every_document():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\(docs/([^)#]+)", readme))
    assert linked == {path.name for path in (REPO / "docs").glob("*.md")}


def test_example_log_lines_have_the_default_runs_learning_rate():
    """The train lines shown in the docs are the default run's: their lr is the
    schedule's for the step that line ends (steps done - 1, 0-based). A line
    from an older schedule once said 0.0021 at step 2050, where the run has
    0.0006244."""
    total = TrainerConfig().max_epochs * STEPS_PER_EPOCH
    shown = [
        (int(step), lr)
        for doc in documents()
        for step, lr in re.findall(
            r"INFO train step (\d+) epoch \d+ \| loss \S+ lr (\S+)", doc.read_text("utf-8")
        )
    ]
    assert shown
    for step, lr in shown:
        assert float(lr) == pytest.approx(lr_at(step - 1, OptimizerConfig(), total), rel=1e-3), (
            step,
            lr,
        )


@pytest.mark.parametrize(
    "tool,schema",
    [("generate", "GenerateConfig"), ("score", "ScoreConfig"), ("export", "ExportConfig")],
)
def test_each_commands_help_lists_its_keys_from_the_fields(tool, schema, capsys, monkeypatch):
    module = importlib.import_module(f"mingpt.{tool}")
    module.main(["--help"])
    help = capsys.readouterr().out
    assert help.startswith(f"usage: python -m mingpt.{tool} ")
    assert key_lines(getattr(module, schema)) in help
    assert f"(also: mingpt-{tool}).\n" in help
    # installed, it is named as typed: its usage said `python -m mingpt.X`, and its summary then
    # named the command it was as the other way to type it
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/mingpt-{tool}"])
    module.main(["--help"])
    help = capsys.readouterr().out
    assert help.startswith(f"usage: mingpt-{tool} ")
    assert f"(also: python -m mingpt.{tool}).\n" in help and f"also: mingpt-{tool}" not in help


def test_the_installed_training_commands_help_names_it():
    """`mingpt-train --help` said `usage: python main.py`, a file an installed copy has not."""
    script = Path(sys.executable).with_name("mingpt-train")
    if not script.exists():
        pytest.skip("mingpt is not installed in this environment")
    result = subprocess.run(
        [str(script), "--help"], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and not result.stderr, result.stderr
    assert result.stdout.startswith(
        "usage: mingpt-train [key=value ...]  (one process; or torchrun [options] --no-python "
        "mingpt-train [key=value ...])\n"
    ), result.stdout


def main_py_output(*args: str) -> str:
    """What `python main.py ARGS` prints, once it has exited 0 with nothing on stderr."""
    result = subprocess.run(
        [sys.executable, "main.py", *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and not result.stderr, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def training_help() -> str:
    """`python main.py --help trainer_config.max_epochs=7`'s output."""
    return main_py_output("--help", "trainer_config.max_epochs=7")


def test_hydras_own_help_that_the_training_help_points_to_is_shown():
    """--help says "Hydra's own options: --hydra-help"; it was refused for Hydra's default run
    directory, which the run's own config replaces."""
    output = main_py_output("--hydra-help")
    assert output.startswith("Hydra (") and "== Flags ==" in output


def test_the_training_help_lists_every_key_with_this_invocations_value(training_help):
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory):
            assert f"\n  {section.name}.{f.name}=" in training_help
    assert "\n  trainer_config.max_epochs=7 " in training_help


def test_help_shows_a_links_text_on_one_line_never_its_path(training_help):
    """A key's help links into the docs in Markdown, by a path relative to docs/: a terminal shows
    the link's text alone, never split by the wrapping, wherever it falls in the line."""
    for section in SECTIONS.values():
        lines = key_lines(section)
        assert "](" not in lines and ".md" not in lines, lines
    assert "](" not in training_help and ".md" not in training_help.partition("== Keys")[2]
    link = "[Distributed training](training.md#distributed-training)"
    for pad in range(1, 80):
        help = f"{'x' * pad} then {link} and words after it"
        section = dataclasses.make_dataclass("S", [("k", int, key(1, help))])
        shown = key_lines(section)
        assert any("Distributed training" in line for line in shown.splitlines()), shown
        assert "training.md" not in shown and "x then Distributed training and words" in " ".join(
            shown.split()
        )


def test_the_presets_in_the_docs_are_what_help_lists(training_help):
    """docs/configuration.md's Presets name every option of every config group that --help
    lists, and every `group=option` in that page is one of them."""
    listed = training_help.split("== Configuration groups ==\n")[1].split("\n\n")[0]
    groups = {
        group: set(options.split(", "))
        for group, options in (line.split(": ") for line in listed.splitlines())
    }
    assert {"experiment", "gpt_config", "optimizer_config"} <= groups.keys()
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    presets = page.split("\n## Presets\n")[1].split("\n## ")[0]
    missing = [
        f"{group}={option}"
        for group, options in groups.items()
        for option in sorted(options)
        if f"`{option}`" not in presets and f"`{group}={option}`" not in presets
    ]
    assert not missing, f"docs/configuration.md's Presets lack {missing}"
    named = re.findall(r"\b(experiment|gpt_config|optimizer_config)=([\w-]+)", page)
    assert all(option in groups[group] for group, option in named if option != "NAME"), named


def test_the_layout_names_every_module_of_mingpt_once():
    """docs/layout.md: one line per module, none missing, none that is gone."""
    layout = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    named, folder = [], None
    for line in layout.splitlines():
        if match := re.match(r"(mingpt/(?:\w+/)*)(\w+\.py)?\s", line):
            folder = match.group(1) if match.group(2) is None else None
            named += [match.group(1) + match.group(2)] if match.group(2) else []
        elif folder and (match := re.match(r"  (\w+\.py)\s", line)):
            named.append(folder + match.group(1))
    modules = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "mingpt").rglob("*.py") if p.name != "__init__.py"
    )
    assert sorted(named) == modules


def table_rows(doc: str, header: str) -> list[list[str]]:
    """The body rows of the Markdown table in docs/DOC whose header row starts with `header`, each
    a list of its cells."""
    lines = (REPO / "docs" / doc).read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_what_a_snapshot_holds_names_every_field_of_the_runs_position():
    """The fields of TrainState, which every snapshot records, are each named in
    docs/fault-tolerance.md's list."""
    page = doc_text("fault-tolerance.md")
    section = page.split(" ## What a snapshot holds ")[1].split(" ## ")[0]
    named = set(re.findall(r"`(\w+)`", section))
    assert {f.name for f in dataclasses.fields(TrainState)} <= named


def test_the_stop_signal_table_is_the_default_stop_signals():
    """docs/fault-tolerance.md's table: each default stop signal once, in order, with its exit
    status."""
    rows = table_rows("fault-tolerance.md", "| signal |")
    assert [name for name, *_ in rows] == list(stopping.DEFAULT_SIGNALS)
    assert [int(status) for *_, status in rows] == [
        stopping.exit_status(stopping.parse_signal(name)) for name in stopping.DEFAULT_SIGNALS
    ]


@pytest.mark.parametrize(
    "doc, header, field",
    [
        ("training.md", "| `ddp_comm_hook` |", FIELDS["trainer_config.ddp_comm_hook"]),
        (
            "generation.md",
            "| `format` |",
            {f.name: f for f in dataclasses.fields(ExportConfig)}["format"],
        ),
    ],
    ids=["comm-hooks", "export-formats"],
)
def test_a_table_of_choices_has_a_row_for_each(doc, header, field):
    """The tables of the comm hooks (docs/training.md) and export formats (docs/generation.md)
    name each valid value of their key once."""
    named = [
        value for first, *_ in table_rows(doc, header) for value in re.findall(r"`([^`]+)`", first)
    ]
    assert sorted(named) == sorted(field.metadata["valid"])


def doc_text(name: str) -> str:
    """docs/NAME with its line breaks as spaces."""
    return " ".join((REPO / "docs" / name).read_text(encoding="utf-8").split())


def signal_lead_minutes() -> str:
    """How long before the time limit scripts/slurm.sbatch asks for SIGUSR1, in the words the docs
    use."""
    script = (REPO / "scripts" / "slurm.sbatch").read_text(encoding="utf-8")
    seconds = int(re.search(r"--signal=B:USR1@(\d+)", script).group(1))
    return {300: "five minutes"}.get(seconds, f"{seconds} s")


def id_widths() -> str:
    """The token cache's bytes per id at the largest vocabulary of each width and just past the
    last, in docs/data.md's words: a width or a boundary that moved reads otherwise."""

    def width(vocab_size: int) -> int:
        return np.dtype(token_cache.dtype_for(vocab_size)).itemsize

    return (
        f"{width(2**8)} byte each up to {2**8} characters, {width(2**15)} up to {2**15:,}, "
        f"else {width(2**15 + 1)}"
    )


def shutdown_timeout() -> str:
    script = (REPO / "scripts" / "slurm.sbatch").read_text(encoding="utf-8")
    return re.search(r"--shutdown-timeout=(\d+)", script).group(1)


def preset(group: str, name: str):
    return OmegaConf.load(REPO / "conf" / group / f"{name}.yaml")


MUON = preset("optimizer_config", "muon")
QUICK = preset("experiment", "gpu-quick")
QUICK_MODEL = preset("gpt_config", "gpu-quick")


@pytest.mark.parametrize(
    "doc, phrase",
    [
        (
            "training.md",
            f"the preset sets `optimizer_config.algorithm={MUON.algorithm}`, and "
            f"`warmup_steps={MUON.warmup_steps}` and `muon_momentum={MUON.muon_momentum}`",
        ),
        (
            "configuration.md",
            f"a {QUICK_MODEL.n_layer}/{QUICK_MODEL.n_head}/{QUICK_MODEL.n_embd} model with block "
            f"{QUICK.data_config.block_size} for one GPU ({QUICK.trainer_config.amp_dtype}, "
            f"compiled, {QUICK.trainer_config.max_steps:,} steps)",
        ),
        ("generation.md", f"compiles one from {generate.COMPILE_PAYS_AFTER['cpu']:,} characters"),
        (
            "generation.md",
            "Elsewhere it compiles one from "
            f"{generate.COMPILE_PAYS_AFTER['cpu, products keep up']:,} characters",
        ),
        ("generation.md", f"CUDA graphs from {generate.COMPILE_PAYS_AFTER['cuda']:,} characters"),
        ("generation.md", f"in memory (about {generate.PROMPT_BYTES_PER_BYTE} bytes a byte of"),
        (
            "generation.md",
            f"then up to {decoding.CHUNK_TOKENS}, or whatever {decoding.CHUNK_SECONDS} s brought",
        ),
        ("training.md", f"a line every {storage.NOTICE_EVERY:g} s names the path"),
        (
            "training.md",
            "a process that cannot join the others within "
            f"{torch_fixes.INIT_AFTER_RESTART_SECONDS} s says so",
        ),
        ("training.md", f"died waits up to {stopping.PEER_ENDED_WAIT_S:g} s for its own torchrun"),
        (
            "training.md",
            f"last `cooldown_fraction` ({OptimizerConfig().cooldown_fraction} by default)",
        ),
        (
            "training.md",
            f"`optimizer_config.warmup_steps` of {OptimizerConfig().warmup_steps}, the default",
        ),
        (
            "training.md",
            f"the default {OptimizerConfig().warmup_steps} steps would outlast it",
        ),
        (
            "fault-tolerance.md",
            f"`trainer_config.save_every_minutes` (default {TrainerConfig().save_every_minutes:g})",
        ),
        ("fault-tolerance.md", f"asks for SIGUSR1 {signal_lead_minutes()} before the time limit"),
        ("data.md", f"the token ids ({id_widths()})"),
        (
            "fault-tolerance.md",
            f"cannot join within {torch_fixes.INIT_AFTER_RESTART_SECONDS} s says so",
        ),
        ("fault-tolerance.md", f"keep `--shutdown-timeout` ({shutdown_timeout()} s in the script)"),
        (
            "tracking.md",
            f"tried once with a {tracking.PROBE_LIMITS['MLFLOW_HTTP_REQUEST_TIMEOUT']} s timeout",
        ),
        (
            "tracking.md",
            f"retried once with {tracking.HTTP_LIMITS['MLFLOW_HTTP_REQUEST_TIMEOUT']} s each",
        ),
    ],
)
def test_a_number_the_docs_cite_is_the_codes(doc, phrase):
    """Timeouts, intervals and thresholds that the docs give in words are the constants in use."""
    assert phrase in doc_text(doc)


def test_the_text_keys_in_the_docs_are_those_taken_verbatim():
    """docs/generation.md names the keys of generate whose values are taken verbatim."""
    named = re.search(r"\*\*Text keys\.\*\* (.*?) take the rest of", doc_text("generation.md"))
    assert set(re.findall(r"`(\w+)`", named.group(1))) == set(generate.TEXT_KEYS)


def test_the_readmes_default_run_is_the_defaults():
    """The Quick start describes the default run by its shape, batch, epochs and log interval, and
    the context the exported model sees."""
    readme = " ".join((REPO / "README.md").read_text(encoding="utf-8").split())
    model = GPTConfig()
    data = DataConfig()
    trainer = TrainerConfig()
    steps = trainer.max_epochs * STEPS_PER_EPOCH
    for phrase in [
        f"(a {model.n_layer}-layer, {model.n_embd}-dim model, block {data.block_size}, batch "
        f"{trainer.batch_size}, {trainer.max_epochs} epochs: {steps:,} steps)",
        f"It logs a line every {trainer.log_every} steps",
        f"at most `block_size` characters ({data.block_size} by default)",
        f"warm up for 10 (the default {OptimizerConfig().warmup_steps} would outlast the run",
    ]:
        assert phrase in readme, phrase


def test_the_model_presets_shapes_in_the_docs_are_the_presets():
    """docs/configuration.md's Presets give each model preset's layers/heads/width."""
    page = doc_text("configuration.md")
    presets = page.split(" ## Presets ")[1].split(" ## ")[0]
    cited = {
        name: shape
        for *names, shape in re.findall(r"`([\w-]+)`(?: and `([\w-]+)`)? (\d+/\d+/\d+)", presets)
        for name in names
        if name
    }
    shapes = {"default": GPTConfig()}
    for path in (REPO / "conf" / "gpt_config").glob("*.yaml"):
        shapes[path.stem] = GPTConfig(**OmegaConf.to_container(OmegaConf.load(path)))
    assert cited == {
        name: f"{cfg.n_layer}/{cfg.n_head}/{cfg.n_embd}" for name, cfg in shapes.items()
    }


def migration_cells(cfg) -> list[str]:
    """The start of each cell that docs/training.md's migration table gives for a config."""
    opt, data = cfg.optimizer_config, cfg.data_config
    warmup = f"{opt.warmup_steps} warmup steps" if opt.warmup_steps else "no warmup"
    decay = f", {opt.lr_schedule} decay to {opt.min_lr_ratio:.0%}"
    return [
        f"({opt.betas[0]}, {opt.betas[1]})",
        f"{opt.lr_schedule}, {warmup}" if opt.lr_schedule == "constant" else warmup + decay,
        str(cfg.gpt_config.dropout),
        "one at every character" if data.stride == 1 else f"one every {data.stride} characters",
        "",  # the held-out split: how, not a value
        cfg.trainer_config.amp_dtype,
        f"{cfg.gpt_config.n_layer}/{cfg.gpt_config.n_head}/{cfg.gpt_config.n_embd}, "
        f"{data.block_size}, {cfg.trainer_config.batch_size}, {data.truncate:.0%}",
    ]


def test_the_migration_table_has_the_presets_and_defaults_values():
    """The tutorial's column is experiment=ddp-tutorial's, the default's the dataclasses'."""
    tutorial = OmegaConf.create(main_py_output("--cfg", "job", "experiment=ddp-tutorial"))
    rows = table_rows("training.md", "| setting | tutorial |")
    for column, cfg in [(1, tutorial), (2, OmegaConf.structured(Config))]:
        for row, cell in zip(rows, migration_cells(cfg), strict=True):
            assert row[column].startswith(cell), (row, cell)


def commands(*programs: str, launcher: str = "") -> list[tuple[str, list[str]]]:
    """Each command of one of `programs` (started by `launcher`, where given) in a bash block of
    docs/ or BENCHMARKS.md: its page and its key=value arguments."""
    found = []
    for page in [*documents()[1:], REPO / "BENCHMARKS.md"]:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if "-c" in words:
                    # sh -c 'SCRIPT' sh ARGS: the script's words, then the arguments it passes on
                    script = words.index("-c") + 1
                    words[script : script + 1] = shlex.split(words[script])
                if launcher and launcher not in words:
                    continue
                if at := [i for i, word in enumerate(words) if word in programs]:
                    args = words[at[0] + 1 :]
                    found.append((page.name, [a for a in args if "=" in a and a[0] != "-"]))
    return found


def training_commands() -> list[tuple[str, list[str]]]:
    return commands("main.py")


def test_a_documented_torchrun_command_names_its_run():
    """The number of processes is no part of a run: unnamed, a torchrun command would meet the
    Quick start's finished runs/default."""
    found = commands("main.py", launcher="torchrun")
    assert len(found) > 5
    for page, overrides in found:
        keys = {arg.split("=")[0] for arg in overrides}
        assert keys & {"trainer_config.run_name", "experiment"}, (page, overrides)


@pytest.mark.parametrize(
    "tool,schema",
    [("generate", "GenerateConfig"), ("score", "ScoreConfig"), ("export", "ExportConfig")],
)
def test_a_documented_commands_keys_are_its_fields(tool, schema):
    fields = dataclasses.fields(getattr(importlib.import_module(f"mingpt.{tool}"), schema))
    found = commands(f"mingpt.{tool}", f"mingpt-{tool}")
    assert found
    for page, args in found:
        assert {arg.split("=")[0] for arg in args} <= {f.name for f in fields}, (page, args)


def test_a_documented_training_command_names_its_run_or_is_the_default_runs():
    """Without a run name of its own a command meets runs/default, the Quick start's run, which
    the reader has finished: it may only be that run's own command (the same again, or --cfg job)
    or continue it deliberately. One that changes only operational keys (a tracker, say) would
    find it complete and do nothing, and after the README's Train longer be refused."""
    assert len(training_commands()) > 10
    for page, overrides in training_commands():
        keys = [arg.split("=")[0] for arg in overrides]
        assert set(keys) <= {*FIELDS, *SECTIONS, "experiment", "hydra.run.dir"}, (page, keys)
        named = {"trainer_config.run_name", "hydra.run.dir", "experiment"} & set(keys)
        deliberate = "trainer_config.allow_config_change=true" in overrides
        assert named or deliberate or not keys, (page, overrides)


def test_a_documented_training_command_of_max_steps_trains_past_its_warmup():
    """A warmup as long as the run is said in a warning at start: no documented command shows it
    (the profiling example's 20 steps met the default 100-step warmup)."""
    from hydra import compose, initialize_config_dir

    from mingpt.cli import CONF_DIR

    parser = OverridesParser.create()
    checked = 0
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        for page, overrides in training_commands():
            # compose takes one value a key: a sweep's (-m) keys keep their defaults here
            single = [o for o in overrides if not parser.parse_override(o).is_sweep_override()]
            config = compose("config", overrides=single)
            steps = config.trainer_config.max_steps
            if steps is not None:
                assert config.optimizer_config.warmup_steps < steps, (page, overrides)
                checked += 1
    assert checked


def test_a_documented_cpu_torchrun_command_gives_each_process_its_threads():
    """A command that starts a number of CPU processes sets OMP_NUM_THREADS: without it torchrun
    sets one thread each and says so in a banner of its own, which the reader does not expect."""
    found = 0
    for page in [*documents(), REPO / "BENCHMARKS.md"]:
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if re.search(r"--nproc_per_node[= ]\d", line):
                    found += 1
                    assert line.startswith("OMP_NUM_THREADS="), (page.name, line)
    assert found > 5
