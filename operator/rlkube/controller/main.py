"""`rlkube operator`: run the kopf operator (namespaces, peering, metrics and liveness from the command line)."""

from __future__ import annotations

import argparse
import logging

import kopf

from rlkube.controller import metrics
from rlkube.controller.handlers import build_registry


def cli(args: argparse.Namespace) -> int:
    kopf.configure(verbose=False, log_prefix=True)
    # kopf logs every handler call at INFO (one line per pod event); keep its warnings and errors only.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics.serve(args.metrics_port)
    namespaces = list(args.namespace or ())
    kopf.run(
        registry=build_registry(),
        memo=kopf.Memo(),
        namespaces=namespaces,
        clusterwide=args.all_namespaces or not namespaces,
        # Without a peering object there is nothing to coordinate with: run alone unless one is named.
        standalone=args.standalone or args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    return 0
