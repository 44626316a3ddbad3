"""The operator process's entry point: it keeps Kubernetes client libraries out of the process before kopf loads.

kopf imports kubernetes_asyncio, kubernetes and pykube when they are installed, only to recognise their model
objects among a handler's arguments (kopf/_cogs/helpers/thirdparty.py, which treats an ImportError as "not
installed"). The operator passes kopf none: its own calls are apiclient.py's plain JSON. An image or virtual
environment that has them for other reasons (the bench and the tests use them) would otherwise cost the operator
~56 MB of RSS. A `None` in sys.modules makes their import raise ImportError, Python's documented way to block one.
"""

from __future__ import annotations

import argparse
import sys

CLIENT_LIBRARIES = ("kubernetes", "kubernetes_asyncio", "pykube")


def without_client_libraries() -> None:
    """Block the libraries not yet imported (one that already is stays: this process chose it)."""
    for name in CLIENT_LIBRARIES:
        sys.modules.setdefault(name, None)


def cli(args: argparse.Namespace) -> int:
    without_client_libraries()
    # Imported only now: kopf (which main imports) must find the client libraries already stubbed out.
    from rlkube.controller.process import main

    return main.cli(args)
