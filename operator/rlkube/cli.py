"""`rlkube` command line: one entry point, each subcommand implemented in the module that owns it.

Each subcommand imports its module when it runs (here inside the functions, elsewhere by name): `rlkube validate`
or `rlkube operator` on the base install must not load what `rlkube local` needs (the training stack).
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _crd(args: argparse.Namespace) -> int:
    from rlkube.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _validate(args: argparse.Namespace) -> int:
    import yaml

    from rlkube.controller.manifests.names import job_name_error
    from rlkube.lifecycle.validation import SpecError, importable_errors, parse_manifest, published_images

    with open(args.file) as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d is not None]
    status = 0
    if all(_other_kind(doc) for doc in docs):
        print(f"{args.file}: no TrainingJob in this file", file=sys.stderr)
        status = 1
    for doc in docs:
        if _other_kind(doc):
            # A manifest may carry what the job needs (its password Secret, its checkpoint PVC): not ours to check.
            meta = doc.get("metadata") or {}
            print(f"{doc.get('kind')}/{meta.get('name')}: skipped (not a TrainingJob)")
            continue
        try:
            meta, spec = parse_manifest(doc)
            # On the project's images, an entry point must import from what they hold, as here (rlkube and its
            # dependencies); a user's image may hold anything, and its actor checks at start (exit 78).
            if published_images(spec) and (errs := importable_errors(spec)):
                raise SpecError(errs)
            # The operator's rule for names its children can carry (the same function refuses the job there).
            if (bad_name := job_name_error(str(meta["name"]), spec)) is not None:
                status = 1
                print(f"{args.file}: {bad_name}", file=sys.stderr)
                continue
            print(f"{meta['name']}: valid")
        except SpecError as exc:
            status = 1
            for err in exc.errors:
                print(f"{args.file}: {err}", file=sys.stderr)
    return status


def _other_kind(doc) -> bool:
    """A document of another API group and kind (a Secret, a PVC); a TrainingJob with a typo is still checked."""
    from rlkube.api.spec import GROUP, KIND

    if not isinstance(doc, dict):
        return False
    group = str(doc.get("apiVersion", "")).rpartition("/")[0]
    return doc.get("kind") != KIND and group != GROUP and bool(doc.get("kind"))


def _cluster_args(p: argparse.ArgumentParser) -> None:
    """Where a TrainingJob named as a run is (its files are read through the API server, rlkube.runs.kube)."""
    p.add_argument("-n", "--namespace", default="default", help="the job's namespace (a TrainingJob name)")
    p.add_argument("--kubeconfig", default=None, help="the cluster (default $KUBECONFIG, ~/.kube/config, in-cluster)")
    p.add_argument("--context", default=None, help="the kubeconfig context")


def _samples_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="a local run's output directory (or its samples.jsonl), or a TrainingJob's name")
    _cluster_args(p)
    p.add_argument("--step", action="append", default=None, metavar="STEP",
                   help="only this step (30) or inclusive range (20:40, 40:); repeatable")
    p.add_argument("--last", type=int, default=None, metavar="N", help="only the newest N steps kept")
    p.add_argument("--kind", choices=("train", "evaluation"), default=None, help="training samples or the evaluation's")
    p.add_argument("--min-reward", type=float, default=None)
    p.add_argument("--max-reward", type=float, default=None)
    p.add_argument("--json", action="store_true", help="one JSON list of the rows on stdout")
    p.add_argument("--width", type=int, default=None, help="table width (default: the terminal's)")
    p.add_argument("--verbose", action="store_true", help="say where the samples were read (stderr)")


def _lazy(target: str):
    """Dispatch to `module:function(args) -> int`, imported only when that subcommand runs."""

    def run(args: argparse.Namespace) -> int:
        module, func = target.split(":")
        return getattr(importlib.import_module(module), func)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkube", description="LLM reinforcement learning on Kubernetes.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("crd", help="print the TrainingJob CustomResourceDefinition (YAML)")
    p.set_defaults(func=_crd)

    p = sub.add_parser("validate", help="check TrainingJob manifests without a cluster")
    p.add_argument("file")
    p.set_defaults(func=_validate)

    p = sub.add_parser("tasks", help="list the built-in rollout tasks")
    p.set_defaults(func=_lazy("rlkube.core.actor.tasks:cli"))

    p = sub.add_parser("local", help="run a TrainingJob manifest as local processes")
    p.add_argument("file", help="TrainingJob manifest (YAML)")
    p.add_argument("--output-dir", default=None, help="where checkpoints, logs and plots go")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last stdout line")
    p.add_argument("--model-cache", default=None, help="where hf:// and builtin:// models are materialized once "
                   "for every role (default $RLKUBE_MODEL_CACHE, else ~/.cache/rlkube/models)")
    p.set_defaults(func=_lazy("rlkube.local.runner:cli"))

    p = sub.add_parser("samples", help="print the rollout samples a job kept (spec.samples)")
    _samples_args(p)
    p.set_defaults(func=_lazy("rlkube.runs.samples:run"))

    p = sub.add_parser("report", help="one self-contained HTML report of a run, or of two runs overlaid")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a local run's output directory or a TrainingJob's name; "
                   "a second RUN is overlaid on the first")
    p.add_argument("-o", "--output", default=None, help="the HTML file (default: report-RUN.html here)")
    _cluster_args(p)
    p.set_defaults(func=_lazy("rlkube.runs.report:cli"))

    p = sub.add_parser("operator", help="run the kopf operator")
    p.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster")
    p.add_argument("--peering", default=None, help="kopf peering object name (pauses this operator while "
                   "another one of higher or equal priority runs; elects no leader)")
    p.add_argument("--standalone", action="store_true", help="no kopf peering")
    p.add_argument("--leader-elect", action="store_true",
                   help="replicas: act only while holding a coordination.k8s.io Lease (standby otherwise)")
    p.add_argument("--lease-name", default="rlkube-operator", help="the leader election Lease")
    p.add_argument("--lease-namespace", default=None,
                   help="namespace of the Lease (default: $POD_NAMESPACE, or the pod's service account namespace)")
    p.add_argument("--lease-duration", type=float, default=15.0,
                   help="seconds a standby waits on an unrenewed Lease before taking it")
    p.add_argument("--lease-renew-deadline", type=float, default=10.0,
                   help="seconds the leader keeps trying to renew before it stops (exits)")
    p.add_argument("--lease-retry-period", type=float, default=2.0,
                   help="seconds between renewals, and between a standby's attempts")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0 disables)")
    p.add_argument("--image-registry", default=None, metavar="HOST/PREFIX",
                   help="pull the project's role images (ghcr.io/rlkube/NAME:TAG, spec.image's default) from "
                   "HOST/PREFIX/NAME:TAG instead (the chart's imageRegistry; `make push REGISTRY=...`)")
    p.add_argument("--liveness", default=None, help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--webhook-port", type=int, default=0,
                   help="serve the validating admission webhook over TLS on this port (0: not served)")
    p.add_argument("--webhook-cert-dir", default="/etc/rlkube/webhook",
                   help="directory holding the webhook's tls.crt and tls.key (a kubernetes.io/tls Secret)")
    p.set_defaults(func=_lazy("rlkube.controller.process.entry:cli"))

    # Benchmarks live in rlkube.bench (the top floor: nothing shipped imports it). `operator` needs only the base
    # install and a cluster; `pipeline` and `serve` run the training core (the `core` extra).
    bench = sub.add_parser("bench", help="benchmarks that print numbers").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("pipeline", help="pipelined vs synchronous RL on this machine")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last stdout line")
    p.add_argument("--samples", type=int, default=None, help="samples per mode")
    p.add_argument("--manifest", default=None, help="TrainingJob manifest to run (default: a tiny CPU job)")
    p.set_defaults(func=_lazy("rlkube.bench.pipeline:cli"))
    p = bench.add_parser("operator", help="N TrainingJobs at once against a real API server")
    p.add_argument("--json", action="store_true", help="print one JSON list (one object per N) on stdout")
    p.add_argument("-n", "--jobs", dest="n", type=int, action="append", default=None,
                   help="jobs at once (repeatable; default 50 and 200)")
    p.add_argument("--kubeconfig", default=None,
                   help="the cluster to use (default $KUBECONFIG; `make bench` starts a local control plane)")
    p.add_argument("--kube-controller-manager", default=None, metavar="PATH",
                   help="kube-controller-manager binary for the Job controller baseline (default "
                        "$KUBE_CONTROLLER_MANAGER_BIN, PATH, then where `make control-plane` builds it)")
    p.add_argument("--no-baseline", action="store_true", help="skip the Job controller baseline")
    p.set_defaults(func=_lazy("rlkube.bench.operator:cli"))
    p = bench.add_parser("loss-memory", help="peak memory of one loss + backward: full logits vs chunked")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (Qwen2/3's by default)")
    p.add_argument("--tokens", type=int, default=4096, help="predicted tokens in the micro-batch")
    p.add_argument("--sequences", type=int, default=4, help="sequences the tokens are split into")
    p.add_argument("--hidden", type=int, default=16, help="hidden size of the random model")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked loss")
    p.add_argument("--temperature", type=float, default=1.0)
    p.set_defaults(func=_lazy("rlkube.bench.loss_memory:cli"), variant=None, out=None)
    p = bench.add_parser("weight-receive", help="a receiver's extra peak memory in one weight update: all buckets "
                         "first (before) vs streamed into the model")
    p.add_argument("--vocab", type=int, default=151_936, help="the random model's shape: Qwen2-0.5B's by default")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="transfer and served dtype")
    p.add_argument("--bucket-megabytes", type=int, default=None,
                   help="default: the smallest multiple of 32 MiB that holds the largest tensor")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_lazy("rlkube.bench.weight_receive:cli"), receiver=None)
    p = bench.add_parser("serve", help="inference throughput and weight-update latency on this machine")
    p.add_argument("--json", action="store_true")
    p.add_argument("--engine", choices=("native", "vllm"), default="native",
                   help="vllm: needs vllm here or RLKUBE_VLLM_PYTHON (`make deps-vllm`)")
    p.add_argument("--seconds", type=float, default=5.0, help="load duration per concurrency level")
    p.add_argument("--updates", type=int, default=20, help="weight updates per measurement")
    p.set_defaults(func=_lazy("rlkube.bench.serve:cli"))
    p = bench.add_parser("inference", help="vLLM vs native tokens/s, and weight-update s/MB vs a raw gloo broadcast")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--engine", dest="engines", choices=("native", "vllm"), action="append", default=None,
                   help="engines to run (repeatable; default both; vllm needs vllm here or RLKUBE_VLLM_PYTHON)")
    p.add_argument("--model", default="builtin://tiny-llama", help="model path, as spec.model.path")
    p.add_argument("--seconds", type=float, default=10.0, help="load duration per engine")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients")
    p.add_argument("-n", type=int, default=8, help="samples per request (the actor's group size)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per sample")
    p.add_argument("--updates", type=int, default=10, help="weight updates per engine")
    p.add_argument("--repeats", type=int, default=20, help="rounds of the raw gloo broadcast")
    p.set_defaults(func=_lazy("rlkube.bench.inference:cli"))
    p = bench.add_parser("sandbox", help="a tool call through a sandbox server vs in the actor's process")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("-n", type=int, default=50, help="measured calls per path")
    p.add_argument("--url", default=None, help="a running sandbox server (a sandbox pod's http://ip:8090); "
                   "default: one started here")
    p.set_defaults(func=_lazy("rlkube.bench.sandbox:cli"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
