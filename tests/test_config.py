"""Configuration through Hydra's compose API: schema, validation, presets, the run directory."""

from __future__ import annotations

import dataclasses
import math
import re
import shlex

import pytest
from conftest import REPO, RUN_DEADLINE, run_each
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from mingpt.cli import CONF_DIR
from mingpt.config import OPERATIONAL_KEYS, Config, ConfigError, in_range


def composed(*overrides: str, hydra_config: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


def config(*overrides: str) -> Config:
    return OmegaConf.to_object(composed(*overrides))


def test_the_dataclasses_are_the_defaults():
    cfg = config()
    assert isinstance(cfg, Config)
    cfg.optimizer_config.betas = tuple(cfg.optimizer_config.betas)  # OmegaConf gives lists
    assert cfg == Config()


def test_overrides_are_applied_and_typed():
    cfg = config(
        "trainer_config.max_epochs=5",
        "optimizer_config.learning_rate=1e-3",
        "data_config.truncate=0.5",
    )
    assert cfg.trainer_config.max_epochs == 5
    assert cfg.optimizer_config.learning_rate == 1e-3
    assert cfg.data_config.truncate == 0.5


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer_config.epochs=5", "trainer_config.epochs"),
        ("gpt_config.layers=2", "gpt_config.layers"),
        ("trainer_config.batch_size=abc", "trainer_config.batch_size"),
        ("optimizer_config.learning_rate=fast", "optimizer_config.learning_rate"),
        ("trainer_config.use_amp=maybe", "trainer_config.use_amp"),
        ("trainer_config.allow_config_change=maybe", "trainer_config.allow_config_change"),
    ],
    ids=[
        "unknown-key",
        "unknown-model-key",
        "str-for-int",
        "str-for-float",
        "str-for-bool",
        "str-for-allow",
    ],
)
def test_unknown_keys_and_wrong_types_are_rejected(override, key):
    with pytest.raises(ConfigCompositionException) as e:
        composed(override)
    assert key in f"{e.value} {e.value.__cause__}"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["gpt_config.n_embd=100", "gpt_config.n_head=3"], "gpt_config.n_embd"),
        (["gpt_config.n_layer=0"], "gpt_config.n_layer"),
        (["gpt_config.dropout=1.0"], "gpt_config.dropout"),
        (["data_config.train_split=0"], "data_config.train_split"),
        (["data_config.train_split=1.0"], "data_config.train_split"),
        (["data_config.block_size=0"], "data_config.block_size"),
        (["data_config.truncate=0"], "data_config.truncate"),
        (["trainer_config.batch_size=0"], "trainer_config.batch_size"),
        (["optimizer_config.learning_rate=0"], "optimizer_config.learning_rate"),
        (["optimizer_config.learning_rate=-1e-3"], "optimizer_config.learning_rate"),
        (["optimizer_config.lr_schedule=linear"], "optimizer_config.lr_schedule"),
        (["optimizer_config.algorithm=sgd"], "optimizer_config.algorithm"),
        (["optimizer_config.muon_learning_rate=0"], "optimizer_config.muon_learning_rate"),
        (["optimizer_config.muon_momentum=1.0"], "optimizer_config.muon_momentum"),
        (["optimizer_config.cooldown_fraction=0"], "optimizer_config.cooldown_fraction"),
        (["optimizer_config.eps=1e-300"], "optimizer_config.eps"),
        (
            ["optimizer_config.muon_momentum_warmup_steps=-1"],
            "optimizer_config.muon_momentum_warmup_steps",
        ),
        (
            ["optimizer_config=muon", "trainer_config.parallelism=fsdp"],
            "optimizer_config.algorithm",
        ),
        (["trainer_config.device=tpu"], "trainer_config.device"),
        (["trainer_config.amp_dtype=fp8"], "trainer_config.amp_dtype"),
        (["trainer_config.ddp_comm_hook=int8"], "trainer_config.ddp_comm_hook"),
        (["trainer_config.max_steps=0"], "trainer_config.max_steps"),
        (["trainer_config.run_name=a/b"], "trainer_config.run_name"),
        (["trainer_config.run_name=.."], "trainer_config.run_name"),
        (["trainer_config.run_name=lr-multirun"], "trainer_config.run_name"),
        (["trainer_config.powersgd_start_step=1"], "trainer_config.powersgd_start_step"),
        (["trainer_config.localsgd_period=1"], "trainer_config.localsgd_period"),
        (["trainer_config.localsgd_start_step=-1"], "trainer_config.localsgd_start_step"),
        (["trainer_config.localsgd_group=world"], "trainer_config.localsgd_group"),
        (["trainer_config.parallelism=zero3"], "trainer_config.parallelism"),
        # a list in the list got past OmegaConf's List[str] into a traceback
        (["trainer_config.stop_signals=[[SIGTERM]]"], "trainer_config.stop_signals"),
        (["trainer_config.stop_signals=[{a: 1}]"], "trainer_config.stop_signals"),
        (
            ["trainer_config.parallelism=fsdp", "trainer_config.ddp_comm_hook=powersgd"],
            "trainer_config.ddp_comm_hook",
        ),
        (
            [
                "trainer_config.parallelism=fsdp",
                "trainer_config.use_amp=true",
                "trainer_config.amp_dtype=fp16",
            ],
            "trainer_config.amp_dtype",
        ),
    ],
)
def test_invalid_values_raise_config_error_naming_the_key(overrides, key):
    cfg = composed(*overrides)
    with pytest.raises(ConfigError) as e:
        OmegaConf.to_object(cfg)
    message = str(e.value)
    assert message.startswith(f"{key}: ") and "\n" not in message


@pytest.mark.parametrize(
    "valid,inside,outside",
    [
        (">= 1", [1, 2**70], [0, -1, math.inf, math.nan, True, "2"]),
        ("> 0", [1e-12, 5], [0, -1e-12, math.inf]),
        ("[0, 1)", [0, 0.5], [1, -0.1, math.nan]),
        ("(0, 1]", [1, 1e-9], [0, 1.1]),
        ("[0, 2**63)", [0, 2**63 - 1], [-1, 2**63]),
    ],
)
def test_a_keys_range_holds_its_bounds_and_only_finite_numbers(valid, inside, outside):
    """`valid=` as the fields write it: each bound open or closed as its bracket says, exact for
    integers past float's precision, and never a bool, a string, nan or inf."""
    assert all(in_range(value, valid) for value in inside), inside
    assert not any(in_range(value, valid) for value in outside), outside


PRESETS = {
    "openai-gpt": (12, 12, 768),
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
    "gopher-44m": (8, 16, 512),
    "gpt-mini": (6, 6, 192),
    "gpt-micro": (4, 4, 128),
    "gpt-nano": (3, 3, 48),
    "ddp-tutorial": (8, 8, 512),
    "gpu-quick": (6, 6, 384),
}


@pytest.mark.parametrize("name", PRESETS)
def test_model_presets(name):
    cfg = config(f"gpt_config={name}")
    g = cfg.gpt_config
    assert (g.n_layer, g.n_head, g.n_embd) == PRESETS[name]
    assert cfg.trainer_config == Config().trainer_config  # a model preset touches only the model


def test_a_corpus_named_like_a_number_is_told_how_to_quote_it():
    """data_config.path=1 is read as a number: the refusal gives the override that names the
    file, and that override does."""
    with pytest.raises(ConfigError) as e:
        OmegaConf.to_object(composed("data_config.path=1"))
    quoted = 'data_config.path="1"'
    assert str(e.value).endswith(f"(a number: for a file of that name, '{quoted}')"), e.value
    assert OmegaConf.to_object(composed(quoted)).data_config.path == "1"


def test_the_shapes_in_the_docs_are_the_presets():
    """docs/configuration.md's Presets give each model preset's layers/heads/width."""
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    presets = " ".join(page.split("\n## Presets\n")[1].split("\n## ")[0].split())
    shown = {}
    for names, *shape in re.findall(r"((?:`[\w-]+`(?: and )?)+) (\d+)/(\d+)/(\d+)", presets):
        for name in re.findall(r"`([\w-]+)`", names):
            shown[name] = tuple(map(int, shape))
    model = config().gpt_config
    assert shown == {**PRESETS, "default": (model.n_layer, model.n_head, model.n_embd)}


def test_model_preset_can_still_be_overridden():
    g = config("gpt_config=gpt2", "gpt_config.n_layer=2").gpt_config
    assert (g.n_layer, g.n_head, g.n_embd) == (2, 12, 768)


def test_ddp_tutorial_experiment_is_the_tutorial_recipe():
    cfg = config("experiment=ddp-tutorial")
    g, o, d, t = cfg.gpt_config, cfg.optimizer_config, cfg.data_config, cfg.trainer_config
    assert (g.n_layer, g.n_head, g.n_embd, g.dropout) == (8, 8, 512, 0.1)
    assert (d.block_size, d.train_split, d.truncate) == (128, 0.9, 0.05)
    assert t.batch_size == 216 and t.grad_accum_steps == 1
    assert (o.learning_rate, o.weight_decay, tuple(o.betas)) == (3e-4, 0.1, (0.9, 0.95))
    assert o.lr_schedule == "constant" and o.warmup_steps == 0
    assert t.grad_norm_clip == 1.0
    assert (t.max_epochs, t.max_steps, t.save_every) == (10, None, 3)
    assert t.use_amp and t.amp_dtype == "fp16"


def test_gpu_quick_experiment():
    cfg = config("experiment=gpu-quick")
    g = cfg.gpt_config
    assert (g.n_layer, g.n_head, g.n_embd) == (6, 6, 384)
    assert cfg.data_config.block_size == 256


def test_muon_preset_and_an_experiments_warmup():
    # the preset's measured settings (docs/training.md); an experiment's own warmup comes after it
    o = config("optimizer_config=muon").optimizer_config
    assert (o.algorithm, o.warmup_steps, o.muon_momentum) == ("muon", 0, 0.9)
    o = config("experiment=gpu-quick", "optimizer_config=muon").optimizer_config
    assert (o.algorithm, o.warmup_steps, o.muon_momentum) == ("muon", 100, 0.9)


def test_experiment_can_be_overridden_on_the_command_line():
    cfg = config("experiment=ddp-tutorial", "trainer_config.max_epochs=1")
    assert cfg.trainer_config.max_epochs == 1 and cfg.trainer_config.batch_size == 216


@pytest.mark.parametrize("order", ["experiment-first", "model-first"])
@pytest.mark.parametrize(
    "experiment, dropout, block_size", [("ddp-tutorial", 0.1, 128), ("gpu-quick", 0.2, 256)]
)
def test_a_model_preset_on_the_command_line_wins_over_the_experiments(
    order, experiment, dropout, block_size
):
    overrides = [f"experiment={experiment}", "gpt_config=gpt-nano"]
    cfg = config(*(overrides if order == "experiment-first" else reversed(overrides)))
    g = cfg.gpt_config
    assert (g.n_layer, g.n_head, g.n_embd) == (3, 3, 48)  # the chosen model...
    # ...in the rest of the recipe
    assert g.dropout == dropout and cfg.data_config.block_size == block_size


def run_dir(*overrides: str) -> str:
    return composed(*overrides, hydra_config=True).hydra.run.dir


def test_run_directory_comes_from_the_run_name_and_the_config_not_the_clock():
    assert run_dir() == "runs/default"
    assert run_dir("trainer_config.run_name=shakespeare") == "runs/shakespeare"
    assert run_dir("hydra.run.dir=/tmp/elsewhere") == "/tmp/elsewhere"
    hydra = composed("trainer_config.run_name=x", hydra_config=True).hydra
    assert hydra.sweep.dir == "runs/x-multirun"
    # job N in runs/x-multirun/N
    assert OmegaConf.to_container(hydra.sweep, resolve=False)["subdir"] == "${hydra.job.num}"
    assert hydra.job.chdir is False
    assert hydra.output_subdir is None  # .hydra/ is written by mingpt.cli once the run is accepted


def test_every_config_of_a_run_name_shares_its_run_directory():
    """The name alone places a run (the snapshot's config check refuses other values there); an
    experiment names its own run."""
    for changed in (
        ["optimizer_config.learning_rate=1e-3"],
        ["trainer_config.max_epochs=5", "optimizer_config.learning_rate=1e-3"],
        ["gpt_config=gpt-mini"],
        ['data_config.path="/data/a b,c=d.txt"'],
        ["trainer_config.init_from=runs/default"],
    ):
        assert run_dir(*changed) == "runs/default"
        assert run_dir(*changed, "trainer_config.run_name=x") == "runs/x"
    assert run_dir("experiment=ddp-tutorial") == "runs/ddp-tutorial"
    assert run_dir("experiment=gpu-quick", "trainer_config.run_name=mine") == "runs/mine"


@pytest.mark.parametrize("key", sorted(OPERATIONAL_KEYS - {"trainer_config.run_name"}))
def test_operational_keys_keep_the_run_directory(key):
    field = key.split(".")[1]
    value = {
        "device": "cpu",
        "snapshot_path": "/tmp/s.pt",
        "compile": "true",
        "allow_config_change": "true",
        "async_save": "false",
        "stop_signals": "[SIGTERM]",
        "placement": "host",
        "activation_checkpointing": "true",
    }.get(field, "7")
    assert run_dir(f"{key}={value}") == "runs/default"


# Every key that changes what a run computes. A new field must be marked operational in
# mingpt/config.py or added here: a key that neither lists fails the test below.
RESULT_AFFECTING = {
    "gpt_config": {"n_layer", "n_head", "n_embd", "dropout", "vocab_size", "block_size"},
    "optimizer_config": {
        "learning_rate",
        "weight_decay",
        "betas",
        "eps",
        "lr_schedule",
        "warmup_steps",
        "min_lr_ratio",
        "cooldown_fraction",
        "algorithm",
        "muon_learning_rate",
        "muon_momentum",
        "muon_momentum_warmup_steps",
    },
    "data_config": {"path", "block_size", "train_split", "truncate", "stride"},
    "trainer_config": {
        "max_epochs",
        "max_steps",
        "batch_size",
        "grad_accum_steps",
        "grad_norm_clip",
        "seed",
        "eval_tokens",
        "use_amp",
        "amp_dtype",
        "amp_on_cpu",
        "parallelism",
        "ddp_comm_hook",
        "powersgd_rank",
        "powersgd_start_step",
        "localsgd_start_step",
        "localsgd_period",
        "localsgd_group",
        "early_stop_patience",
        "early_stop_min_delta",
        "init_from",
    },
}


def test_every_field_is_classified_as_operational_or_result_affecting():
    result = {f"{section}.{key}" for section, keys in RESULT_AFFECTING.items() for key in keys}
    every = {
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(Config)
        for f in dataclasses.fields(section.default_factory)
    }
    assert not OPERATIONAL_KEYS & result
    assert every == OPERATIONAL_KEYS | result, (
        f"not classified: {sorted(every - OPERATIONAL_KEYS - result)}"
    )
    # Found drifting from the hand-kept list (issue 21): none changes what a run computes.
    assert {
        "trainer_config.save_every_minutes",
        "trainer_config.stop_signals",
        "data_config.placement",
        "data_config.cache_dir",
    } <= OPERATIONAL_KEYS


def test_readme_commands_each_get_their_own_run_directory():
    """The Quick start's `python main.py` lands in runs/default (the README says
    so); a later example with other values either continues it on purpose
    (allow_config_change) or names a run of its own."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    lines = re.findall(r"^(?:.*&& |OMP_NUM_THREADS=\d+ )?python main\.py(.*)$", readme, re.M)
    commands = [shlex.split(line.split("#")[0]) for line in lines]
    runs = [args for args in commands if not {"-m", "--cfg"} & set(args)]
    assert runs[0] == [] and run_dir() == "runs/default" and "`runs/default`" in readme
    continued = [args for args in runs[1:] if "trainer_config.allow_config_change=true" in args]
    assert continued and all(run_dir(*args) == "runs/default" for args in continued)
    named = [args for args in runs[1:] if args not in continued]
    dirs = [run_dir(*args) for args in named]
    assert len(named) >= 5 and len(set(dirs)) == len(dirs), list(zip(named, dirs, strict=True))
    assert "runs/default" not in dirs


def test_every_config_folder_is_a_declared_package_with_its_yaml_files():
    """pip/setuptools warn for each folder of conf/ that pyproject.toml leaves out
    of `packages`, and a non-editable install needs their YAML files."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"
    ]
    assert setuptools["package-dir"] == {"mingpt.conf": "conf"}
    folders = {"mingpt.conf"} | {
        f"mingpt.conf.{p.name}"
        for p in (REPO / "conf").iterdir()
        if p.is_dir() and p.name != "__pycache__"
    }
    assert folders <= set(setuptools["packages"])
    assert all(setuptools["package-data"][name] == ["*.yaml"] for name in folders)


def test_cfg_package_prints_one_value(tmp_path):
    """`--cfg job -p KEY` prints the value of KEY, null too (Hydra took a null value for a missing
    key: its line, without `error:`, and exit status 1); hydra.run.dir resolved in the whole config
    (Hydra failed on its ${trainer_config.run_name}, outside the part --cfg hydra prints); a value
    set only in a run, one error line."""
    cases = [["--cfg", part, "-p", "trainer_config.max_steps"] for part in ("job", "all")]
    cases.append(["--cfg", "job", "-p", "trainer_config.batch_size"])
    cases.append(["--cfg", "hydra", "-p", "hydra.run.dir"])
    cases.append(["--cfg", "hydra", "-p", "hydra.sweep.subdir"])  # ${hydra.job.num}
    results = run_each("mingpt.cli", [(tmp_path, argv) for argv in cases])
    assert [(r.returncode, r.stdout, r.stderr) for r in results[:-1]] == [
        (0, "null\n", ""),
        (0, "null\n", ""),
        (0, "12\n", ""),
        (0, "runs/default\n", ""),
    ]
    unset = results[-1]
    assert unset.returncode == 2 and unset.stdout == "", unset.stderr
    assert unset.stderr.startswith("error: hydra.sweep.subdir: ") and unset.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_no_preset_restates_an_operational_default():
    """The dataclasses are the one source of a default: a preset that sets an operational key to
    it (log_every: 50 in both experiments) only copies it, and keeps the old value once the
    default changes. A result-affecting key at its default can be a recipe's own value (the
    tutorial's weight decay) and stays."""
    defaults = OmegaConf.to_container(OmegaConf.structured(Config))
    for path in sorted((REPO / "conf").glob("*/*.yaml")):
        preset = OmegaConf.to_container(OmegaConf.load(path))
        if path.parent.name != "experiment":  # a group's file is that section's
            preset = {path.parent.name: preset}
        for section, values in preset.items():
            if section in ("defaults", "hydra"):
                continue
            for key, value in values.items():
                name = f"{section}.{key}"
                restated = name in OPERATIONAL_KEYS and value == defaults[section][key]
                assert not restated, f"{path.relative_to(REPO)}: {name}: {value}"


def test_making_the_key_tables_of_a_file_that_is_not_the_page_is_one_line(tmp_path):
    """`python -m mingpt.config --markdown FILE` with a FILE that cannot be read, or lacks a
    section's lines, ended in a traceback; the file is left as it was."""
    (tmp_path / "page.md").write_text("# Configuration\n<!-- keys: gpt_config -->\n")
    (tmp_path / "latin1.md").write_bytes(b"caf\xe9\n")
    cases = {
        "missing.md": "No such file or directory",
        "page.md": "no line <!-- end --> after <!-- keys: gpt_config -->",
        "latin1.md": "'utf-8' codec can't decode byte 0xe9 in position 3",
        ".": "Is a directory",
    }
    run_module = "import runpy\nrunpy.run_module('mingpt.config', run_name='__main__')\n"
    results = run_each(
        "-c", [(tmp_path, [run_module, "--markdown", name]) for name in cases], timeout=RUN_DEADLINE
    )
    for (name, says), result in zip(cases.items(), results, strict=True):
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"error: {name}: {says}"), result.stderr
        assert result.stderr.count("\n") == 1, result.stderr
    assert (tmp_path / "page.md").read_text() == "# Configuration\n<!-- keys: gpt_config -->\n"


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        ([], []),
        (["optimizer_config=muon"], []),  # its muon_momentum acts
        (
            ["optimizer_config.muon_momentum=0.9", "optimizer_config.cooldown_fraction=0.5"],
            [
                "optimizer_config.cooldown_fraction=0.5 has no effect with "
                "optimizer_config.lr_schedule=cosine: it acts with wsd",
                "optimizer_config.muon_momentum=0.9 has no effect with "
                "optimizer_config.algorithm=adamw: it acts with muon",
            ],
        ),
        (["optimizer_config.lr_schedule=wsd", "optimizer_config.cooldown_fraction=0.5"], []),
        (
            ["trainer_config.powersgd_rank=4", "trainer_config.amp_dtype=fp16"],
            [
                "trainer_config.amp_dtype=fp16 has no effect with trainer_config.use_amp=false: "
                "it acts with true",
                "trainer_config.powersgd_rank=4 has no effect with "
                "trainer_config.ddp_comm_hook=none: it acts with powersgd or batched_powersgd",
            ],
        ),
        (["trainer_config.ddp_comm_hook=batched_powersgd", "trainer_config.powersgd_rank=4"], []),
        (
            ["trainer_config.early_stop_min_delta=0.1"],
            [
                "trainer_config.early_stop_min_delta=0.1 has no effect with "
                "trainer_config.early_stop_patience=null: it acts with any value but null"
            ],
        ),
        (["trainer_config.early_stop_patience=3", "trainer_config.early_stop_min_delta=0.1"], []),
    ],
)
def test_a_key_set_where_it_has_no_effect_is_warned(overrides, warned):
    """Muon's keys with AdamW, wsd's cooldown with cosine, PowerSGD's rank without PowerSGD,
    early stopping's min_delta without a patience: the run goes on, and says so at its start (they
    were accepted without a word)."""
    from mingpt.cli import checked_config

    cfg = composed(*overrides, hydra_config=True)
    _, notices = checked_config(
        OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"]), cfg.hydra
    )
    assert sorted(notices) == warned
