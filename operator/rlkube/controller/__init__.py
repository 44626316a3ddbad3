"""The kopf operator: thin handlers over pure builders and pure decisions, plus the Redis event watcher."""
