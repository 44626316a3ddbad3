"""The kopf operator, in four folders, each a floor over the ones below it: manifests (pure), decisions (pure),
reconcile (the I/O of each job's loop) and process (handlers, election, webhook). docs/design.md §10 maps them.
"""
