"""The operator's third floor: reconcile I/O. Each job's loop observes (API server, Redis stream), asks the
decisions below, applies their actions with one status patch per pass, and counts it in the metrics.
"""
