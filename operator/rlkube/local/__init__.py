"""Runs one TrainingJob as local processes: the embedded default, with the operator's teardown order."""
