"""`StreamKeys.all()` names every key the roles create (the operator deletes exactly those from an external
Redis at teardown). The integration test tests/integration/roles/test_job_keys.py checks it against a real run; these
checks cover keys a short run may not create (the stall-release lock) and keep roles from building key names
themselves."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import rlkube.core
from rlkube.contract import protocol
from rlkube.core.actor.lag import LagKeys

CORE = Path(rlkube.core.__file__).parent


def test_all_names_the_actor_lag_counters_and_the_streams():
    keys = protocol.StreamKeys.for_job("ns", "job")
    everything = keys.all()
    assert len(set(everything)) == len(everything)
    assert all(k.startswith("ns/job/") for k in everything)
    lag = dataclasses.astuple(LagKeys.for_job(keys))
    assert set(lag) <= set(everything)
    assert {keys.events, keys.documents, keys.rollouts} <= set(everything)
    assert set(everything) == {keys.events, keys.documents, keys.rollouts, *lag, keys.filtered_groups,
                               keys.filtered_samples, keys.episodes, keys.evaluated, keys.sample_records,
                               keys.evaluation_samples}


def test_fast_llm_jobs_use_its_fixed_stream_names():
    keys = protocol.StreamKeys.for_job("ns", "job", "fast-llm")
    assert keys.events == "fast_llm_events" and keys.documents == "fast_llm_streaming"
    assert set(keys.all()) >= {"fast_llm_events", "fast_llm_streaming", "rollouts", "actor/samples_reserved"}


def test_no_role_builds_a_key_name_from_the_prefix_itself():
    """Key names come from StreamKeys' properties only: a role writing `keys.prefix + "..."` would create a key
    that all() does not know, and teardown would leave it in the user's Redis."""
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name == "protocol.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.prefix\b", line):
                offenders.append(f"{path.relative_to(CORE)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
