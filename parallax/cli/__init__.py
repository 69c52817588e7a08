"""The ``parallax`` command (``demo``, ``explain``, ``plan``, ``bench``, ``launch``): its
parser (:mod:`~parallax.cli.main`), the demo, the strategy presets it names, and the
``explain`` / ``plan`` commands on the reference GPTs."""

from parallax.cli.main import build_parser as build_parser
from parallax.cli.main import main as main
from parallax.cli.main import simulate_cpu_devices as simulate_cpu_devices
