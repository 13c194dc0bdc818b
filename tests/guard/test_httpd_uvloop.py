"""The guard's HTTP server (gateway/httpd.py) on uvloop, the loop the guard runs on
(gateway/eventloop.py): every case of test_httpd again, with uvloop's transports."""

from __future__ import annotations

import pytest

uvloop = pytest.importorskip("uvloop")

from test_httpd import *  # noqa: E402,F403  (collected again here, on uvloop)
from test_httpd import h  # noqa: E402,F401  (the fixture)
from uvloopkit import event_loop_policy, pytestmark, test_loop_is_uvloop  # noqa: E402,F401
