"""What the benchmark scripts share: `--help`, and their default config overrides
that the user's own overrides and presets beat.

Not a benchmark itself (the leading underscore: tests/test_benchmarks.py runs
every other script in this directory)."""

from __future__ import annotations

import sys


def help_or_go_on(doc: str, argv: list[str] | None = None) -> None:
    """With -h or --help among the arguments: print the script's usage (its
    docstring) and exit 0."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(doc.strip())
        sys.exit(0)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def with_defaults(defaults: list[str], given: list[str]) -> list[str]:
    """Hydra overrides: the script's `defaults`, then the user's `given`, with each
    default left out where the user decides that key: the same key given, a preset
    of its group chosen (`gpt_config=gpt2` decides every gpt_config.* key), or a
    composed value the user's overrides change (an experiment's keys). Hydra
    applies a key override after every preset, whatever its place in the list, so
    without this `gpt_config.n_layer=4` of a script beat the user's gpt_config=gpt2."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mingpt.cli import CONF_DIR
    from mingpt.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        plain = OmegaConf.to_container(compose("config"), resolve=False)
        theirs = OmegaConf.to_container(compose("config", overrides=list(given)), resolve=False)

    def value(tree: dict, key: str):
        for part in key.split("."):
            if not isinstance(tree, dict) or part not in tree:
                return KeyError
            tree = tree[part]
        return tree

    def decided(default: str) -> bool:
        key = _key(default)
        if any(key == k or key.startswith(k + ".") for k in map(_key, given)):
            return True
        before = value(plain, key)  # a preset (a group's choice) stays unless chosen again
        return not isinstance(before, dict) and before != value(theirs, key)

    kept = [d for d in defaults if not decided(d)]
    return kept + list(given)
