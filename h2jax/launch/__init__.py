"""Launching a plan on a cluster: hosts, launcher command lines, per-rank device visibility.

Nothing here imports JAX, the runtime or a transport: a launcher node builds the job's
command without starting a backend.
"""
