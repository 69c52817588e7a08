"""Every notebook starts with the same setup cell (install parallax, choose the devices);
only its first line (the source, extras and device count) may differ."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def setup_cell(path):
    notebook = nbformat.read(path, as_version=4)
    lines = next(c.source for c in notebook.cells if c.cell_type == "code").splitlines()
    settings = next(i for i, line in enumerate(lines) if line.startswith("PARALLAX_SOURCE"))
    return lines[:settings] + lines[settings + 1:], lines[settings]


def test_every_notebook_starts_with_the_shared_setup_cell():
    reference, _ = setup_cell(NOTEBOOKS[0])
    assert any("jax_num_cpu_devices" in line for line in reference)
    for path in NOTEBOOKS:
        cell, settings = setup_cell(path)
        assert cell == reference, f"{path.name}: the setup cell differs from {NOTEBOOKS[0].name}"
        assert settings.startswith("PARALLAX_SOURCE, PARALLAX_EXTRAS, DEVICES_NEEDED = ")
