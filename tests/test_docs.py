"""The documentation against the code: docs/configuration.md's key tables list
exactly the fields of the four config dataclasses, with their defaults, and
every relative link in README.md and docs/ reaches a file and, with an
#anchor, a heading of it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from conftest import REPO
from hydra.core.override_parser.overrides_parser import OverridesParser

from mingpt.config import DataConfig, GPTConfig, OptimizerConfig, TrainerConfig
from mingpt.optim import lr_at

SECTIONS = {"gpt_config": GPTConfig, "optimizer_config": OptimizerConfig, "data_config": DataConfig,
            "trainer_config": TrainerConfig}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def split_cell(cell: str) -> list[str]:
    """`8, 100` to ['8', '100']; a list (`[0.9, 0.99]`) stays one value."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(cell):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(cell[start:i])
            start = i + 1
    return [part.strip() for part in [*parts, cell[start:]]]


def key_table(section: str) -> dict[str, str]:
    """The keys and default cells of the table under the heading `## `section`...`."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    heading = re.search(rf"^## `{section}`.*$", text, re.M)
    assert heading, f"docs/configuration.md has no heading for {section}"
    table = re.search(r"^\|.*?(?=^[^|]|\Z)", text[heading.end():], re.M | re.S)
    assert table, f"no key table under {heading.group(0)}"
    rows = {}
    for row in table.group(0).splitlines()[2:]:  # after the header and |---|
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        keys = [key.strip("` ") for key in cells[0].split(",")]
        defaults = split_cell(cells[1])
        if len(defaults) == 1:
            defaults *= len(keys)
        assert len(defaults) == len(keys), row
        for key, default in zip(keys, defaults):
            assert key not in rows, f"{section}.{key} is listed twice"
            rows[key] = default
    return rows


def field_default(field: dataclasses.Field):
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


@pytest.mark.parametrize("section", SECTIONS)
def test_key_table_lists_every_field_with_its_default(section):
    fields = {field.name: field for field in dataclasses.fields(SECTIONS[section])}
    rows = key_table(section)
    assert sorted(rows) == sorted(fields), (f"{section}: missing from the table {sorted(set(fields) - set(rows))}, "
                                            f"not fields {sorted(set(rows) - set(fields))}")
    parser = OverridesParser.create()
    for key, cell in rows.items():
        written = parser.parse_override(f"{section}.{key}={cell}").value()  # as typed on the command line
        default = field_default(fields[key])
        if isinstance(default, tuple):
            default = list(default)
        assert written == default, f"{section}.{key}: the table says {cell}, the dataclass {default!r}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", path.read_text(encoding="utf-8")), re.M):
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
    total = 2 * 1308  # the default run's steps (its first log line says so)
    shown = [(int(step), lr) for doc in documents()
             for step, lr in re.findall(r"INFO train step (\d+) epoch \d+ \| loss \S+ lr (\S+)", doc.read_text("utf-8"))]
    assert shown
    for step, lr in shown:
        assert float(lr) == pytest.approx(lr_at(step - 1, OptimizerConfig(), total), rel=1e-3), (step, lr)


def test_the_operational_keys_named_in_the_docs_are_the_codes():
    """docs/run-directory.md names the keys that leave a run's directory alone: the fields marked operational."""
    from mingpt.config import OPERATIONAL_KEYS

    text = (REPO / "docs" / "run-directory.md").read_text(encoding="utf-8")
    paragraph = re.search(r"Every key changes the result except.*?They are the fields marked", text, re.S)
    assert paragraph, "docs/run-directory.md no longer lists the operational keys"
    named = set(re.findall(r"`(\w+)`", paragraph.group(0))) - set(SECTIONS)
    assert named == {key.split(".")[1] for key in OPERATIONAL_KEYS}
