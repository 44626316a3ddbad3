"""One module per policy of the judgement; each exposes `check(evidence, spec) -> Verdict`."""
