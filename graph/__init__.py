"""reelflow's engine: graph spec and validation, scheduling, execution, traces, metrics, reports.

It knows nothing of models: stages (in `stages/`) wrap them, and the engine only sees their ports.
"""
