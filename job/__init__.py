"""The job layer: one `python -m run` job on top of the engine. It validates the job's config,
runs its requests through the executor, and writes the run dir (plan, trace, timeline, metrics,
summary). What an answer is, how many video tokens a prompt had and which model was the target or
the draft are known here, not in the engine (graph/)."""
