"""Starting a rank on another host with ssh, as horovodrun's gloo launcher does.

The launcher runs ``ssh HOST 'cd DIR && exec env K=V ... COMMAND'`` for each rank on a host
that is not this machine (:func:`parallax.distributed.hosts.is_local`): the rank's whole
environment travels on the command line (the launch variables and this machine's own, minus
shell and session state), the program runs in the launcher's working directory on that host
(a shared file system, or the same checkout at the same path) and its output comes back
through ssh. The ssh process is the rank for the supervisor: when it ends, the rank ended,
with the remote program's exit status. ssh runs with a forced terminal (``-tt``), so ending
the ssh session hangs up the remote program (SIGHUP), which stops it unless it ignores
SIGHUP; its stderr then arrives merged into stdout.

Example:
  >>> ssh_command("node2", ["python", "train.py"], {"RANK": "1", "BASH_FUNC_x%%": "()"},
  ...             "/work", port=2222)[:6]
  ['ssh', '-tt', '-o', 'PasswordAuthentication=no', '-o', 'StrictHostKeyChecking=no']
  >>> ssh_command("node2", ["python", "train.py"], {"RANK": "1"}, "/work")[-1]
  'cd /work && exec env RANK=1 python train.py'

References:
  Horovod horovod/runner/gloo_run.py (``_exec_command_fn``: ``cd DIR ; env ... command`` over
  ssh) and horovod/runner/util/remote.py (``get_remote_command``).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence

# Variables that describe this shell or session, not the program's environment.
_NOT_FORWARDED = re.compile(r"BASH_FUNC_.*|OLDPWD|PWD|SHLVL|_|HOSTNAME|SSH_.*|TERM|DISPLAY|"
                            r"PARALLAX_EXIT_GATE_FD|.*_SECRET_KEY|.*_TOKEN|.*PASSWORD.*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class SshOptions:
    """horovodrun's ``-p/--ssh-port`` and ``-i/--ssh-identity-file``."""

    port: int | None = None
    identity_file: str | None = None


def forwarded(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a remote rank gets: all but shell/session state and secrets."""
    return {k: v for k, v in env.items() if _NAME.fullmatch(k) and not _NOT_FORWARDED.fullmatch(k)}


def ssh_command(host: str, command: Sequence[str], env: Mapping[str, str], cwd: str, *,
                port: int | None = None, identity_file: str | None = None) -> list[str]:
    """The local command that runs ``command`` on ``host`` in ``cwd`` with ``env``."""
    variables = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(forwarded(env).items()))
    remote = (f"cd {shlex.quote(cwd)} && exec env {variables} "
              f"{' '.join(shlex.quote(word) for word in command)}")
    ssh = ["ssh", "-tt", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
    if port is not None:
        ssh += ["-p", str(port)]
    if identity_file is not None:
        ssh += ["-i", identity_file]
    return ssh + [host, remote]
