"""examples/rpc/ scripts run (2 steps) and check themselves against one process."""

import pathlib
import runpy

import pytest

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.slow]  # starts a group of its own: seconds of process start-up
EXAMPLES = pathlib.Path(__file__).parents[2] / "examples" / "rpc"


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_rpc_example_matches_one_process(script, capsys):
    import parallax.rpc as rpc
    from parallax.rpc.agent import agent_or_none

    if agent_or_none() is not None:  # the session's group (restarted by the next test using it)
        rpc.shutdown(timeout=10)
    runpy.run_path(str(EXAMPLES / script), run_name="rpc_example")["main"](2)
    assert "matches one process" in capsys.readouterr().out
