"""The cluster DNS's records (tests/cluster/dns.py): what CoreDNS's kubernetes plugin answers for the same objects."""

from __future__ import annotations

from cluster.dns import records


def test_records_of_clusterip_and_headless_services():
    services = {
        ("default", "kubernetes"): {"spec": {"clusterIP": "10.96.0.1"}},
        ("team", "job-trainer"): {"spec": {"clusterIP": "None"}},
        ("team", "no-endpoints"): {"spec": {"clusterIP": "None"}},
    }
    endpoints = {
        ("default", "kubernetes"): {"subsets": [{"addresses": [{"ip": "192.0.2.2"}]}]},
        ("team", "job-trainer"): {"subsets": [{"addresses": [{"ip": "10.88.0.5", "hostname": "job-trainer-0"}],
                                               "notReadyAddresses": [{"ip": "10.88.0.6", "hostname": "job-trainer-1"}]}]},
        ("team", "orphan"): {"subsets": [{"addresses": [{"ip": "10.88.0.9"}]}]},
    }
    assert records(services, endpoints) == [
        ("10.88.0.5", "job-trainer-0.job-trainer.team.svc.cluster.local"),
        ("10.88.0.6", "job-trainer-1.job-trainer.team.svc.cluster.local"),
        ("10.88.0.5", "job-trainer.team.svc.cluster.local"),
        ("10.88.0.6", "job-trainer.team.svc.cluster.local"),
        ("10.96.0.1", "kubernetes.default.svc.cluster.local"),
    ]
