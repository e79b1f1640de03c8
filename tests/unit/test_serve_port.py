"""``meshlm serve`` checks its ``--host``/``--port`` before it loads the model: a port in use
was found only after the model had loaded (half a minute for a real one) and the server
had printed its address.  tests/dist/test_serve.py serves for real."""

from __future__ import annotations

import socket
import sys
import types

import pytest

from meshlm.app.serve import check_port
from meshlm.core.errors import ConfigError


@pytest.fixture()
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_port_in_use_names_the_flag(busy_port):
    with pytest.raises(ConfigError) as e:
        check_port("127.0.0.1", busy_port)
    msg = str(e.value)
    assert msg.startswith(f"--port {busy_port}: cannot listen on 127.0.0.1:{busy_port}") and "another port" in msg, msg
    check_port("127.0.0.1", 0)  # any free port
    with pytest.raises(ConfigError, match="--port 70000 is not a port number"):
        check_port("127.0.0.1", 70000)
    with pytest.raises(ConfigError, match="--host no-such-host.invalid --port 8000: not an address"):
        check_port("no-such-host.invalid", 8000)


def test_serve_on_a_port_in_use_fails_before_loading_the_model(busy_port, monkeypatch, capsys, tmp_path):
    """One line and status 1 from the command, before it reads the source (which does not
    exist here, so loading it would have failed with another message)."""
    from meshlm.app.cli import main

    for name in ("fastapi", "uvicorn"):  # installed or not: the check comes before they are used
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert main(["serve", str(tmp_path / "no_model"), "--port", str(busy_port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"meshlm serve: error: --port {busy_port}: cannot listen") and err.count("\n") == 1, err
