"""Hydra configs, installed as the package mingpt.conf (see pyproject.toml); the YAML files are the
content."""
