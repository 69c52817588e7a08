"""docs/design.md's "Where things live" lists every module of the package, and no other."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]


def test_the_map_lists_every_module():
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^(parallax/\S+\.py)\s", section, flags=re.M))
    present = {str(p.relative_to(ROOT)) for p in (ROOT / "parallax").rglob("*.py")}
    assert not present - listed, f"missing from docs/design.md: {sorted(present - listed)}"
    assert not listed - present, f"listed but gone: {sorted(listed - present)}"
