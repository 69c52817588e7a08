"""Scripts written against the import paths from before rounds 3 and 4 keep running, warned."""

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
    full = new if "." in new else f"{package}.{new}"  # a dotted name moved to another module
    where, _, name = full.rpartition(".")
    with pytest.warns(DeprecationWarning, match=rf"{package}.{old} is now {full} \(the old name "
                                                rf"will be removed in parallax 0.3\)"):
        assert getattr(module, old) is getattr(importlib.import_module(where), name)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nothing'"):
        getattr(module, "nothing")


def test_a_moved_module_still_answers_as_its_package_attribute():
    import parallax as px
    from parallax.planner.predicted import zero

    sys.modules.pop("parallax.planner.zero_memory", None)
    vars(px.planner).pop("zero_memory", None)  # set by an earlier import of the old path
    with pytest.warns(DeprecationWarning, match="parallax.planner.zero_memory moved to "
                                                "parallax.planner.predicted.zero"):
        assert px.planner.zero_memory is zero


def test_the_warning_names_the_release_that_removes_the_old_paths():
    sys.modules.pop("parallax.demo", None)
    with pytest.warns(DeprecationWarning, match=r"will be removed in parallax 0\.3\)"):
        importlib.import_module("parallax.demo")
    assert old_import_paths.REMOVED_IN == "parallax 0.3"
    assert "parallax 0.3" in old_import_paths.__doc__
