"""Scripts written against the import paths from before round 3 keep running, warned."""

import importlib
import pathlib
import sys
import warnings

import pytest

from parallax import old_import_paths


@pytest.mark.parametrize("old, new", sorted(old_import_paths.MOVED.items()))
def test_an_old_path_imports_the_moved_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}: import it from there"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_from_import_of_an_old_path():
    sys.modules.pop("parallax.demo", None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        from parallax.demo import demo_tokens
        from parallax.cli.demo import demo_tokens as moved
    assert demo_tokens is moved
    assert [str(w.message).split(":")[0] for w in seen] == ["parallax.demo moved to parallax.cli.demo"]


def test_every_new_path_exists_and_no_old_path_is_still_a_file():
    for old, new in old_import_paths.MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        parent, _, leaf = old.rpartition(".")
        folders = importlib.util.find_spec(parent).submodule_search_locations
        assert not any((pathlib.Path(f) / f"{leaf}.py").exists() for f in folders), (
            f"{old} is a module again: its alias would hide it")


def test_unknown_paths_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("parallax.no_such_module")


@pytest.mark.parametrize("package, old, new", [(p, o, n) for p, names in
                                                sorted(old_import_paths.RENAMED.items())
                                                for o, n in names.items()])
def test_a_renamed_public_name_still_answers_with_a_warning(package, old, new):
    module = importlib.import_module(package)
    with pytest.warns(DeprecationWarning, match=rf"{package}.{old} is now {package}.{new}"):
        assert getattr(module, old) is getattr(module, new)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nothing'"):
        getattr(module, "nothing")
