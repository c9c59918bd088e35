"""Prefect flows composed of the tasks in tasks/: train, pivot, audit_fork, and the embedded demo."""
