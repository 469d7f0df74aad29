"""The serve tests' server: one `flexsarathi serve` process per test module (stories260K, float32)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.flexsarathi.serve.serve_process import MAX_FILE_MIB, Server

    folder = tmp_path_factory.mktemp("serve")
    srv = Server(folder / "data", "--model", stories_dir, "--dtype", "float32",
                 "--max-file-mib", str(MAX_FILE_MIB)).start()
    yield srv
    for marker in ("hold", "hold-create"):  # a test that failed while holding the runner or a create call
        (srv.data_dir / marker).unlink(missing_ok=True)
    srv.stop()


@pytest.fixture
def client(server):
    return server.client()
